"""The GGUF pipeline's work folder beside its output NAME, `.NAME.dsq-work/`:

    state.json            the record: the keys of the finished float.gguf and of the product
    float.gguf            an HF source's float conversion (written through a temp file here)
    imatrix.safetensors   the importance matrix, with its key in the file's metadata
    quantized.gguf        llama.cpp's output (written through a temp file here)

A key says which source and settings a file was made from. A file is trusted by the next run of
the same command only when it carries the key of that run's settings and parses; everything else
in the folder is removed. The record is rewritten after the file it describes is complete. The
product (quantized.gguf, or float.gguf for a float --type) is renamed to NAME, then the folder goes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from dsq.quant import faults
from dsq.quant.space import disk_bytes, human, remove, remove_record_last

if TYPE_CHECKING:
    import numpy as np


class Work:
    """`keys`: "float", "imatrix" and "product", each the key of what these settings make (None:
    not made by this run)."""

    def __init__(self, out: Path, keys: dict[str, str | None], float_product: bool):
        self.out, self.keys = out, keys
        self.dir = out.with_name(f".{out.name}.dsq-work")
        self.float = self.dir / "float.gguf"
        self.imatrix_file = self.dir / "imatrix.safetensors"
        self.product = self.float if float_product else self.dir / "quantized.gguf"
        try:
            self.state = json.loads((self.dir / "state.json").read_text())
        except (OSError, ValueError):
            self.state = {}

    def _has(self, name: str) -> bool:
        """The record names `name` with this run's key."""
        return self.keys[name] is not None and self.state.get(name) == self.keys[name]

    def published(self) -> bool:
        """The last run renamed its product into place and was stopped before removing the folder."""
        return self._has("product") and not self.product.exists() and self.out.exists()

    def ready(self) -> bool:
        return self._has("product") and self.product.is_file()

    def bytes(self) -> int:
        return disk_bytes(self.dir)

    def begin(self) -> None:
        """Keep what checks out for these settings; remove the rest."""
        if not self.dir.is_dir():
            remove(self.dir)
            return
        keep = {self.dir / "state.json"}
        if self._has("float") and _parses(self.float):
            keep.add(self.float)
        if self._has("product") and _parses(self.product):
            keep.add(self.product)
        if self.keys["imatrix"] and self._cached_imatrix() is not None:
            keep.add(self.imatrix_file)
        for f in self.dir.iterdir():
            if f not in keep:
                remove(f)
        files = {"float": self.float, "product": self.product}
        self.state = {k: self.state[k] for k, f in files.items() if f in keep and self._has(k)}

    def reused(self) -> list[str]:
        """What begin() kept for this run to go on from, in the order the pipeline makes them."""
        files = {"importance matrix": self.imatrix_file, "float GGUF": self.float, "quantized GGUF": self.product}
        return [name for name, f in files.items() if f.is_file() and (f != self.float or name == "float GGUF")]

    def record(self, name: str) -> None:
        self.state[name] = self.keys[name]
        tmp = self.dir / "state.json.tmp"
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.dir / "state.json")

    def imatrix(self, compute: Callable[[], dict]) -> dict[str, "np.ndarray"]:
        """The importance matrix, computed or read back as the last run saved it."""
        cached = self._cached_imatrix()
        if cached is not None:
            return cached
        from safetensors.numpy import save_file

        imat = compute()
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / "imatrix.safetensors.tmp"
        save_file(imat, str(tmp), metadata={"key": self.keys["imatrix"]})
        os.replace(tmp, self.imatrix_file)
        return imat

    def _cached_imatrix(self) -> dict | None:
        from safetensors import safe_open
        from safetensors.numpy import load_file

        try:
            with safe_open(self.imatrix_file, framework="np") as f:
                if f.metadata().get("key") != self.keys["imatrix"]:
                    return None
            return load_file(str(self.imatrix_file))
        except Exception:  # absent or damaged: compute it again
            return None

    def float_gguf(self, convert: Callable[[Path], object]) -> Path:
        """float.gguf, converted by `convert(path)` unless the last run finished it."""
        if not self._has("float"):
            self.dir.mkdir(parents=True, exist_ok=True)
            convert(self.float)
            self.record("float")
        return self.float

    def finish(self) -> None:
        """Check the product is a complete GGUF and record it."""
        from dsq.formats.gguf_file import GGUFFile

        GGUFFile(self.product)
        self.record("product")

    def publish(self) -> None:
        faults.point("gguf:rename")
        os.replace(self.product, self.out)
        faults.point("gguf:cleanup")
        self.close()

    def close(self) -> None:
        remove_record_last(self.dir)

    def tidy(self, keep: bool) -> str | None:
        """After a failure: keep what a rerun can use when `keep`, remove the rest. Says what is
        kept (None: nothing, and the folder is gone)."""
        self.begin()
        kept = [f.name for f in (self.float, self.imatrix_file, self.product) if f.is_file()]
        if not keep or not kept:
            remove(self.dir)
            return None
        return f"kept {' and '.join(kept)} ({human(self.bytes())}) in {self.dir.name} to resume from"


def _parses(f: Path) -> bool:
    from dsq.formats.gguf_file import GGUFFile

    try:
        GGUFFile(f)
        return True
    except Exception:
        return False
