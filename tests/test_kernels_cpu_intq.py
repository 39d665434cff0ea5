"""The C CPU kernels for dsq's integer layout (int4 / int8) and FP8 e4m3 weights against their torch
references: every build this CPU runs, odd shapes, several batch sizes, fresh random inputs every
run, outputs poisoned before each call."""

from __future__ import annotations

import math

import pytest
import torch

from dsq.kernels import cpu, fp8_ref, intq_ref

BUILDS = [isa for isa in cpu.supported_isas() if cpu.load(isa) is not None and hasattr(cpu.load(isa), "dsq_int_gemm")]
pytestmark = pytest.mark.skipif(not BUILDS, reason="no CPU kernels with the integer / FP8 kernels built")
BATCHES = [1, 2, 3, 4, 5, 16, 17]  # 1-4: the row dots, 5+: the tiled path
EPS32 = torch.finfo(torch.float32).eps


def close(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor, K: int) -> None:
    """y (float32 kernel) against ref (float64). A float32 dot product of K terms t_k = x_k w_k
    typically errs by ~eps sqrt(K) |t|_2 (a random walk of K roundings of partial sums); allow 32x
    that, per output. A wrong scale, zero point, code or column is off by ~|t|_2 and fails."""
    assert torch.isfinite(y).all()
    tol = 32 * EPS32 * math.sqrt(K) * (x.double() ** 2 @ (w.double() ** 2).t()).sqrt() + 1e-30
    err = ((y.double() - ref).abs() / tol).max().item()
    assert err < 1, f"error {err:.2f} x the tolerance"


def random_int(N: int, K: int, g: int, bits: int, gen: torch.Generator):
    G = K // g
    q = torch.randint(0, 2**bits, (N, K), generator=gen)
    scales = (torch.rand(N, G, generator=gen) * 0.02 + 1e-3).half()
    zeros = torch.randint(0, 2**bits, (N, G), dtype=torch.uint8, generator=gen)
    return intq_ref.pack_codes(q, bits), scales, zeros


# (N, K, g): groups of 32 / 64 / 128, per channel (g = K), K not a multiple of 64 or 128, a group that
# is not a multiple of 32 (unit tails), K = 2 * odd per channel, and tiny groups
INT_SHAPES = [(1, 256, 128), (7, 384, 128), (33, 96, 32), (130, 640, 64), (7, 2 * 37, 74), (33, 1000, 1000),
              (130, 1536, 1536), (7, 120, 40), (33, 64, 2), (1, 96, 96), (17, 4096, 128)]


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("N,K,g", INT_SHAPES)
def test_int_gemm_matches_reference(isa, bits, N, K, g):
    gen = torch.Generator().manual_seed(torch.seed())  # fresh inputs every run
    qw, scales, zeros = random_int(N, K, g, bits, gen)
    w = intq_ref.dequantize(qw, scales, zeros, bits)
    for M in BATCHES:
        x = torch.randn(M, K, generator=gen)
        out = torch.full((M, N), float("nan"))
        y = cpu.int_linear(x, qw, scales, zeros, bits, out=out, lib=cpu.load(isa))
        assert y.data_ptr() == out.data_ptr() and not torch.isnan(out).any(), f"M={M}: output not fully written"
        close(y, intq_ref.int_linear_ref(x.double(), qw, scales, zeros, bits), x, w, K)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("bits", [4, 8])
def test_int_perm_bias_and_leading_dims(isa, bits):
    gen = torch.Generator().manual_seed(torch.seed())
    N, K, g = 33, 384, 128
    qw, scales, zeros = random_int(N, K, g, bits, gen)
    perm = torch.randperm(K, generator=gen)
    bias = torch.randn(N, generator=gen)
    w = intq_ref.dequantize(qw, scales, zeros, bits)
    for shape in [(K,), (1, K), (2, 3, K), (17, K)]:
        x = torch.randn(*shape, generator=gen)
        y = cpu.int_linear(x, qw, scales, zeros, bits, perm=perm, bias=bias, lib=cpu.load(isa))
        ref = intq_ref.int_linear_ref(x.double(), qw, scales, zeros, bits, perm=perm, bias=bias)
        assert y.shape == (*shape[:-1], N) and y.dtype == x.dtype
        close(y.reshape(-1, N), ref.reshape(-1, N), x.reshape(-1, K)[:, perm], w, K)
    xb = torch.randn(2, K, generator=gen).to(torch.bfloat16)  # other dtypes in and out
    yb = cpu.int_linear(xb, qw, scales, zeros, bits, perm=perm, bias=bias, lib=cpu.load(isa))
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb, intq_ref.int_linear_ref(xb, qw, scales, zeros, bits, perm=perm, bias=bias))


