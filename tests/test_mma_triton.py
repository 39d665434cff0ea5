"""The tensor-core kernel for a few rows of x (kernels/triton_mma.py) against the packed reference:
int4 AWQ and GPTQ (act-order, per-row groups), 1-64 rows, odd N, K not a multiple of the tile,
split-K, bias, outputs poisoned before each call; and the dispatcher's choice of kernel. Under
TRITON_INTERPRET=1 on the CPU without a GPU; with one, also real shapes through the autotuner."""

from __future__ import annotations

import pytest
import torch
from triton_interp import CUDA, DEV

from dsq.kernels import packed  # noqa: E402
from dsq.kernels import triton_mma as tm  # noqa: E402
from test_kernels_ref import random_blocks  # noqa: E402
from test_kernels_triton import gptq_case  # noqa: E402


def int4(N, K, group, act_order=False):
    d = gptq_case(N, K, group, 4, act_order, v1=False)
    return packed.from_int(d["qweight"], d["scales"], d["zeros"], 4, d.get("perm"))


def want(x, p, bias=None):
    """What the kernel computes: x rounded to bf16, exact products, float64 here."""
    xb = x.to(torch.bfloat16).double()
    if p.perm is not None:
        xb = xb[:, p.perm]
    y = xb @ packed.dequantize(p).double().t()
    return y + bias.double() if bias is not None else y


def run(x, p, bias=None, config=None):
    out = torch.full((x.shape[0], p.N), float("nan"), dtype=x.dtype, device=DEV)
    y = tm.mma_linear(x.to(DEV), p.to(DEV), None if bias is None else bias.to(DEV), out=out, config=config)
    assert y.data_ptr() == out.data_ptr()
    assert torch.isfinite(y).all(), "an output was left unwritten (NaN poison)"
    return y.double().cpu()


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("M", [1, 3, 8, 9, 16, 17, 40, 64])
@pytest.mark.parametrize("group,act_order", [(64, False), (128, True), (-1, False)])
@pytest.mark.parametrize("cfg", [{"BN": 16, "BK": 128}, {"BN": 64, "BK": 256}, {"BN": 32, "BK": 128, "NG": 2}])
def test_int4_grouped(M, group, act_order, cfg):
    N, K = 40, 384  # N not a multiple of BN; K not a multiple of BK 256 (a masked tail group)
    p = int4(N, K, K if group == -1 else group, act_order)
    assert tm.supported(p, M)
    x, bias = torch.randn(M, K), torch.randn(N)
    assert rel(run(x, p, bias, cfg), want(x, p, bias)) < 1e-5


@pytest.mark.parametrize("split,bk,group,ng", [(2, 128, 128, 1), (3, 128, 64, 1), (4, 128, -1, 1), (4, 256, 128, 1),
                                               (2, 128, 64, 2), (2, 128, -1, 2), (3, 128, 128, 2)])
def test_split_k(split, bk, group, ng):
    """Programs along K leave partial sums; the last one of each row tile adds them up. K = 384:
    3 tiles of 128 (SPLIT 4: one program gets none), or 2 of 256 with a masked tail; two tiles an
    iteration (NG 2) with a masked second one. The tile counts are back at zero afterwards, so a
    second call gives the same result."""
    N, K = 40, 384
    M = 33 if split == 3 else 6  # 33 rows: 64 wide tiles of x
    p = int4(N, K, K if group == -1 else group)
    x, bias = torch.randn(M, K), torch.randn(N)
    cfg = {"BN": 16, "BK": bk, "SPLIT": split, "NG": ng}
    y1 = run(x, p, bias, cfg)
    assert rel(y1, want(x, p, bias)) < 1e-5
    ws, cnt = tm._split_scratch(torch.device(DEV), N)
    assert int(cnt.abs().sum()) == 0
    torch.testing.assert_close(run(x, p, bias, cfg), y1, rtol=1e-6, atol=1e-6)


