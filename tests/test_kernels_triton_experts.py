"""The grouped GEMV with expert indirection (triton_gemv.gemv_experts) against its torch reference:
each GGUF format the routed experts of Q4_K_M / Q8_0 files use (and the rest of them), E weights
stacked along N, (token, expert) pairs with repeated and out-of-order ids, x a row per token
(gate/up) or a row per pair (down), outputs poisoned before each call. Under TRITON_INTERPRET=1
without a GPU (triton_interp)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from triton_interp import DEV

from dsq.kernels import gguf_ref, packed, triton_gemv  # noqa: E402
from test_kernels_ref import FORMATS, random_blocks  # noqa: E402


def stacked(qtype: str, E: int, N: int, K: int, rng) -> tuple[packed.Packed, torch.Tensor]:
    """E random GGUF weights (N, K) packed as one (E * N, K) and their float32 weights (E, N, K)
    dequantized by the GGUF reference (not the packed layout's)."""
    raws = [torch.from_numpy(random_blocks(qtype, N, K, rng)) for _ in range(E)]
    p = packed.from_gguf(torch.cat(raws), qtype, K)
    return p, torch.stack([gguf_ref.dequantize(r, qtype, K) for r in raws])


def reference(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    P = ids.numel()
    rows = x.reshape(-1, x.shape[-1]).double()
    per = P // rows.shape[0]
    return torch.stack([rows[i // per] @ w[int(e)].double().t() for i, e in enumerate(ids.reshape(P))])


def run(x, p, ids, E, config=None):
    out = torch.full((ids.numel(), p.N // E), float("nan"), dtype=x.dtype, device=DEV)
    y = triton_gemv.gemv_experts(x.to(DEV), p.to(DEV), ids.to(DEV), E, out=out, config=config)
    assert y.data_ptr() == out.data_ptr()
    return y


def check(y, ref, dtype):
    assert torch.isfinite(y).all(), "an output was left unwritten (NaN poison) or overflowed"
    err = float((y.double().cpu() - ref).norm() / ref.norm())
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("E,T,k", [(4, 1, 2), (6, 3, 3), (3, 2, 1)])
@pytest.mark.parametrize("per_pair", [False, True])
def test_pairs_through_their_experts(qtype, E, T, k, per_pair):
    rng = np.random.default_rng()
    per = gguf_ref.BLOCKS[qtype][0]
    N, K = int(rng.integers(1, 20)), per * int(rng.integers(1, 4))
    p, w = stacked(qtype, E, N, K, rng)
    # ids: out of order, and (T > 1) the same expert for several tokens
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    if T > 1:
        ids[-1] = ids[0].flip(0)
    x = torch.randn(T * k if per_pair else T, K)
    cfg = {"BN": int(rng.choice([4, 8])), "BK": 64 if K % 64 == 0 else 32}
    check(run(x, p, ids, E, cfg), reference(x, w, ids), torch.float32)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_0", "Q8_0"])
@pytest.mark.parametrize("bn,bk", [(4, 256), (8, 512)])
def test_wide_tiles_and_repeated_ids(qtype, bn, bk):
    """The autotuner's tile shapes (many scale groups a tile; K not a multiple of BK: a masked
    tail, as DeepSeek-V2-Lite's 1408-wide down), bf16 x, every pair on one expert and a
    descending order."""
    rng = np.random.default_rng()
    E, N, K = 5, 9, 768 if gguf_ref.BLOCKS[qtype][0] == 256 else 352
    p, w = stacked(qtype, E, N, K, rng)
    for ids in (torch.full((2, 3), 3), torch.tensor([[4, 3, 2], [1, 0, 4]])):
        x = torch.randn(2, K).to(torch.bfloat16)
        check(run(x, p, ids, E, {"BN": bn, "BK": bk, "STAGES": 2}), reference(x.float(), w, ids), torch.bfloat16)


def test_refuses_uneven_experts():
    rng = np.random.default_rng()
    p, _ = stacked("Q8_0", 3, 4, 64, rng)
    with pytest.raises(ValueError, match="experts of equal rows"):
        triton_gemv.gemv_experts(torch.randn(1, 64), p, torch.tensor([[0, 1]]), 5)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0"])
def test_torch_reference_and_operator(qtype):
    """packed.experts_ref (what dispatch.packed_experts runs off the GPU) and the torch operator
    torch.compile keeps (ops.packed_experts_op) compute the same pairs, on CPU tensors."""
    from dsq.kernels import dispatch, ops

    rng = np.random.default_rng()
    E, N, K = 4, 6, 256
    p, w = stacked(qtype, E, N, K, rng)
    ids = torch.tensor([[3, 1], [1, 1], [0, 2]])
    for x in (torch.randn(3, K), torch.randn(6, K)):
        ref = reference(x, w, ids)
        check(packed.experts_ref(x, p, ids, E), ref, torch.float32)
        check(ops.packed_experts_op(x, p, ids, E), ref, torch.float32)
        check(dispatch.packed_experts(x, p, ids, E), ref, torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the autotuned launch needs a GPU")
@pytest.mark.parametrize("qtype,N,K", [("Q4_K", 2816, 2048), ("Q5_0", 2048, 1408), ("Q8_0", 2048, 1408),
                                       ("Q6_K", 2048, 1536)])
def test_autotuned_at_deepseek_v2_lite_shapes(qtype, N, K):
    """The autotuned launch (no fixed config) at DeepSeek-V2-Lite's expert shapes (gate/up 2 x 1408
    rows of 2048; down 2048 rows of 1408, which llama.cpp's Q4_K_M stores as Q5_0 or Q8_0), six
    experts a token out of 16 stacked, bf16 x, a token and a batch of four."""
    rng = np.random.default_rng()
    E = 16
    p, w = stacked(qtype, E, N, K, rng)
    for T in (1, 4):
        ids = torch.stack([torch.randperm(E)[:6] for _ in range(T)])
        x = torch.randn(T, K).to(torch.bfloat16)
        out = torch.full((ids.numel(), N), float("nan"), dtype=x.dtype, device="cuda")
        y = triton_gemv.gemv_experts(x.cuda(), p.to("cuda"), ids.cuda(), E, out=out)
        check(y, reference(x.float(), w, ids), torch.bfloat16)


@pytest.mark.parametrize("kind", ["channel", "block"])
def test_fp8_experts(kind):
    """FP8 experts (an HF checkpoint's, as DeepSeek-V3's): per-row or 128x128-block scales, whose
    block rows stay whole per expert (N a multiple of 128), stacked as experts_to_gpu does."""
    from dsq.kernels import fp8_ref

    E, N, K = 3, 128, 256
    ws = [(torch.randn(N, K) * 3).to(torch.float8_e4m3fn) for _ in range(E)]
    scales = [(torch.rand(N, 1) if kind == "channel" else torch.rand(1, 2)) + 0.01 for _ in range(E)]
    p = packed.Packed.cat([packed.from_fp8(w, s) for w, s in zip(ws, scales)])
    w = torch.stack([fp8_ref.fp8_linear_ref(torch.eye(K, dtype=torch.float64), wi, si).t().float()
                     for wi, si in zip(ws, scales)])
    ids = torch.tensor([[2, 0], [0, 2]])
    x = torch.randn(2, K)
    check(run(x, p, ids, E, {"BN": 16, "BK": 128}), reference(x, w, ids), torch.float32)


Q8_FORMATS = ["Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]  # packed.q8_ok at one row: every GGUF format


def reference_q8(x, w, ids):
    """reference() with x rounded to int8 per 32 elements as the int8-activation kernels do."""
    return reference(packed.dequantize_x_q8(x.float()), w, ids)


@pytest.mark.parametrize("qtype", Q8_FORMATS)
@pytest.mark.parametrize("per_pair", [False, True])
def test_q8_pairs_through_their_experts(qtype, per_pair):
    """q8_experts (x rounded to int8, dp4a) against the GGUF reference on the same rounded x."""
    from dsq.kernels import triton_gemv_q8

    rng = np.random.default_rng()
    per = gguf_ref.BLOCKS[qtype][0]
    E, T, k = 5, 2, 3
    N, K = int(rng.integers(1, 20)), per * int(rng.integers(1, 4)) if per == 256 else 96
    p, w = stacked(qtype, E, N, K, rng)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    ids[1] = ids[0].flip(0)
    x = torch.randn(T * k if per_pair else T, K)
    out = torch.full((ids.numel(), N), float("nan"), device=DEV)
    y = triton_gemv_q8.q8_experts(x.to(DEV), p.to(DEV), ids.to(DEV), E, out=out,
                                  config={"BN": int(rng.choice([2, 4])), "BK": 32 if K % 64 else 64})
    check(y, reference_q8(x, w, ids), torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the autotuned launch needs a GPU")
@pytest.mark.parametrize("qtype,N,K", [("Q4_K", 2816, 2048), ("Q5_0", 2048, 1408), ("Q8_0", 2048, 1408),
                                       ("Q6_K", 2048, 1536)])
def test_q8_autotuned_at_deepseek_v2_lite_shapes(qtype, N, K):
    """q8_experts autotuned at the shapes of test_autotuned_at_deepseek_v2_lite_shapes, and
    dispatch.packed_experts taking it (DSQ_ACT_Q8 on)."""
    from dsq.kernels import dispatch, triton_gemv_q8

    rng = np.random.default_rng()
    E = 16
    p, w = stacked(qtype, E, N, K, rng)
    pc = p.to("cuda")
    for T in (1, 4):
        ids = torch.stack([torch.randperm(E)[:6] for _ in range(T)])
        x = torch.randn(T, K).to(torch.bfloat16)
        ref = reference_q8(x.float(), w, ids)
        out = torch.full((ids.numel(), N), float("nan"), dtype=x.dtype, device="cuda")
        check(triton_gemv_q8.q8_experts(x.cuda(), pc, ids.cuda(), E, out=out), ref, torch.bfloat16)
        if dispatch.ACT_Q8:
            check(dispatch.packed_experts(x.cuda(), pc, ids.cuda(), E), ref, torch.bfloat16)
