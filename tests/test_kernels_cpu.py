"""The C CPU kernels against the torch reference: every format, every build this CPU runs,
odd shapes, several batch sizes, outputs poisoned before each call."""

from __future__ import annotations

import platform
import shutil

import numpy as np
import pytest
import torch

from dsq.kernels import cpu, gguf_ref
from test_kernels_ref import FORMATS, X16_ROW_DOTS, random_blocks, x16_bound

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
    w = gguf_ref.dequantize(raw, qtype, K).double()
    ref = torch.nn.functional.linear(x.double(), w)
    # relative to the size of the summed terms, not of the sum: one output (N=1, M=1) can cancel
    # to nearly zero, and a tolerance relative to it would then fail a correct kernel
    scale = torch.nn.functional.linear(x.double().abs(), w.abs())
    x16 = x16_bound(x, w) if M == 1 and (isa, qtype) in X16_ROW_DOTS else 0
    assert float(((y.double() - ref).abs() / (1e-5 * scale + x16).clamp(min=1e-35)).max()) < 1


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
    monkeypatch.setenv("DSQ_KERNELS", "reference")
    assert dispatch.implementation("cpu", qtype) == "torch reference"
    slow = dispatch.gguf_linear(x, raw, qtype, 512, bias)
    assert float((fast - slow).norm() / slow.norm()) < 1e-5


def test_rejects_bad_shapes():
    raw = torch.zeros(4, 34, dtype=torch.uint8)
    with pytest.raises(ValueError):
        cpu.gguf_linear(torch.randn(1, 48), raw, "Q8_0", 48)  # 48 is not a multiple of 32


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("float_path", [False, True])
def test_decode_row_dots(isa, qtype, float_path, monkeypatch):
    """M = 1 (the hand-written row dots): whole groups of blocks and a remainder, x spanning 8
    decades (x is quantized per 32 values on the AVX512-VNNI path, to 24 bits, and by the avx2
    build's Q4_K / Q6_K dots, to 16 bits: those are held to their own bound, x16_bound), and the
    float row dots (DSQ_NO_VNNI). A non-finite x gives non-finite outputs."""
    if float_path:
        monkeypatch.setenv("DSQ_NO_VNNI", "1")
    rng = np.random.default_rng()
    per = gguf_ref.BLOCKS[qtype][0]
    K = per * (5 if per == 256 else 23)
    raw = torch.from_numpy(random_blocks(qtype, 37, K, rng))
    x = torch.randn(1, K) * torch.exp(torch.empty(1, K).uniform_(-9, 9))
    w = gguf_ref.dequantize(raw, qtype, K).double()
    ref = torch.nn.functional.linear(x.double(), w)
    y = cpu.gguf_linear(x, raw, qtype, K, out=torch.full((1, 37), float("nan")), lib=cpu.load(isa))
    if (isa, qtype) in X16_ROW_DOTS and not float_path:
        assert ((y.double() - ref).abs() <= x16_bound(x, w) + 1e-5 * (x.double().abs() @ w.abs().T)).all()
    else:
        assert float((y.double() - ref).norm() / ref.norm()) < 1e-5
    x[0, 77] = float("inf")
    assert not torch.isfinite(cpu.gguf_linear(x, raw, qtype, K, lib=cpu.load(isa))).any()


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
    codes times 24-bit x is beyond int32 (the VNNI path keeps it in two parts)."""
    K, N = 32 * 9, 6
    b = np.zeros((N, K // 32, 34), dtype=np.uint8)
    b[..., :2] = np.frombuffer(np.float16(0.5).tobytes(), dtype=np.uint8)
    b[0, :, 2:], b[1, :, 2:] = 0x80, 0x7F  # all -128, all 127
    b[2, :, 2:] = np.where(np.arange(32) % 2, 0x80, 0x7F)
    b[3:, :, 2:] = np.random.default_rng().integers(0, 256, (N - 3, K // 32, 32), dtype=np.uint8)
    raw = torch.from_numpy(b.reshape(N, -1))
    w = gguf_ref.dequantize(raw, "Q8_0", K).double()
    for x in (torch.full((1, K), 3.0), torch.full((1, K), -3.0), torch.where(torch.arange(K) % 2 == 0, 2.0, -2.0)[None],
              torch.randn(1, K)):
        y = cpu.gguf_linear(x, raw, "Q8_0", K, lib=cpu.load(isa))
        ref = torch.nn.functional.linear(x.double(), w)
        scale = torch.nn.functional.linear(x.double().abs(), w.abs())
        assert float(((y.double() - ref).abs() / scale).max()) < 1e-6
