"""The C CPU kernels against the torch reference: every format, every build this CPU runs,
odd shapes, several batch sizes, outputs poisoned before each call."""

from __future__ import annotations

import platform
import shutil

import numpy as np
import pytest
import torch

from dsq.kernels import cpu, gguf_ref
from test_kernels_ref import FORMATS, INT8_X_TOL, int8_x, max_rel_err, random_blocks, reference

BUILDS = [isa for isa in cpu.supported_isas() if cpu.load(isa) is not None]
pytestmark = pytest.mark.skipif(not BUILDS, reason="no CPU kernels built")


def test_kernels_were_built_here():
    """On x86-64 Linux with a C compiler, install must have built the kernels (else every test
    below would silently skip)."""
    if platform.system() == "Linux" and platform.machine() == "x86_64" and shutil.which("gcc"):
        assert cpu.available(), cpu.library()[1]
        assert cpu.library()[1] == cpu.supported_isas()[0]


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("N,M", [(1, 1), (7, 2), (33, 16), (130, 17), (257, 5)])
def test_gemm_matches_reference(isa, qtype, N, M):
    rng = np.random.default_rng()
    per = gguf_ref.BLOCKS[qtype][0]
    K = per * int(rng.integers(1, 4)) * (1 if per == 256 else 3)  # 1-3 super-blocks, or 3-9 blocks of 32
    raw = torch.from_numpy(random_blocks(qtype, N, K, rng))
    x = torch.randn(M, K)
    out = torch.full((M, N), float("nan"))
    y = cpu.gguf_linear(x, raw, qtype, K, out=out, lib=cpu.load(isa))
    assert y.data_ptr() == out.data_ptr() and not torch.isnan(out).any()
    # relative to the size of the summed terms, not of the sum: one output (N=1, M=1) can cancel
    # to nearly zero, and a tolerance relative to it would then fail a correct kernel
    int8 = int8_x(isa, qtype, M)
    assert max_rel_err(y, *reference(x, raw, qtype, K, int8)) < (INT8_X_TOL if int8 else 1e-5)


@pytest.mark.parametrize("qtype", FORMATS)
def test_rows_and_dispatch(qtype, monkeypatch):
    from dsq.kernels import dispatch

    rng = np.random.default_rng()
    raw = torch.from_numpy(random_blocks(qtype, 50, 512, rng))
    ids = torch.tensor([[3, 49, 0], [7, 7, 12]])
    want = gguf_ref.dequantize(raw, qtype, 512)[ids]
    torch.testing.assert_close(cpu.gguf_rows(ids, raw, qtype, 512), want, rtol=0, atol=0)
    x = torch.randn(2, 3, 512)
    bias = torch.randn(50)
    assert dispatch.implementation("cpu", qtype).startswith("C")
    fast = dispatch.gguf_linear(x, raw, qtype, 512, bias)
    int8 = int8_x(cpu.library()[1], qtype, 6)
    want = reference(x.reshape(6, 512), raw, qtype, 512, int8)
    assert max_rel_err(fast.reshape(6, 50) - bias, *want) < (INT8_X_TOL if int8 else 1e-5) + 1e-6
    monkeypatch.setenv("DSQ_KERNELS", "reference")
    assert dispatch.implementation("cpu", qtype) == "torch reference"
    slow = dispatch.gguf_linear(x, raw, qtype, 512, bias)
    assert float((slow.double() - bias - reference(x.reshape(6, 512), raw, qtype, 512, False)[0].reshape(2, 3, 50))
                 .norm() / slow.norm()) < 1e-5


def test_rejects_bad_shapes():
    raw = torch.zeros(4, 34, dtype=torch.uint8)
    with pytest.raises(ValueError):
        cpu.gguf_linear(torch.randn(1, 48), raw, "Q8_0", 48)  # 48 is not a multiple of 32


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("float_path", [False, True])
def test_decode_row_dots(isa, qtype, float_path, monkeypatch):
    """M = 1 (the hand-written row dots): whole groups of blocks and a remainder, x spanning 8
    decades (x is quantized per 32 values: to 24 bits on the AVX512-VNNI path, within 1e-5 of the
    float reference; to int8 on the avx2 build, held to its own reference of that rounding), and
    the float row dots (DSQ_NO_VNNI). A non-finite x gives non-finite outputs."""
    if float_path:
        monkeypatch.setenv("DSQ_NO_VNNI", "1")
    rng = np.random.default_rng()
    per = gguf_ref.BLOCKS[qtype][0]
    K = per * (5 if per == 256 else 23)
    raw = torch.from_numpy(random_blocks(qtype, 37, K, rng))
    x = torch.randn(1, K) * torch.exp(torch.empty(1, K).uniform_(-9, 9))
    y = cpu.gguf_linear(x, raw, qtype, K, out=torch.full((1, 37), float("nan")), lib=cpu.load(isa))
    if int8_x(isa, qtype, 1):
        assert max_rel_err(y, *reference(x, raw, qtype, K, True)) < INT8_X_TOL
    else:
        ref = reference(x, raw, qtype, K, False)[0]
        assert float((y.double() - ref).norm() / ref.norm()) < 1e-5
    x[0, 77] = float("inf")
    assert not torch.isfinite(cpu.gguf_linear(x, raw, qtype, K, lib=cpu.load(isa))).any()


