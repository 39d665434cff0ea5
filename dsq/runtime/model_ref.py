"""Resolve what the user typed as MODEL: a .gguf file, an HF directory, or nothing (built-in)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dsq.errors import BadModelFile, ModelNotFound


@dataclass(frozen=True)
class ModelRef:
    kind: str  # "gguf" | "hf"
    path: Path  # (a model built in memory: "hf" at <memory>, NativeModel.from_model)
    builtin: bool = False

    @property
    def label(self) -> str:
        return "built-in Gemma 3 270M (Q4_K_M)" if self.builtin else str(self.path)


def resolve_model(model: str | Path | None, console=None) -> ModelRef:
    from dsq.formats.gguf_file import is_gguf

    if model is None or str(model) == "":
        from dsq.runtime.builtin import builtin_model_path

        return ModelRef("gguf", builtin_model_path(console), builtin=True)
    p = Path(model).expanduser()
    if not p.exists():
        raise ModelNotFound(f"{p} does not exist",
                            "pass a .gguf file, an HF model directory, or nothing for the built-in model")
    if p.is_dir():
        if not (p / "config.json").is_file():
            ggufs = sorted(p.glob("*.gguf"))
            hint = (f"did you mean {ggufs[0]}?" if ggufs
                    else "pass a Hugging Face model directory (config.json + *.safetensors) or a .gguf file")
            raise BadModelFile(f"{p} has no config.json", hint)
        return ModelRef("hf", p)
    if is_gguf(p):
        return ModelRef("gguf", p)
    raise BadModelFile(f"{p} is neither a GGUF file nor an HF model directory",
                       "pass a .gguf file or a directory with config.json")


def ensure_gguf(ref: ModelRef, console=None) -> Path:
    """A GGUF for `ref`: itself, or a cached F16 conversion of an HF directory."""
    if ref.kind == "gguf":
        return ref.path
    import hashlib

    from dsq.convert.hf_to_gguf import hf_to_gguf
    from dsq.runtime.builtin import cache_dir

    stamp = "|".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}"
                     for f in sorted(ref.path.iterdir()) if f.is_file())
    key = hashlib.sha256(f"{ref.path.resolve()}|{stamp}".encode()).hexdigest()[:16]
    out = cache_dir() / "converted" / f"{ref.path.name}-{key}.gguf"
    if out.is_file():
        return out
    from dsq.ui import convert_with_progress

    convert_with_progress(lambda cb: hf_to_gguf(ref.path, out, "auto", progress=cb),
                          f"converting {ref.path.name} to GGUF (F16, cached)", console)
    return out
