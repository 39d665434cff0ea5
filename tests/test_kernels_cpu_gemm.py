"""The GGUF C kernels at M > 1 (prefill, batches: the register-blocked float tiles of the avx512
build, kernels/csrc/gguf_gemm_cpu.inc, and the integer tiles with x rounded to int8 of both x86
builds, gguf_i8gemm_cpu.inc, held to the reference of that rounding) against the float64 reference: every
format and build, M from 2 to 130 (whole and partial tiles of rows of x), odd N (partial tiles of
rows of W), K over several panels and groups (32-value formats: a partial last group), x spanning
decades, outputs poisoned before each call."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsq.kernels import cpu, gguf_ref
from test_kernels_cpu import on_1_and_2_threads
from test_kernels_ref import FORMATS, INT8_X_TOL, int8_x, max_rel_err, random_blocks, reference

BUILDS = [isa for isa in cpu.supported_isas() if cpu.load(isa) is not None]
pytestmark = pytest.mark.skipif(not BUILDS, reason="no CPU kernels built")

# (M, N, blocks per row): M and N off the 4-row tiles, K across one or more 1024-value panels and
# (M=130 with 7 super-blocks) x larger than the group of rows a thread walks its tiles with
SHAPES = [(2, 1, 1), (3, 5, 2), (4, 7, 3), (5, 13, 5), (7, 37, 4), (16, 9, 2), (17, 33, 6), (64, 3, 1),
          (129, 11, 3), (130, 21, 7)]


def _k(qtype: str, blocks: int) -> int:
    per = gguf_ref.BLOCKS[qtype][0]
    return per * blocks if per == 256 else 32 * (9 * blocks + 1)  # 32-blocks: 10 to 64 blocks


def _check(y: torch.Tensor, x: torch.Tensor, raw: torch.Tensor, qtype: str, K: int, isa: str) -> None:
    """Against the float64 reference, relative to the size of the summed terms (see
    test_kernels_cpu.py); the avx2 build's integer tiles against x rounded as they round it."""
    int8 = int8_x(isa, qtype, x.shape[0])
    assert max_rel_err(y, *reference(x, raw, qtype, K, int8)) < (INT8_X_TOL if int8 else 1e-5)


def int8_rows(request, monkeypatch, isa: str) -> None:
    """The `int8` parameter: the integer tiles (DSQ_INT8_PREFILL=1), else the default."""
    if request.node.callspec.params.get("int8"):
        if isa not in ("avx2", "avx512"):
            pytest.skip("the integer tiles are the x86 builds'")
        monkeypatch.setenv("DSQ_INT8_PREFILL", "1")
    else:
        monkeypatch.delenv("DSQ_INT8_PREFILL", raising=False)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("M,N,blocks", SHAPES)
def test_gemm_batches(isa, qtype, M, N, blocks, int8, request, monkeypatch):
    int8_rows(request, monkeypatch, isa)
    rng = np.random.default_rng()
    K = _k(qtype, blocks)
    raw = torch.from_numpy(random_blocks(qtype, N, K, rng))
    x = torch.randn(M, K) * torch.exp(torch.empty(M, K).uniform_(-4, 4))
    out = torch.full((M, N), float("nan"))
    y = cpu.gguf_linear(x, raw, qtype, K, out=out, lib=cpu.load(isa))
    assert y.data_ptr() == out.data_ptr() and not torch.isnan(out).any()
    _check(y, x, raw, qtype, K, isa)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("qtype", FORMATS)
def test_gemm_non_finite_x(isa, qtype, int8, request, monkeypatch):
    """A row of x with an inf (or a NaN) gives non-finite outputs in that row, as at M = 1; the
    other rows are unaffected (such a call takes the float tiles)."""
    int8_rows(request, monkeypatch, isa)
    rng = np.random.default_rng()
    M, N, K = 6, 13, _k(qtype, 3)
    raw = torch.from_numpy(random_blocks(qtype, N, K, rng))
    x = torch.randn(M, K)
    x[1, 77] = float("inf")
    x[4, 5] = float("nan")
    y = cpu.gguf_linear(x, raw, qtype, K, out=torch.full((M, N), float("nan")), lib=cpu.load(isa))
    assert not torch.isfinite(y[[1, 4]]).any()
    ok = [0, 2, 3, 5]
    assert torch.isfinite(y[ok]).all()
    _check(y[ok], x[ok], raw, qtype, K, "float tiles")


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("qtype", FORMATS)
def test_gemm_same_bits_any_thread_count(isa, qtype, int8, request, monkeypatch):
    """Each output is one fixed sequence of float operations: 1 and 2 threads give the same bits,
    and a row of x gives the same bits whatever the other rows of the batch."""
    int8_rows(request, monkeypatch, isa)
    rng = np.random.default_rng()
    M, N, K = 9, 45, _k(qtype, 5)
    raw = torch.from_numpy(random_blocks(qtype, N, K, rng))
    x = torch.randn(M, K)
    lib = cpu.load(isa)
    one, two = on_1_and_2_threads(lambda: cpu.gguf_linear(x, raw, qtype, K, lib=lib))
    assert torch.equal(one, two)
    other = torch.cat([x[:5], torch.randn(3, K)])  # rows 0-4 again, in another batch
    assert torch.equal(cpu.gguf_linear(other, raw, qtype, K, lib=lib)[:5], one[:5])


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("qtype", FORMATS)
def test_int8_rows_follow_the_calling_thread(isa, qtype, monkeypatch):
    """cpu.set_int8_rows (dispatch.int8_prefill: a generation's prefill): on the avx2 build, whose
    decode rounds x to int8, the calling thread's later calls at M > 1 take the integer tiles (the
    bits DSQ_INT8_PREFILL=1 gives, held to the int8-x reference; Q8_0 stays on the float tiles);
    another thread's calls, the other builds, and DSQ_INT8_PREFILL=0 keep x in float."""
    import threading

    monkeypatch.delenv("DSQ_INT8_PREFILL", raising=False)
    monkeypatch.delenv("DSQ_NO_VNNI", raising=False)
    rng = np.random.default_rng()
    M, N, K = 11, 29, _k(qtype, 4)
    raw = torch.from_numpy(random_blocks(qtype, N, K, rng))
    x = torch.randn(M, K)
    lib = cpu.load(isa)

    def call():
        return cpu.gguf_linear(x, raw, qtype, K, lib=lib)

    plain = call()
    monkeypatch.setenv("DSQ_INT8_PREFILL", "1")
    forced = call()
    monkeypatch.delenv("DSQ_INT8_PREFILL")
    cpu.set_int8_rows(True, lib=lib)
    try:
        got = call()
        other = []
        t = threading.Thread(target=lambda: other.append(call()))
        t.start()
        t.join()
        monkeypatch.setenv("DSQ_INT8_PREFILL", "0")
        off = call()
        monkeypatch.delenv("DSQ_INT8_PREFILL")
    finally:
        cpu.set_int8_rows(False, lib=lib)
    assert torch.equal(call(), plain) and torch.equal(other[0], plain) and torch.equal(off, plain)
    if isa == "avx2" and qtype != "Q8_0":
        assert torch.equal(got, forced) and not torch.equal(got, plain)
        assert max_rel_err(got, *reference(x, raw, qtype, K, True)) < INT8_X_TOL
    else:
        assert torch.equal(got, plain)
