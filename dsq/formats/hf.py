"""Hugging Face model directories: config.json, (sharded) safetensors, tokenizer files.

Reading is lazy (one tensor at a time, memory-mapped) so a model larger than RAM can be
converted; writing goes to a temporary directory that is renamed into place when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from dsq.errors import BadModelFile, DsqError, ModelNotFound, OutputExists

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


class HFModelDir:
    """An HF model directory. `config` is the text config (multimodal wrappers unwrapped)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.exists():
            raise ModelNotFound(f"{self.path} does not exist", "check the path")
        if not self.path.is_dir():
            raise BadModelFile(f"{self.path} is not a directory", "pass a .gguf file or an HF model directory")
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise BadModelFile(
                f"{self.path} has no config.json",
                "pass a Hugging Face model directory (config.json + *.safetensors) or a .gguf file",
            )
        self.config: dict[str, Any] = read_json(cfg_path, dict)
        from dsq.formats.config_check import check_config

        weights = sum(f.stat().st_size for f in self.path.glob("*.safetensors") if f.is_file())
        check_config(self.config, str(cfg_path), weight_bytes=weights or None)
        self._weight_map: dict[str, Path] | None = None
        self._handles: dict[Path, Any] = {}
        self._headers: dict[Path, dict] = {}
        self._mmap: dict[str, Any] | None = None

    @property
    def model_type(self) -> str:
        mt = self.config.get("model_type")
        if not mt:
            raise BadModelFile(f"{self.path}/config.json has no model_type", "fix or re-download it")
        return str(mt)

    def require(self, *keys: str) -> None:
        missing = [k for k in keys if k not in self.config]
        if missing:
            raise BadModelFile(
                f"{self.path}/config.json is missing {', '.join(missing)}",
                "fix or re-download the config",
            )

    # -- weights ----------------------------------------------------------------------------
    @property
    def weight_map(self) -> dict[str, Path]:
        """tensor name -> safetensors file holding it."""
        if self._weight_map is not None:
            return self._weight_map
        index = self.path / "model.safetensors.index.json"
        wm: dict[str, Path] = {}
        if index.is_file():
            wm = self._indexed_weights(index)
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise BadModelFile(
                    f"{self.path} has no *.safetensors files",
                    "dsq reads safetensors only (no pickle .bin files); convert them first",
                )
            for f in files:
                wm.update(dict.fromkeys(self.headers(f), f))
        self._weight_map = wm
        return wm

    def headers(self, f: Path) -> dict:
        """The checked header of one safetensors file (dsq.formats.safetensors_file), read once."""
        from dsq.formats.safetensors_file import read_header

        if f not in self._headers:
            self._headers[f] = read_header(f)
        return self._headers[f]

    def _indexed_weights(self, index: Path) -> dict[str, Path]:
        """tensor name -> shard from model.safetensors.index.json, each shard present and holding
        the tensors the index puts in it."""
        data = read_json(index, dict)
        names = data.get("weight_map")
        if not isinstance(names, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in names.items()):
            raise BadModelFile(f"{index}: weight_map must map tensor names to file names", "re-download the model")
        bad = next((v for v in names.values() if Path(v).name != v or v.startswith(".")), None)
        if bad is not None:
            raise BadModelFile(f"{index}: shard {bad!r} is not a file name in the model directory", "re-download the model")
        wm = {name: self.path / fname for name, fname in names.items()}
        missing = sorted({str(p.name) for p in wm.values() if not p.is_file()})
        if missing:
            raise BadModelFile(f"{self.path} is missing shard(s) {', '.join(missing)}", "re-download the model")
        for name, f in wm.items():
            if name not in self.headers(f):
                raise BadModelFile(f"{index} puts tensor {name} in {f.name}, which does not hold it",
                                   "re-download the model")
        return wm

    def tensor_names(self) -> list[str]:
        return list(self.weight_map)

    def _handle(self, name: str):
        from safetensors import safe_open

        f = self.weight_map.get(name)
        if f is None:
            raise KeyError(name)
        h = self._handles.get(f)
        if h is None:
            try:
                h = self._handles[f] = safe_open(f, framework="pt")
            except Exception as e:
                raise BadModelFile(f"{f} could not be read ({e})", "re-download it") from e
        return h

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self.headers(self.weight_map[name])[name].shape

    def get_tensor(self, name: str):
        """One tensor (torch, memory-mapped until touched)."""
        try:
            return self._handle(name).get_tensor(name)
        except (KeyError, DsqError):
            raise
        except Exception as e:
            raise BadModelFile(f"{self.weight_map[name]}: tensor {name} could not be read ({e})",
                               "re-download the model") from e

    def mmap_tensors(self) -> dict[str, Any]:
        """Every tensor as a torch view into a memory-mapped file: no copy until written to.
        Parsed once per directory (the quantization driver asks for it at every block)."""
        if self._mmap is None:
            out = {}
            for f in sorted(set(self.weight_map.values())):
                out.update(mmap_safetensors(f, self.headers(f)))
            self._mmap = {k: v for k, v in out.items() if k in self.weight_map}
        return self._mmap

    # -- tokenizer --------------------------------------------------------------------------
    def tokenizer_json(self) -> dict | None:
        p = self.path / "tokenizer.json"
        return read_json(p, dict) if p.is_file() else None

    def tokenizer_config(self) -> dict:
        p = self.path / "tokenizer_config.json"
        return read_json(p, dict) if p.is_file() else {}

    def generation_config(self) -> dict:
        p = self.path / "generation_config.json"
        return read_json(p, dict) if p.is_file() else {}

    def chat_template(self) -> str | None:
        """The chat template, wherever transformers saved it (tokenizer_config or a .jinja file)."""
        jinja = self.path / "chat_template.jinja"
        if jinja.is_file():
            return read_text(jinja)
        ct = self.tokenizer_config().get("chat_template")
        if isinstance(ct, list):  # named templates: take the default one
            named = [t for t in ct if isinstance(t, dict) and isinstance(t.get("template"), str)]
            ct = next((t["template"] for t in named if t.get("name") == "default"),
                      named[0]["template"] if named else None)
        if isinstance(ct, str) and ct:
            return ct
        cj = self.path / "chat_template.json"
        if cj.is_file():
            ct = read_json(cj, dict).get("chat_template")
            return ct if isinstance(ct, str) and ct else None
        return None