def random_fp8(N: int, K: int, kind: str, gen: torch.Generator):
    w = (torch.randn(N, K, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    if kind == "tensor":
        scale = torch.rand(1, generator=gen) + 0.01
    elif kind == "channel":
        scale = torch.rand(N, 1, generator=gen) + 0.01
    else:
        scale = torch.rand(-(-N // 128), -(-K // 128), generator=gen) + 0.01
    assert fp8_ref.scale_kind(scale, N) == kind or scale.numel() == 1  # one row / block: per tensor
    return w, scale


FP8_SHAPES = [(1, 200), (7, 300), (33, 129), (130, 257), (129, 1000), (7, 33), (130, 4096)]


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
@pytest.mark.parametrize("N,K", FP8_SHAPES)
def test_fp8_gemm_matches_reference(isa, kind, N, K):
    from dsq.formats.fp8_checkpoint import fp8_dequantize

    gen = torch.Generator().manual_seed(torch.seed())
    weight, scale = random_fp8(N, K, kind, gen)
    w = fp8_dequantize(weight, scale)
    bias = torch.randn(N, generator=gen)
    for M in BATCHES:
        x = torch.randn(M, K, generator=gen)
        out = torch.full((M, N), float("nan"))
        y = cpu.fp8_linear(x, weight, scale, out=out, lib=cpu.load(isa))
        assert y.data_ptr() == out.data_ptr() and not torch.isnan(out).any(), f"M={M}: output not fully written"
        close(y, fp8_ref.fp8_linear_ref(x.double(), weight, scale), x, w, K)
    x = torch.randn(2, 3, K, generator=gen)
    y = cpu.fp8_linear(x, weight, scale, bias=bias, lib=cpu.load(isa))
    close(y.reshape(-1, N), fp8_ref.fp8_linear_ref(x.double(), weight, scale, bias).reshape(-1, N),
          x.reshape(-1, K), w, K)


@pytest.mark.parametrize("isa", BUILDS)
def test_fp8_every_code_and_nan(isa):
    """Every e4m3fn code decodes exactly (x = identity picks single weights, through the row dots
    and the tiled path); a NaN code (0x7f, 0xff) makes its row NaN and leaves the others alone."""
    codes = torch.arange(256, dtype=torch.uint8).reshape(2, 128)
    nan = (codes & 0x7F) == 0x7F
    clean = codes.masked_fill(nan, 0x3C)
    weight = clean.view(torch.float8_e4m3fn)
    eye = torch.eye(128)
    for rows in (eye[i:i + 4] for i in range(0, 128, 4)):  # M = 4: the row dots
        y = cpu.fp8_linear(rows, weight, torch.ones(1), lib=cpu.load(isa))
        assert torch.equal(y, rows @ weight.float().t())
    y = cpu.fp8_linear(eye, weight, torch.full((1,), 0.5), lib=cpu.load(isa))  # M = 128: the tiled path
    assert torch.equal(y, weight.float().t() * 0.5)
    for M in (1, 3, 5, 16):
        for n in (0, 1):
            bad = clean.clone()
            bad[n, 127 if n else 5] = codes[n][nan[n]][0]
            y = cpu.fp8_linear(torch.randn(M, 128), bad.view(torch.float8_e4m3fn), torch.ones(1), lib=cpu.load(isa))
            assert torch.isnan(y[:, n]).all() and torch.isfinite(y[:, 1 - n]).all(), (M, n)


@pytest.mark.parametrize("isa", BUILDS)
def test_int_extreme_codes(isa):
    """Codes 0 and 2^bits - 1 with zero points at both ends, against the reference exactly enough."""
    gen = torch.Generator().manual_seed(torch.seed())
    for bits in (4, 8):
        top = 2**bits - 1
        N, K, g = 8, 256, 128
        q = torch.tensor([0, top]).repeat(N, K // 2)
        qw = intq_ref.pack_codes(q, bits)
        scales = torch.full((N, K // g), 0.5).half()
        zeros = torch.tensor([0, top], dtype=torch.uint8).repeat(N, K // g // 2 + 1)[:, :K // g].contiguous()
        x = torch.randn(3, K, generator=gen)
        y = cpu.int_linear(x, qw, scales, zeros, bits, lib=cpu.load(isa))
        close(y, intq_ref.int_linear_ref(x.double(), qw, scales, zeros, bits), x,
              intq_ref.dequantize(qw, scales, zeros, bits), K)


def test_dispatch_uses_the_c_kernels(monkeypatch):
    from dsq.kernels import dispatch

    gen = torch.Generator().manual_seed(torch.seed())
    qw, scales, zeros = random_int(20, 256, 128, 4, gen)
    weight, scale = random_fp8(20, 256, "block", gen)
    x = torch.randn(2, 256, generator=gen)
    calls = []
    for name in ("int_linear", "fp8_linear"):
        real = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    fast = dispatch.int_linear(x, qw, scales, zeros, 4), dispatch.fp8_linear(x, weight, scale)
    assert calls == ["int_linear", "fp8_linear"]
    monkeypatch.setenv("DSQ_KERNELS", "reference")
    slow = dispatch.int_linear(x, qw, scales, zeros, 4), dispatch.fp8_linear(x, weight, scale)
    assert len(calls) == 2
    from dsq.formats.fp8_checkpoint import fp8_dequantize

    for f, r, w in zip(fast, slow, (intq_ref.dequantize(qw, scales, zeros, 4), fp8_dequantize(weight, scale))):
        close(f, r.double(), x, w, 256)


def test_rejects_bad_input():
    gen = torch.Generator().manual_seed(0)
    qw, scales, zeros = random_int(4, 64, 32, 4, gen)
    x = torch.randn(2, 64)
    bad_int = [
        {"x": torch.randn(2, 63)},  # wrong K
        {"x": torch.randint(0, 5, (2, 64))},  # integer x
        {"qweight": qw.to(torch.int32)},
        {"qweight": qw[0]},  # 1-D
        {"scales": scales.float()},
        {"scales": scales[:, :1].repeat(1, 3), "zeros": zeros[:, :1].repeat(1, 3)},  # 3 groups do not divide 64
        {"zeros": zeros.to(torch.int32)},
        {"zeros": zeros[:3]},
        {"bits": 3},
        {"perm": torch.arange(63)},
        {"perm": torch.arange(64).float()},
        {"bias": torch.randn(5)},
        {"out": torch.empty(2, 5)},
        {"out": torch.empty(2, 4, dtype=torch.float64)},
    ]
    for bad in bad_int:
        args = {"x": x, "qweight": qw, "scales": scales, "zeros": zeros, "bits": 4} | bad
        with pytest.raises((TypeError, ValueError)):
            cpu.int_linear(**args)
    q5, s5, z5 = random_int(4, 10, 5, 8, gen)  # groups of 5: fine for 8 bits ...
    cpu.int_linear(torch.randn(1, 10), q5, s5, z5, 8)
    with pytest.raises(ValueError):  # ... but 4 bits need even groups
        cpu.int_linear(torch.randn(1, 10), intq_ref.pack_codes(torch.zeros(4, 10), 4), s5, z5, 4)
    w, s = random_fp8(4, 200, "block", gen)
    bad_fp8 = [
        {"x": torch.randn(1, 199)},
        {"weight": w.float()},
        {"weight": w.view(torch.uint8)},
        {"scale": torch.ones(2, 2)},  # block scale of the wrong shape
        {"scale": torch.ones(1, dtype=torch.int32)},
        {"bias": torch.randn(3)},
    ]
    for bad in bad_fp8:
        args = {"x": torch.randn(1, 200), "weight": w, "scale": s} | bad
        with pytest.raises((TypeError, ValueError)):
            cpu.fp8_linear(**args)


def test_empty_batch():
    gen = torch.Generator().manual_seed(0)
    qw, scales, zeros = random_int(4, 64, 32, 8, gen)
    assert cpu.int_linear(torch.randn(0, 64), qw, scales, zeros, 8).shape == (0, 4)
    w, s = random_fp8(4, 64, "channel", gen)
    assert cpu.fp8_linear(torch.randn(0, 3, 64), w, s).shape == (0, 3, 4)
