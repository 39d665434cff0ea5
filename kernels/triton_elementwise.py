"""One-launch Triton kernels for a GPU decode step's small elementwise work, which torch runs as
several kernels each: an RMS norm is ~7 (cast, square, mean, add, rsqrt, multiply, cast), a rope
~7, an activation times up 2. A decode step's tensors are a few thousand values, so each of those
kernels costs its launch (~2-3 us inside a CUDA graph) and little else; with these a Llama
layer's step launches ~16 kernels instead of ~48 (counted: benchmarks/step_kernels.py,
docs/benchmarks.md#gpu-decode).

Each function computes what its torch twin in dsq/models/base.py computes (rms_norm_torch,
act_mul's torch ops, apply_rope / apply_rope_interleaved: the tests' references), rounding where
that rounds (to the input's dtype between steps), in float32 otherwise; they differ by float32
summation order and exp's last bits, i.e. at most one step of a bf16 result now and then
(tests/test_elementwise_triton.py). Runs under TRITON_INTERPRET=1 on the CPU (the CI tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from dsq.kernels import triton_gemv_q8
from dsq.kernels.triton_gemv_q8 import _q8_blocks

# a row longer than this (hidden sizes are <= 8192 in the models we run) stays with torch: one
# program holds a whole row in registers
MAX_ROW = 16384


def _rows(x: torch.Tensor) -> tuple[int, int, int, int] | None:
    """x (..., R1, N) with a unit last stride as (R0, R1, stride0, stride1): its rows as a
    two-level grid (a q/k view out of a fused projection is strided per head and per token), or
    None when its leading dims do not flatten to one stride."""
    if x.stride(-1) != 1 or x.dim() < 2:
        return None
    try:
        v = x.view(-1, x.shape[-2], x.shape[-1])
    except RuntimeError:
        return None
    return v.shape[0], v.shape[1], v.stride(0), v.stride(1)


@triton.jit
def _rms_norm_kernel(x_ptr, a_ptr, w_ptr, y_ptr, s_ptr, xw_ptr, sx_ptr, xs_ptr, xb_ptr, R1, N, sx0, sx1, sa0, sa1, ss0, ss1,
                     eps, offset, HAS_ADD: tl.constexpr, OFFSET: tl.constexpr, BLOCK: tl.constexpr,
                     Q8: tl.constexpr = False):
    r = tl.program_id(0)
    r0, r1 = r // R1, r % R1
    cols = tl.arange(0, BLOCK)
    m = cols < N
    x = tl.load(x_ptr + r0 * sx0 + r1 * sx1 + cols, mask=m, other=0.0)
    if HAS_ADD:  # the residual sum, rounded to x's dtype as torch's add rounds it
        x = (x.to(tl.float32) + tl.load(a_ptr + r0 * sa0 + r1 * sa1 + cols, mask=m, other=0.0).to(tl.float32)
             ).to(x.dtype)
        tl.store(s_ptr + r0 * ss0 + r1 * ss1 + cols, x, mask=m)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0)
    if OFFSET:  # Gemma: scale by offset + weight in float32, then cast
        y = xf * inv * (offset + w.to(tl.float32))
    else:  # Llama: cast, then scale by the weight in the product's dtype
        y = (xf * inv).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    y = y.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + r * N + cols, y, mask=m)
    if Q8:  # y rounded to int8 for the q8 GEMVs that read it next (triton_gemv_q8.offer)
        blk = tl.arange(0, BLOCK // 32)
        _q8_blocks(tl.reshape(y.to(tl.float32), (BLOCK // 32, 4, 8)), blk, blk < N // 32, xw_ptr + r * (N // 4),
                   sx_ptr + r * (N // 32), xs_ptr + r * (N // 32), True, xb_ptr + r * (N // 4), True)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
             add: torch.Tensor | None = None, q8: bool = False) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None:
    """The RMS norm over x's last dim as base.RMSNorm computes it: with `offset` (Gemma)
    x * rsqrt(mean(x^2) + eps) * (offset + weight) in float32, cast to x's dtype; without, that
    product cast to x's dtype, then times weight (in their promoted dtype). With `add`, the norm of
    s = x + add (rounded to x's dtype) and s itself: returns (s, norm). With `q8` (and N a multiple
    of 32), the norm is also rounded to int8 in nibble order in the same launch and offered to the q8
    GEMVs (triton_gemv_q8.offer). None when the shapes do not fit one launch (the caller then runs
    torch)."""
    N = x.shape[-1]
    if N > MAX_ROW or weight.shape != (N,) or not weight.is_contiguous() or x.numel() == 0:
        return None
    rx = _rows(x)
    ra = _rows(add) if add is not None else rx
    if rx is None or ra is None or (add is not None and (add.shape != x.shape or add.dtype != x.dtype)):
        return None
    out_dtype = x.dtype if offset else torch.promote_types(x.dtype, weight.dtype)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    s = torch.empty_like(x, memory_format=torch.contiguous_format) if add is not None else y
    rs = _rows(s) if add is not None else rx
    R0, R1 = rx[0], rx[1]
    xq = triton_gemv_q8.q8_room(y.numel() // N, N, y.device, both=True) if q8 and N % 32 == 0 else None
    _rms_norm_kernel[(R0 * R1,)](x, add if add is not None else x, weight, y, s, *(xq or (y, y, y, y)), R1, N, rx[2],
                                 rx[3], ra[2], ra[3], rs[2], rs[3], float(eps), float(offset), HAS_ADD=add is not None,
                                 OFFSET=bool(offset), BLOCK=triton.next_power_of_2(N), Q8=xq is not None,
                                 num_warps=4 if N <= 4096 else 8)
    if xq is not None:
        triton_gemv_q8.offer(y, xq)
    return (s, y) if add is not None else y


@triton.jit
def _act_mul_kernel(g_ptr, u_ptr, y_ptr, xw_ptr, sx_ptr, xs_ptr, xb_ptr, R1, F, sg0, sg1, su0, su1, GELU: tl.constexpr,
                    BLOCK: tl.constexpr, Q8: tl.constexpr = False):
    r = tl.program_id(0)
    r0, r1 = r // R1, r % R1
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < F
    g = tl.load(g_ptr + r0 * sg0 + r1 * sg1 + cols, mask=m, other=0.0)
    u = tl.load(u_ptr + r0 * su0 + r1 * su1 + cols, mask=m, other=0.0)
    gf = g.to(tl.float32)
    if GELU:  # torch's tanh approximation: 0.5 x (1 + tanh(t)) = x / (1 + e^-2t), exact, and no cancellation
        t = 0.7978845608028654 * (gf + 0.044715 * gf * gf * gf)
        a = gf / (1.0 + tl.exp(-2.0 * t))
    else:
        a = gf / (1.0 + tl.exp(-gf))
    a = a.to(g.dtype).to(tl.float32)  # torch rounds the activation to g's dtype before the product
    y = (a * u.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + r * F + cols, y, mask=m)
    if Q8:  # as the norm's: this program's BLOCK / 32 blocks of the row
        blk = tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
        _q8_blocks(tl.reshape(y.to(tl.float32), (BLOCK // 32, 4, 8)), blk, blk < F // 32, xw_ptr + r * (F // 4),
                   sx_ptr + r * (F // 32), xs_ptr + r * (F // 32), True, xb_ptr + r * (F // 4), True)


def act_mul(g: torch.Tensor, u: torch.Tensor, gelu: bool = False, q8: bool = False) -> torch.Tensor | None:
    """act(g) * u (silu, or gelu with the tanh approximation) as one launch: g, u (..., F) of one
    dtype with unit last strides (the two halves of a fused gate/up projection are fine); with `q8`
    (and F a multiple of 32) also rounded to int8 in nibble order and offered to the q8 GEMVs, as
    rms_norm's. None when they do not fit (the caller then runs torch)."""
    rg, ru = _rows(g), _rows(u)
    if rg is None or ru is None or g.shape != u.shape or g.dtype != u.dtype or g.numel() == 0:
        return None
    F_ = g.shape[-1]
    y = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    BLOCK = min(1024, triton.next_power_of_2(F_))
    xq = triton_gemv_q8.q8_room(y.numel() // F_, F_, y.device, both=True) if q8 and F_ % 32 == 0 else None
    _act_mul_kernel[(rg[0] * rg[1], triton.cdiv(F_, BLOCK))](g, u, y, *(xq or (y, y, y, y)), rg[1], F_, rg[2], rg[3],
                                                             ru[2], ru[3], GELU=gelu, BLOCK=BLOCK, Q8=xq is not None,
                                                             num_warps=4)
    if xq is not None:
        triton_gemv_q8.offer(y, xq)
    return y


@triton.jit
def _rope_halves(x_ptr, c_ptr, s_ptr, i, HALF: tl.constexpr):
    """One head's rope (halves): x (2 HALF) at x_ptr, cos / sin rows at c_ptr / s_ptr; the two
    rotated halves in float32."""
    x1 = tl.load(x_ptr + i).to(tl.float32)
    x2 = tl.load(x_ptr + HALF + i).to(tl.float32)
    c1 = tl.load(c_ptr + i)
    s1 = tl.load(s_ptr + i)
    c2 = tl.load(c_ptr + HALF + i)
    s2 = tl.load(s_ptr + HALF + i)
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


@triton.jit
def _rope_row(x_ptr, c_ptr, s_ptr, i, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """One head's rope, halves or interleaved pairs: the two halves of the result in float32."""
    if INTERLEAVED:  # pairs (x0, x1), (x2, x3), ...: the rotated even elements, then the odd ones,
        f1 = tl.load(x_ptr + 2 * i).to(tl.float32)  # both turned by the first half's angles
        f2 = tl.load(x_ptr + 2 * i + 1).to(tl.float32)
        c = tl.load(c_ptr + i)
        s = tl.load(s_ptr + i)
        return f1 * c - f2 * s, f2 * c + f1 * s
    return _rope_halves(x_ptr, c_ptr, s_ptr, i, HALF)


@triton.jit
def _rope_kernel(x_ptr, c_ptr, s_ptr, y_ptr, H, sx0, sx1, sc0, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    r = tl.program_id(0)  # one (token, head) row; cos/sin rows are per token
    t, h = r // H, r % H
    i = tl.arange(0, HALF)
    y1, y2 = _rope_row(x_ptr + t * sx0 + h * sx1, c_ptr + t * sc0, s_ptr + t * sc0, i, HALF, INTERLEAVED)
    out = y_ptr + r * (2 * HALF)
    tl.store(out + i, y1.to(y_ptr.dtype.element_ty))
    tl.store(out + HALF + i, y2.to(y_ptr.dtype.element_ty))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor | None:
    """base.apply_rope (halves) or apply_rope_interleaved (pairs) as one launch: x (B, T, H, D)
    with unit last stride, cos / sin (B, T, 1, D) float32 with their rows contiguous (one row per
    token). Returns a contiguous (B, T, H, D) in x's dtype, or None when the layouts do not fit."""
    if x.dim() != 4 or cos.shape != (*x.shape[:2], 1, x.shape[-1]) or sin.shape != cos.shape:
        return None
    D = x.shape[-1]
    if D % 2 or (D // 2) & (D // 2 - 1) or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        return None
    rx = _rows(x)
    try:
        c, s = cos.view(-1, D), sin.view(-1, D)
    except RuntimeError:
        return None
    if rx is None or c.stride(1) != 1 or c.stride() != s.stride() or x.numel() == 0:
        return None
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    H = x.shape[2]
    _rope_kernel[(rx[0] * H,)](x, c, s, y, H, rx[2], rx[3], c.stride(0), HALF=D // 2, INTERLEAVED=interleaved,
                               num_warps=1)
    return y


@triton.jit
def _rope_write_kernel(q_ptr, k_ptr, v_ptr, c_ptr, s_ptr, qo_ptr, kc_ptr, vc_ptr, slot_ptr, H, HK,
                       sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sc_b, skc_b, skc_h, skc_s, svc_b, svc_h, svc_s,
                       HALF: tl.constexpr):
    b = tl.program_id(0)
    j = tl.program_id(1)  # q heads, then k heads, then v heads
    i = tl.arange(0, HALF)
    c_row, s_row = c_ptr + b * sc_b, s_ptr + b * sc_b
    slot = tl.load(slot_ptr)
    if j < H:
        y1, y2 = _rope_halves(q_ptr + b * sq_b + j * sq_h, c_row, s_row, i, HALF)
        out = qo_ptr + (b * H + j) * (2 * HALF)
        tl.store(out + i, y1.to(qo_ptr.dtype.element_ty))
        tl.store(out + HALF + i, y2.to(qo_ptr.dtype.element_ty))
    elif j < H + HK:
        hk = j - H
        y1, y2 = _rope_halves(k_ptr + b * sk_b + hk * sk_h, c_row, s_row, i, HALF)
        out = kc_ptr + b * skc_b + hk * skc_h + slot * skc_s
        tl.store(out + i, y1.to(kc_ptr.dtype.element_ty))
        tl.store(out + HALF + i, y2.to(kc_ptr.dtype.element_ty))
    else:
        hk = j - H - HK
        d = tl.arange(0, 2 * HALF)
        tl.store(vc_ptr + b * svc_b + hk * svc_h + slot * svc_s + d, tl.load(v_ptr + b * sv_b + hk * sv_h + d))


def rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
    """A decode step's rope of q and k (halves) and its KV cache write, as one launch: q (B, 1, H,
    D), k / v (B, 1, Hk, D) with unit last strides (views out of a fused projection are fine),
    cos / sin (B, 1, 1, D) float32; k rotated and v written into k_cache / v_cache (B, Hk, S, D),
    of q's dtype, at slots[0] (the one slot every row writes, as KVCache.update writes it).
    Returns the rotated q (B, 1, H, D), or None when the shapes do not fit."""
    B, T, H, D = q.shape
    Hk = k.shape[2]
    if (T != 1 or k.shape != (B, 1, Hk, D) or v.shape != k.shape or D % 2 or (D // 2) & (D // 2 - 1)
            or cos.shape != (B, 1, 1, D) or sin.shape != cos.shape or cos.dtype != torch.float32
            or sin.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous()
            or k_cache.dim() != 4 or k_cache.shape[:2] != (B, Hk) or k_cache.shape[-1] != D
            or v_cache.shape != k_cache.shape or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype
            or k.dtype != q.dtype or v.dtype != q.dtype or slots.numel() < 1
            or any(t.stride(-1) != 1 for t in (q, k, v, k_cache, v_cache))):
        return None
    qo = torch.empty(B, 1, H, D, dtype=q.dtype, device=q.device)
    _rope_write_kernel[(B, H + 2 * Hk)](q, k, v, cos, sin, qo, k_cache, v_cache, slots, H, Hk, q.stride(0),
                                        q.stride(2), k.stride(0), k.stride(2), v.stride(0), v.stride(2),
                                        cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), HALF=D // 2,
                                        num_warps=1)
    return qo


@triton.jit
def _mla_write_kernel(q_ptr, c_ptr, k_ptr, w_ptr, cos_ptr, sin_ptr, qo_ptr, kc_ptr, slot_ptr, H, sq_b, sq_h, sc_b, sk_b,
                      scos_b, skc_b, skc_s, eps, RANK: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr,
                      INTERLEAVED: tl.constexpr):
    b = tl.program_id(0)
    j = tl.program_id(1)  # the query heads' rope, then the latent row
    i = tl.arange(0, HALF)
    c_row, s_row = cos_ptr + b * scos_b, sin_ptr + b * scos_b
    if j < H:
        y1, y2 = _rope_row(q_ptr + b * sq_b + j * sq_h, c_row, s_row, i, HALF, INTERLEAVED)
        out = qo_ptr + (b * H + j) * (2 * HALF)
        tl.store(out + i, y1.to(qo_ptr.dtype.element_ty))
        tl.store(out + HALF + i, y2.to(qo_ptr.dtype.element_ty))
    else:  # the latent row at the step's slot: the compressed kv normed (as _rms_norm_kernel), the key's rope
        row = kc_ptr + b * skc_b + tl.load(slot_ptr) * skc_s
        cols = tl.arange(0, BLOCK)
        m = cols < RANK
        x = tl.load(c_ptr + b * sc_b + cols, mask=m, other=0.0)
        xf = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / RANK + eps)
        w = tl.load(w_ptr + cols, mask=m, other=0.0)
        y = (xf * inv).to(x.dtype).to(tl.float32) * w.to(tl.float32)
        tl.store(row + cols, y.to(kc_ptr.dtype.element_ty), mask=m)
        y1, y2 = _rope_row(k_ptr + b * sk_b, c_row, s_row, i, HALF, INTERLEAVED)
        tl.store(row + RANK + i, y1.to(kc_ptr.dtype.element_ty))
        tl.store(row + RANK + HALF + i, y2.to(kc_ptr.dtype.element_ty))


def mla_write(q_rope: torch.Tensor, c: torch.Tensor, k_rope: torch.Tensor, weight: torch.Tensor, eps: float,
              cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, slots: torch.Tensor,
              interleaved: bool) -> torch.Tensor | None:
    """An MLA decode step's rope of the queries' rope part and its latent cache write, as one launch:
    q_rope (B, 1, H, R), c (B, 1, rank) and k_rope (B, 1, R) with unit last strides (views out of
    the projections are fine), cos / sin (B, 1, 1, R) float32; the cache row at slots[0] of
    k_cache (B, 1, S, rank + R) gets c's RMS norm (`weight`, `eps`, as base.RMSNorm without an
    offset) and k_rope rotated, as MLAttention's norm, rope, cat and KVCache.update write it.
    Everything in one dtype. Returns the rotated q_rope (B, 1, H, R), or None when the shapes
    do not fit."""
    B, T, H, R = q_rope.shape
    rank = c.shape[-1]
    dt = q_rope.dtype
    if (T != 1 or c.shape != (B, 1, rank) or k_rope.shape != (B, 1, R) or R % 2 or (R // 2) & (R // 2 - 1)
            or rank > MAX_ROW or weight.shape != (rank,) or not weight.is_contiguous()
            or cos.shape != (B, 1, 1, R) or sin.shape != cos.shape or cos.dtype != torch.float32
            or sin.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous()
            or k_cache.dim() != 4 or k_cache.shape[:2] != (B, 1) or k_cache.shape[-1] != rank + R
            or any(t.dtype != dt for t in (c, k_rope, weight, k_cache)) or slots.numel() < 1
            or any(t.stride(-1) != 1 for t in (q_rope, c, k_rope, k_cache))):
        return None
    qo = torch.empty(B, 1, H, R, dtype=dt, device=q_rope.device)
    _mla_write_kernel[(B, H + 1)](q_rope, c, k_rope, weight, cos, sin, qo, k_cache, slots, H, q_rope.stride(0),
                                  q_rope.stride(2), c.stride(0), k_rope.stride(0), cos.stride(0), k_cache.stride(0),
                                  k_cache.stride(2), float(eps), RANK=rank, BLOCK=triton.next_power_of_2(rank),
                                  HALF=R // 2, INTERLEAVED=interleaved, num_warps=4)
    return qo


@triton.jit
def _moe_combine_kernel(y_ptr, w_ptr, a_ptr, o_ptr, H, K: tl.constexpr, HAS_ADD: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)  # one token: its K choices' outputs, weighted and summed
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in range(K):
        w = tl.load(w_ptr + t * K + j).to(tl.float32)
        acc += tl.load(y_ptr + (t * K + j) * H + cols, mask=m, other=0.0).to(tl.float32) * w
    out = acc.to(o_ptr.dtype.element_ty)
    if HAS_ADD:  # the shared experts' output, added in the output's dtype as torch's add rounds it
        out = (out.to(tl.float32) + tl.load(a_ptr + t * H + cols, mask=m, other=0.0).to(tl.float32)
               ).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + t * H + cols, out, mask=m)


def moe_combine(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype,
                add: torch.Tensor | None = None) -> torch.Tensor | None:
    """A MoE layer's routed output per token as one launch: y (T * k, H) the (token, choice)
    pairs' outputs, weights (T, k) -> sum_j weights[t, j] y[t k + j] in float32, cast to `dtype`,
    plus `add` (T, H) of `dtype` when given (the shared experts). None when the layouts do not
    fit (the caller then runs torch)."""
    T, k = weights.shape
    H = y.shape[-1]
    if (y.shape != (T * k, H) or not y.is_contiguous() or not weights.is_contiguous() or T == 0
            or (add is not None and (add.shape != (T, H) or add.dtype != dtype or not add.is_contiguous()))):
        return None
    o = torch.empty(T, H, dtype=dtype, device=y.device)
    BLOCK = min(1024, triton.next_power_of_2(H))
    _moe_combine_kernel[(T, triton.cdiv(H, BLOCK))](y, weights, add if add is not None else o, o, H, K=k,
                                                   HAS_ADD=add is not None, BLOCK=BLOCK, num_warps=4)
    return o


@triton.jit
def _moe_route_kernel(l_ptr, b_ptr, w_ptr, id_ptr, E, s_l, scaling, eps,
                      SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_MODE: tl.constexpr, G: tl.constexpr,
                      GP: tl.constexpr, TOPK_GROUP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                      NORM: tl.constexpr, BLOCK: tl.constexpr):
    """One token's routing from its router logits (see moe_route); GROUP_MODE 0: every group stays,
    1: V2's group_limited_greedy (a group's best score ranks it, the rest drop to 0), 2: V3 (its two
    best, the rest drop to -inf)."""
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK)
    m = e < E
    neg = float("-inf")
    lg = tl.load(l_ptr + t * s_l + e, mask=m, other=neg).to(tl.float32)
    if SIGMOID:
        scores = tl.where(m, 1.0 / (1.0 + tl.exp(-lg)), 0.0)
        choice = scores
        if HAS_BIAS:
            choice = scores + tl.load(b_ptr + e, mask=m, other=0.0).to(tl.float32)
    else:
        p = tl.where(m, tl.exp(lg - tl.max(lg, axis=0)), 0.0)
        scores = p / tl.sum(p, axis=0)
        choice = scores
    choice = tl.where(m, choice, neg)
    if GROUP_MODE != 0:
        gid = e // (E // G)
        g = tl.arange(0, GP)
        gscore = tl.full((GP,), neg, tl.float32)
        for j in tl.static_range(G):
            c = tl.where(gid == j, choice, neg)
            best = tl.max(c, axis=0)
            if GROUP_MODE == 2:  # the two best of the group: drop the first best's place, take the best left
                c = tl.where(e == tl.argmax(c, axis=0), neg, c)
                best = best + tl.max(c, axis=0)
            gscore = tl.where(g == j, best, gscore)
        keep = tl.zeros((BLOCK,), tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            j = tl.argmax(gscore, axis=0)
            keep = keep | (gid == j)
            gscore = tl.where(g == j, neg, gscore)
        choice = tl.where(keep | ~m, choice, 0.0 if GROUP_MODE == 1 else neg)
    kk = tl.arange(0, KP)  # K choices, padded to a power of two
    ids = tl.zeros((KP,), tl.int64)
    ws = tl.zeros((KP,), tl.float32)
    for j in tl.static_range(K):
        i = tl.argmax(choice, axis=0)
        ids = tl.where(kk == j, i.to(tl.int64), ids)
        ws = tl.where(kk == j, tl.sum(tl.where(e == i, scores, 0.0), axis=0), ws)
        choice = tl.where(e == i, neg, choice)
    if NORM:
        ws = ws / (tl.sum(ws, axis=0) + eps)
    tl.store(w_ptr + t * K + kk, ws * scaling, mask=kk < K)
    tl.store(id_ptr + t * K + kk, ids, mask=kk < K)


def moe_route(logits: torch.Tensor, top_k: int, sigmoid: bool, bias: torch.Tensor | None, group_mode: int,
              n_group: int, topk_group: int, norm: bool, scaling: float, eps: float) -> tuple | None:
    """A MoE router's work after its GEMV as one launch, one program a token: scores (softmax, or
    sigmoid plus the correction bias for the choice), the groups kept (group_mode 1 or 2), the top_k
    experts, their scores normalized (norm) and scaled. logits (T, E) float32 -> (weights (T, k)
    float32, ids (T, k) int64), the experts of a token in descending order of choice. None when
    the shapes do not fit (the caller then runs torch)."""
    T, E = logits.shape
    if (logits.dtype != torch.float32 or logits.stride(1) != 1 or T == 0 or E > 1024 or top_k > E
            or (group_mode and (E % n_group or n_group > 64 or topk_group > n_group))):
        return None
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    _moe_route_kernel[(T,)](logits, bias if bias is not None else logits, w, ids, E, logits.stride(0), float(scaling),
                            float(eps), SIGMOID=sigmoid, HAS_BIAS=bias is not None, GROUP_MODE=group_mode,
                            G=max(n_group, 1), GP=triton.next_power_of_2(max(n_group, 1)), TOPK_GROUP=topk_group,
                            K=top_k, KP=triton.next_power_of_2(top_k), NORM=norm, BLOCK=triton.next_power_of_2(E),
                            num_warps=4)
    return w, ids
