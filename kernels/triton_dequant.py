"""A packed weight written out in a float dtype (`dequantize`), and y = x W^T through it and one
cuBLAS GEMM (`dequant_linear`): for many rows of x (prefill), where the GEMM's arithmetic
outweighs writing W once (docs/benchmarks.md#prefill). Its tiles are the tl.dot GEMM's
(triton_common.dequant_tile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from dsq.kernels.packed import Packed
from dsq.kernels.triton_common import dequant_tile, fmt_flags, plane_args, tiles_ok, x_rows


@triton.jit
def _dequant(w_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, N, K, s_w,
             s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin,
             CODES: tl.constexpr, HI_BITS: tl.constexpr, SUB: tl.constexpr, SC_ROWS: tl.constexpr,
             TWO_LEVEL: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr, MINS: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr):
    """W (N, K) in w's dtype, tile (program_id(0), program_id(1)): for a cuBLAS GEMM at many rows."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * BK
    wf = dequant_tile(lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, rn, k0, N, K, s_lo, s_hi, s_sc, s_d,
                      s_zp, s_mn, s_dmin, CODES, HI_BITS, SUB, SC_ROWS, TWO_LEVEL, ZERO, OFFSET, MINS, BN, BK)
    kk = k0 + tl.arange(0, BK)
    tl.store(w_ptr + rn[:, None] * s_w + kk[None, :], wf.to(w_ptr.dtype.element_ty),
             mask=(rn[:, None] < N) & (kk[None, :] < K))


def dequantize(p: Packed, dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None,
               config: dict | None = None) -> torch.Tensor:
    """The weight (N, K) in `dtype` on p's device, in its stored column order (act-order permuted,
    as x_rows permutes x): the same tile dequantization as the tl.dot GEMM, written out."""
    if not tiles_ok(p):
        raise ValueError(f"dequantize: groups of {p.fmt.sub} do not fit power-of-two tiles")
    planes, strides = plane_args(p)
    w = out if out is not None else torch.empty(p.N, p.K, dtype=dtype, device=p.lo.device)
    cfg = {"BN": 32, "BK": 128, **(config or {})}
    grid = (triton.cdiv(p.N, cfg["BN"]), triton.cdiv(p.K, cfg["BK"]))
    _dequant[grid](w, *planes, p.N, p.K, w.stride(0), *strides, **fmt_flags(p), **cfg, num_warps=4)
    return w


# A weight written out for cuBLAS is written and multiplied in slabs of rows of at most this many bytes:
# the transient is one slab, not the whole weight in bf16 (271 MB for Qwen2-7B's fused gate/up). Each slab
# costs a dequantize launch and a GEMM launch, and a 512-token prefill all on the GPU is bound by the
# host's launches: 32 MiB slabs (17 a Qwen2-7B layer) left the H100 idle 60% of it
# (docs/benchmarks.md#the-gpu-claims-in-three-device-calls)
SLAB_BYTES = 128 << 20


def slab_rows(N: int, K: int, element_size: int, slab_bytes: int | None = None) -> int:
    """Rows of W per slab: as few equal slabs as keep each within `slab_bytes` (SLAB_BYTES), in whole
    multiples of 128 rows (an FP8 block's rows), so no slab is a sliver."""
    limit = slab_bytes or SLAB_BYTES
    n = max(1, -(-N * K * element_size // limit))
    step = -(-(-(-N // n)) // 128) * 128
    if step > 128 and step * K * element_size > limit:  # rounding up to 128 rows passed the limit
        step -= 128
    return min(N, max(128, step))


def dequant_linear(x: torch.Tensor, p: Packed, bias: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, slab_bytes: int | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) by writing W out in x's dtype (`dequantize`) and cuBLAS GEMMs: for many
    rows of x (prefill), where the GEMM's arithmetic outweighs writing W once; in slabs of rows of
    at most `slab_bytes` (SLAB_BYTES) of W, each GEMM writing its columns of y in place. `out`
    (M, N) may be given."""
    x2 = x_rows(x, p)
    step = slab_rows(p.N, p.K, x.element_size(), slab_bytes)
    if step >= p.N:
        wt = dequantize(p, x.dtype).t()
        y = torch.mm(x2, wt, out=out) if bias is None else torch.addmm(bias.to(x.dtype), x2, wt, out=out)
        return y.reshape(*x.shape[:-1], p.N)
    y = out if out is not None else torch.empty(x2.shape[0], p.N, dtype=x.dtype, device=x.device)
    buf = torch.empty(step, p.K, dtype=x.dtype, device=x.device)
    b16 = bias.to(x.dtype) if bias is not None else None
    for a in range(0, p.N, step):
        b = min(a + step, p.N)
        wt = dequantize(p.rows(a, b), x.dtype, out=buf[:b - a]).t()
        # y[:, a:b] (row stride N, unit column stride) is a matrix cuBLAS writes directly: no temporary, no copy
        if b16 is None:
            torch.mm(x2, wt, out=y[:, a:b])
        else:
            torch.addmm(b16[a:b], x2, wt, out=y[:, a:b])
    return y.reshape(*x.shape[:-1], p.N)