def test_int8_x_rounding_is_the_reference():
    """The avx2 build rounds x to int8 bit for bit as gguf_ref.round_x_q8 (the GPU's int8-x GEMV
    too): random x over decades, exact ties (x * 127 / max|x| = k + 1/2 rounds to even), blocks of
    zeros, one nonzero value, blocks too small for 127 / max|x| (zeros), the largest floats; a
    non-finite x is refused."""
    lib = cpu.load("avx2")
    if lib is None or not hasattr(lib, "dsq_round_x8"):
        pytest.skip("no avx2 build here")
    x = torch.randn(7, 320) * torch.exp(torch.empty(7, 320).uniform_(-20, 20))
    x[0, :32] = torch.tensor([127.0, -126.5, 125.5, -0.5, 0.5, 1.5, 2.5, -2.5] * 4)  # max 127: x * 1, ties
    x[0, 32:64] = torch.tensor([254.0, -253.0, 1.0, 3.0, -5.0, 7.0, 9.0, 251.0] * 4)  # max 254: x * 0.5, ties
    x[1, :32] = 0
    x[1, 32:64] = 0
    x[1, 40] = -3e-5
    x[2, :32] = torch.randn(32) * 1e-41  # subnormal: 127 / max|x| overflows
    x[2, 64:96] = torch.randn(32) * 1e-36  # just above
    x[2, 32:64] = torch.tensor([3.4e38, -3.4e38] * 16)
    xq, sx = torch.empty(7, 320, dtype=torch.int8), torch.empty(7, 10)
    assert lib.dsq_round_x8(x.data_ptr(), 7, 320, xq.data_ptr(), sx.data_ptr()) == 0
    want_q, want_s = gguf_ref.round_x_q8(x)
    assert torch.equal(xq.reshape(-1, 32).float(), want_q) and torch.equal(sx.reshape(-1, 1), want_s)
    x[3, 5] = float("nan")
    assert lib.dsq_round_x8(x.data_ptr(), 7, 320, xq.data_ptr(), sx.data_ptr()) == -1


def on_1_and_2_threads(fn):
    """fn() run with torch at 1 thread, then at 2 (the C kernels take torch's thread count)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fn()
        torch.set_num_threads(2)
        return one, fn()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("qtype", FORMATS)
def test_decode_same_bits_any_thread_count(isa, qtype):
    """M = 1: each output is one fixed sequence of operations, whatever the number of threads."""
    rng = np.random.default_rng()
    per = gguf_ref.BLOCKS[qtype][0]
    K = per * (3 if per == 256 else 13)
    raw = torch.from_numpy(random_blocks(qtype, 67, K, rng))
    x, lib = torch.randn(1, K), cpu.load(isa)
    one, two = on_1_and_2_threads(lambda: cpu.gguf_linear(x, raw, qtype, K, lib=lib))
    assert torch.equal(one, two)


@pytest.mark.parametrize("isa", BUILDS)
def test_decode_q8_0_extreme_codes(isa):
    """Q8_0 at M = 1 with every code -128 or 127 and x at the block's maximum: a lane's sum of 4
    codes times 24-bit x is beyond int32 (the VNNI path keeps it in two parts); on the avx2 build
    two codes of -128 times x rounded to +-127 sum to 2 * 128 * 127 in an int16 lane (vpmaddubsw),
    the top of its range."""
    K, N = 32 * 9, 6
    b = np.zeros((N, K // 32, 34), dtype=np.uint8)
    b[..., :2] = np.frombuffer(np.float16(0.5).tobytes(), dtype=np.uint8)
    b[0, :, 2:], b[1, :, 2:] = 0x80, 0x7F  # all -128, all 127
    b[2, :, 2:] = np.where(np.arange(32) % 2, 0x80, 0x7F)
    b[3:, :, 2:] = np.random.default_rng().integers(0, 256, (N - 3, K // 32, 32), dtype=np.uint8)
    raw = torch.from_numpy(b.reshape(N, -1))
    for x in (torch.full((1, K), 3.0), torch.full((1, K), -3.0), torch.where(torch.arange(K) % 2 == 0, 2.0, -2.0)[None],
              torch.randn(1, K)):
        y = cpu.gguf_linear(x, raw, "Q8_0", K, lib=cpu.load(isa))
        assert max_rel_err(y, *reference(x, raw, "Q8_0", K, int8_x(isa, "Q8_0", 1))) < 1e-6
