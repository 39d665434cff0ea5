"""What dsq keeps in its cache (runtime/builtin.py cache_dir), and clearing it (`dsq cache`).

Only entries dsq makes are described and cleared; anything else found there is listed as not
dsq's and left alone (DSQ_CACHE may point at a folder that holds other things).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

# entry name -> what it is; each is remade when next needed
KNOWN = {
    "builtin": "the built-in model, assembled from its package, and its bf16 export",
    "converted": "HF models converted to GGUF for llama.cpp",
    "probed": "which GGUF files llama.cpp loaded without crashing, checked in a child process",
    "calibration.json": "this machine's bandwidths (dsq offload --calibrate)",
    "cpu_bandwidth.json": "a CPU bandwidth an older dsq measured",
}


@dataclass
class Entry:
    path: Path
    what: str
    bytes: int
    dsq: bool  # made by dsq (cleared by clear_cache)


def cache_contents() -> list[Entry]:
    """The cache's entries, and the built-in model's folder where DSQ_BUILTIN_CACHE puts it elsewhere."""
    from dsq.runtime.builtin import builtin_dir, cache_dir

    root = cache_dir()
    entries = [Entry(p, KNOWN.get(p.name, "not dsq's: left alone"), _size(p), p.name in KNOWN)
               for p in sorted(root.iterdir())]
    shared = builtin_dir()
    if shared.parent != root and shared.exists():
        entries.append(Entry(shared, "the built-in model (DSQ_BUILTIN_CACHE: not cleared here)", _size(shared), False))
    return [e for e in entries if e.dsq or e.bytes or e.path == shared]


def clear_cache() -> int:
    """Remove what dsq keeps in its cache; returns the bytes freed."""
    freed = 0
    for e in cache_contents():
        if e.dsq:
            _remove(e.path)
            freed += e.bytes
    return freed


def _size(p: Path) -> int:
    if p.is_symlink() or p.is_file():
        return p.lstat().st_size
    return sum(f.lstat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink(missing_ok=True)