def test_bf16_x_and_awq_zero_points():
    """AWQ's layout (zero points per group and column), x in bf16 (y in bf16)."""
    from dsq.formats import awq_gptq as disk
    from dsq.kernels import intq_ref

    N, K, g = 48, 256, 128
    q, z = torch.randint(0, 16, (N, K)), torch.randint(0, 16, (K // g, N))
    s = torch.rand(K // g, N) * 0.02 + 0.001
    t = disk.awq_tensors(q, s, z)
    d = intq_ref.from_awq(t["qweight"], t["qzeros"], t["scales"], g)
    p = packed.from_int(d["qweight"], d["scales"], d["zeros"], 4)
    x = torch.randn(5, K).to(torch.bfloat16)
    ref = x.double() @ disk.awq_dequantize(t["qweight"], t["qzeros"], t["scales"], g).double().t()
    assert rel(run(x, p, config={"BN": 32, "BK": 128}), ref) < 1e-2


def test_constant_offset_and_unsupported_formats():
    """A constant zero (offset 8, Q4_0's) takes the kernel at groups of 64; K-quants, Q5 high bits,
    groups of 32 and 17 rows do not (ValueError)."""
    import numpy as np

    rng = np.random.default_rng()
    N, K = 24, 256
    c = torch.randint(0, 16, (N, K))
    lo = (c[:, 0::2] | (c[:, 1::2] << 4)).to(torch.uint8)
    sc = (torch.rand(N, K // 64) * 0.1).half()
    p = packed.Packed(packed.Fmt(sub=64, zero=packed.Z_CONST, offset=8), N, K, lo=lo, sc=sc)
    x = torch.randn(4, K)
    assert rel(run(x, p, config={"BN": 16, "BK": 128}), want(x, p)) < 1e-5
    for qtype in ("Q4_K", "Q5_0", "Q4_0"):
        q = packed.from_gguf(torch.from_numpy(random_blocks(qtype, N, K, rng)), qtype, K)
        assert not tm.supported(q, 4)
        with pytest.raises(ValueError):
            tm.mma_linear(x.to(DEV), q.to(DEV))
    assert not tm.supported(int4(N, K, 32), 4)
    assert not tm.supported(int4(N, K, 64), 65)
    import dataclasses

    assert not tm.supported(dataclasses.replace(int4(N, 512, 256), K=384), 4)  # a group of 256 not dividing K


@pytest.mark.skipif(not CUDA, reason="real shapes, autotuned: GPU only")
@pytest.mark.parametrize("M", [2, 4, 8, 16, 40])
@pytest.mark.parametrize("N,K,group,act_order", [(4096, 4096, 128, False), (14336, 4096, 128, True),
                                                 (4096, 14336, 128, False), (6144, 4096, -1, False)])
def test_real_shapes_autotuned(M, N, K, group, act_order):
    p = int4(N, K, K if group == -1 else group, act_order)
    x = torch.randn(M, K).to(torch.bfloat16)
    y = tm.mma_linear(x.cuda(), p.to("cuda"))
    assert rel(y.double().cpu(), want(x, p)) < 1e-2


def test_dispatch_picks_the_kernel_by_rows_format_and_dtype(monkeypatch):
    """int4 grouped codes: int8 x at 1-2 rows, tensor cores at 3-64 rows of bf16/fp16 x; other
    4-bit codes (Q4_K, Q4_0, int4 g32): int8 x up to Q8_MAX_ROWS rows, then the weight-scaling
    tensor-core kernel up to 64; float32 x, 6-bit codes and more rows keep their kernels; DSQ_MMA=0 off."""
    import numpy as np

    from dsq.kernels import dispatch

    p = int4(64, 256, 128)
    bf = torch.bfloat16
    assert [dispatch.gpu_kernel(p, m, bf) for m in (1, 2, 3, 16, 17, 64, 65)] == [
        "q8", "q8", "mma", "mma", "mma", "mma", "float"]
    assert dispatch.gpu_kernel(p, 8, torch.float16) == "mma"
    assert [dispatch.gpu_kernel(p, m, torch.float32) for m in (3, 5)] == ["q8", "float"]
    rng = np.random.default_rng()
    q4k = packed.from_gguf(torch.from_numpy(random_blocks("Q4_K", 8, 256, rng)), "Q4_K", 256)
    q4_0 = packed.from_gguf(torch.from_numpy(random_blocks("Q4_0", 8, 256, rng)), "Q4_0", 256)
    q6k = packed.from_gguf(torch.from_numpy(random_blocks("Q6_K", 8, 256, rng)), "Q6_K", 256)
    for q in (q4k, q4_0, int4(64, 256, 32)):
        assert [dispatch.gpu_kernel(q, m, bf) for m in (3, 4, 5, 64, 65)] == [
            "q8", "q8", "mma_scaled", "mma_scaled", "float"]
        assert dispatch.gpu_kernel(q, 8, torch.float32) == "float"
    assert [dispatch.gpu_kernel(q6k, m, bf) for m in (1, 2, 4, 5, 8, 64)] == [
        "q8", "q8_rows", "q8_rows", "dequant", "dequant", "dequant"]  # one row at a time, then cuBLAS
    q5k = packed.from_gguf(torch.from_numpy(random_blocks("Q5_K", 8, 256, rng)), "Q5_K", 256)
    q8_0 = packed.from_gguf(torch.from_numpy(random_blocks("Q8_0", 8, 256, rng)), "Q8_0", 256)
    assert [dispatch.gpu_kernel(q5k, m, bf) for m in (4, 5, 64)] == ["q8", "dequant", "dequant"]
    assert [dispatch.gpu_kernel(q8_0, m, bf) for m in (4, 5, 127, 128)] == ["q8", "float", "float", "dequant"]
    monkeypatch.setattr(dispatch, "DEQUANT_MIN_ROWS", 0)  # DSQ_DEQUANT_ROWS=0: never written out
    assert dispatch.gpu_kernel(q6k, 8, bf) == "float"
    monkeypatch.setattr(dispatch, "ACT_Q8", False)
    assert dispatch.gpu_kernel(q6k, 2, bf) == "float"
    monkeypatch.undo()
    monkeypatch.setattr(dispatch, "MMA", False)
    assert dispatch.gpu_kernel(p, 3, bf) == "q8"
    assert dispatch.gpu_kernel(q4k, 8, bf) == "float"


@pytest.mark.skipif(not CUDA, reason="the dispatcher sends only CUDA tensors to Triton")
@pytest.mark.parametrize("M", [3, 8, 16])
def test_dispatch_runs_the_tensor_core_kernel(M):
    from dsq.kernels import dispatch

    p = int4(1024, 4096, 128, act_order=True)
    x = torch.randn(M, 4096).to(torch.float16)  # y in fp16: fine enough to tell bf16 x from int8 x
    y = dispatch.packed_linear(x.cuda(), p.to("cuda")).double().cpu()
    err, err_q8 = rel(y, want(x, p)), rel(y, packed.linear_ref_q8(x.double(), p))
    assert err < 1e-3 < err_q8, (err, err_q8)


@pytest.mark.skipif(not CUDA, reason="the dispatcher sends only CUDA tensors to Triton")
@pytest.mark.parametrize("M", [8, 40])
def test_dispatch_runs_the_scaled_kernel(M):
    import numpy as np

    from dsq.kernels import dispatch

    p = packed.from_gguf(torch.from_numpy(random_blocks("Q4_K", 1024, 4096, np.random.default_rng())), "Q4_K", 4096)
    x = torch.randn(M, 4096).to(torch.bfloat16)
    assert dispatch.gpu_kernel(p, M, x.dtype) == "mma_scaled"
    y = dispatch.packed_linear(x.cuda(), p.to("cuda")).double().cpu()
    assert rel(y, packed.linear_ref(x.double(), p)) < 1e-2


def _fmt_case(fmt, N, K):
    import numpy as np

    if fmt.startswith("int4"):
        g = int(fmt.split("-g")[1].split("-")[0])
        return int4(N, K, g, act_order=fmt.endswith("-act"))
    return packed.from_gguf(torch.from_numpy(random_blocks(fmt, N, K, np.random.default_rng())), fmt, K)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_K", "int4-g32", "int4-g128-act"])
@pytest.mark.parametrize("M", [1, 5, 16, 40])
@pytest.mark.parametrize("cfg", [{"BN": 16, "BK": 128}, {"BN": 32, "BK": 256, "SPLIT": 2}])
def test_scaled_operands(fmt, M, cfg):
    """mma_linear_scaled: weights made in bf16 per 32-element block before the MMA (K-quants' two
    levels and mins, Q4_0's offset, zero points per group), odd N, K = 768 (3 tiles of 256: a
    masked tail), bias. Weights are rounded to bf16, so the error is bf16's (~2e-3), not float's."""
    N, K = 40, 768
    p = _fmt_case(fmt, N, K)
    assert tm.supported_scaled(p, M)
    x, bias = torch.randn(M, K), torch.randn(N)
    out = torch.full((M, N), float("nan"), device=DEV)
    y = tm.mma_linear_scaled(x.to(DEV), p.to(DEV), bias.to(DEV), out=out, config=cfg)
    assert y.data_ptr() == out.data_ptr() and torch.isfinite(y).all()
    assert rel(y.double().cpu(), want(x, p, bias)) < 1e-2


def test_scaled_refuses_high_bit_formats():
    import numpy as np

    for qtype in ("Q5_0", "Q5_K", "Q6_K", "Q8_0"):
        q = packed.from_gguf(torch.from_numpy(random_blocks(qtype, 8, 256, np.random.default_rng())), qtype, 256)
        assert not tm.supported_scaled(q, 4)
        with pytest.raises(ValueError):
            tm.mma_linear_scaled(torch.randn(4, 256, device=DEV), q.to(DEV))


def test_scaled_encoding_error_is_bf16s():
    """Why _mma_s makes c exact and then one bf16 fma per pair of weights: emulated in float64 on
    Q4_0 and Q4_K (N 256, K 1024, 8 rows), its error is within 1.6x of rounding float weights once
    to bf16 (what _gemm does); writing the code as 1 + c/16 (one instruction fewer) rounds
    o - 16 s instead and is over 2x worse again. (`pytest -s -k encoding` prints the errors.)"""
    import numpy as np

    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(0)
    N, K, M = 256, 1024, 8

    def bf(t):
        return t.to(torch.bfloat16).double()

    def ex(t, sub):
        return t.double().repeat_interleave(sub, 1)[:, :K]

    for fmt in ("Q4_0", "Q4_K"):
        p = packed.from_gguf(torch.from_numpy(random_blocks(fmt, N, K, rng)), fmt, K)
        f, c, W = p.fmt, packed.codes(p).double(), packed.dequantize(p).double()
        s = ex(p.sc, f.sub) * (ex(p.d, 256) if f.two_level else 1)
        o = -(s * f.offset) - (ex(p.dmin, 256) * ex(p.mn, 32) if f.mins else 0)  # W = s c + o
        assert torch.allclose(s * c + o, W)
        x = bf(torch.randn(M, K, generator=gen))
        y = x @ W.t()
        err = {name: rel(x @ w.t(), y) for name, w in
               [("one rounding", bf(W)), ("c exact, fma", bf(bf(s) * c + bf(o))),
                ("1 + c/16", bf(bf(16 * s) * (1 + c / 16) + bf(o - 16 * s)))]}
        print(fmt, {k: f"{v:.2e}" for k, v in err.items()})
        assert err["c exact, fma"] < 1.6 * err["one rounding"]
        assert err["1 + c/16"] > 2 * err["c exact, fma"]