def read_text(path: Path) -> str:
    """A UTF-8 text file, or BadModelFile saying which file is unreadable."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise BadModelFile(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})", "fix or re-download it") from None
    except OSError as e:
        raise BadModelFile(f"{path} could not be read ({e.strerror or e})", "check the file") from None


def read_json(path: Path, kind: type = dict) -> Any:
    """A JSON file holding a `kind` (dict or list), or BadModelFile naming the file."""
    try:
        value = json.loads(read_text(path))
    except (ValueError, RecursionError) as e:
        raise BadModelFile(f"{path} is not valid JSON ({type(e).__name__}: {str(e)[:80]})",
                           "fix or re-download it") from None
    if not isinstance(value, kind):
        raise BadModelFile(f"{path} does not hold a JSON {'object' if kind is dict else kind.__name__}",
                           "fix or re-download it")
    return value


def mmap_safetensors(path: Path, header: dict | None = None) -> dict[str, Any]:
    """Torch views into a copy-on-write memory map of a safetensors file, from its checked header."""
    import numpy as np
    import torch

    from dsq.formats.safetensors_file import read_header

    path = Path(path)
    header = read_header(path) if header is None else header
    try:
        mm = np.memmap(path, dtype=np.uint8, mode="c") if header else None
    except (OSError, ValueError) as e:
        raise BadModelFile(f"{path} could not be mapped ({e})", "re-download it") from None
    out = {}
    for name, e in header.items():
        dtype = getattr(torch, e.torch_dtype, None)
        if dtype is None:
            raise BadModelFile(f"{path}: tensor {name} has dtype {e.dtype}, which this PyTorch cannot hold",
                               "upgrade PyTorch or convert the tensor")
        out[name] = torch.from_numpy(mm[e.start:e.end]).view(dtype).reshape(e.shape)
    return out


def rope_parameters(config: dict, layer_type: str = "full_attention") -> dict:
    """Rope settings for one layer type, from either transformers 4 or 5 config layouts."""
    rp = config.get("rope_parameters")
    if isinstance(rp, dict):
        if layer_type in rp and isinstance(rp[layer_type], dict):
            rp = rp[layer_type]
        elif any(isinstance(v, dict) for v in rp.values()):
            rp = next(v for v in rp.values() if isinstance(v, dict))
        out = dict(rp)
    else:
        out = dict(config.get("rope_scaling") or {})
        if layer_type == "sliding_attention" and "rope_local_base_freq" in config:
            out = {"rope_theta": config["rope_local_base_freq"]}
    if "type" in out and "rope_type" not in out:
        out["rope_type"] = out.pop("type")
    out.setdefault("rope_type", "default")
    if "rope_theta" not in out:
        if layer_type == "sliding_attention" and "rope_local_base_freq" in config:
            out["rope_theta"] = config["rope_local_base_freq"]
        else:
            out["rope_theta"] = config.get("rope_theta", 10000.0)
    return out


# -- writing -------------------------------------------------------------------------------
@contextmanager
def atomic_output_dir(out: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temp dir beside `out`; on success it replaces `out`, on failure it is removed."""
    out = Path(out)
    if out.exists() and not force:
        raise OutputExists(f"{out} already exists", "pass --force to overwrite it or choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.chmod(tmp, 0o777 & ~_umask())
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old) if out.is_dir() else out.unlink()
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, out)


@contextmanager
def atomic_output_file(out: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temp file path beside `out`; renamed over `out` only when the block succeeds."""
    out = Path(out)
    if out.exists() and not force:
        raise OutputExists(f"{out} already exists", "pass --force to overwrite it or choose another --out")
    if out.exists() and out.is_dir():
        raise OutputExists(f"{out} is a directory", "choose a file path for --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, out)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class ShardedSafetensorsWriter:
    """Write tensors into model-0000i-of-0000n.safetensors shards plus the index json."""

    def __init__(self, out_dir: Path, max_shard_bytes: int = 4 << 30):
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, Any] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.out_dir / f"shard-{len(self._shards):05d}.tmp"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._shards.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[Path]:
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        if n == 1:
            final = self.out_dir / "model.safetensors"
            os.replace(self._shards[0][0], final)
            return [final]
        weight_map, finals = {}, []
        for i, (p, names) in enumerate(self._shards):
            final = self.out_dir / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(p, final)
            finals.append(final)
            weight_map.update({nm: final.name for nm in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return finals


def write_json(path: Path, obj: Any) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
