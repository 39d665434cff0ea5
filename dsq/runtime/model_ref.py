"""Resolve what the user typed as MODEL: a .gguf file, an HF directory, a Hugging Face repo id
(dsq.runtime.hub), or nothing (built-in)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dsq.errors import BadModelFile, DsqError, ModelNotFound


@dataclass(frozen=True)
class ModelRef:
    kind: str  # "gguf" | "hf"
    path: Path  # (a model built in memory: "hf" at <memory>, NativeModel.from_model)
    builtin: bool = False
    repo: str | None = None  # the Hugging Face repo id it was fetched by

    @property
    def label(self) -> str:
        return "built-in Gemma 3 270M (Q4_K_M)" if self.builtin else self.repo or str(self.path)


def resolve_model(model: str | Path | None, console=None, revision: str | None = None) -> ModelRef:
    """A local path wins over a repo id of the same spelling; a repo id is fetched (see dsq.runtime.hub)."""
    from dsq.formats.gguf_file import is_gguf
    from dsq.runtime.hub import parse_repo_id

    if revision is not None and (model is None or str(model) == "" or Path(model).expanduser().exists()):
        raise DsqError("--revision applies to a Hugging Face repo id (org/name)",
                       f"drop it for {'the built-in model' if not model else model}")
    if model is None or str(model) == "":
        from dsq.runtime.builtin import builtin_model_path

        return ModelRef("gguf", builtin_model_path(console), builtin=True)
    p = Path(model).expanduser()
    rid = None if p.exists() or isinstance(model, Path) else parse_repo_id(str(model))
    if rid is not None:
        return _from_hub(rid, revision, console)
    if not p.exists():
        raise ModelNotFound(f"{p} does not exist",
                            "pass a .gguf file, an HF model directory, a Hugging Face repo id (org/name, "
                            "org/name:Q4_K_M), or nothing for the built-in model")
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


def _from_hub(rid, revision: str | None, console) -> ModelRef:
    from dsq.runtime.hub import HubUnreachable, RepoNotFound, fetch

    try:
        path = fetch(rid, revision, console)
    except RepoNotFound as e:  # neither: say both were tried
        raise ModelNotFound(f"{rid} is neither a local path (none here) nor a Hugging Face repo{e.detail}",
                            e.hint) from None
    except HubUnreachable as e:
        raise HubUnreachable(f"no local path {rid}, and {e.message}", e.hint) from None
    return ModelRef("gguf" if path.suffix == ".gguf" else "hf", path, repo=str(rid))


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
