"""One row of float x (M = 1) against a packed weight (kernels/packed.py): `gemv_linear`.

- `_gemv_rows` holds BN rows as a tensor dimension, so each x element is loaded once for all of
  them, with the K loop software-pipelined (tl.range, cp.async); FP8 codes convert in hardware
  on sm_89 and later (`_fp8x4`).
- `_gemv4` (four row tensors, not pipelined) is the faster one for GGUF formats with high-bit
  planes; `_gemv` picks between them by BN, so one autotuner holds both.
- Codes become floats by writing them into a float's mantissa (no conversion instruction).
- `gemv_experts`: the same GEMV over (token, expert) pairs of a MoE layer, each pair's expert id
  read on the device from stacked per-expert planes (no host sync: a CUDA graph can hold it).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from dsq.kernels.packed import FP8, Packed
from dsq.kernels.triton_common import (FMT_KEYS, INTERPRET, autotune, even_k, float_args, fmt_flags, group_params,
                                       plane_args)


@triton.jit
def _row_load(lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, row, w, e, wm, gm,
              s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin, CODES: tl.constexpr,
              HI_BITS: tl.constexpr, SUB: tl.constexpr, SC_ROWS: tl.constexpr, TWO_LEVEL: tl.constexpr,
              ZERO: tl.constexpr, OFFSET: tl.constexpr, MINS: tl.constexpr):
    """One row's code words (GT, GW) and, per word, its group's scale s, zero point z, high-bit
    word (already shifted to this word's bits) and min m."""
    word = tl.load(lo_ptr + row * s_lo + w, mask=wm, other=0)
    s, z, m = group_params(sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, row, e, gm, s_sc, s_d, s_zp, s_mn, s_dmin,
                           SUB, SC_ROWS, TWO_LEVEL, ZERO, OFFSET, MINS)
    if CODES == 2:  # int8 -> unsigned (c + 128) by flipping each byte's sign bit
        word = word ^ -2139062144  # 0x80808080 as an int32
        z += 128.0
    h = word
    if HI_BITS == 1:
        h = tl.load(hi_ptr + row * s_hi + w // 4, mask=wm, other=0) >> (8 * (w % 4))
    if HI_BITS == 2:
        h = tl.load(hi_ptr + row * s_hi + w // 2, mask=wm, other=0) >> (16 * (w % 2))
    return word, s, z, h, m


@triton.jit
def _place(v, SRC: tl.constexpr, DST: tl.constexpr, NBITS: tl.constexpr):
    """Bits SRC..SRC+NBITS-1 of v moved to DST.., everything else cleared (one shift, one and)."""
    if DST >= SRC:
        r = v << (DST - SRC)
    else:
        r = v >> (SRC - DST)
    return r & (((1 << NBITS) - 1) << DST)


@triton.jit
def _element(word, h, i: tl.constexpr, CODES: tl.constexpr, HI_BITS: tl.constexpr):
    """Element i of each word as f = 1 + c / 2^CB (CB code bits), built by writing the code into
    the top of a float's mantissa: no int->float conversion. FP8: the value itself."""
    if CODES == 3:  # e4m3 -> fp16 bits: value / 256 (the caller multiplies by 256 once per word)
        hb = _place(word, 8 * i + 7, 15, 1) | _place(word, 8 * i, 7, 7)
        return hb.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    if CODES == 0:
        if HI_BITS == 0:
            bits = _place(word, 4 * i, 19, 4)
        elif HI_BITS == 1:
            bits = _place(word, 4 * i, 18, 4) | _place(h, i, 22, 1)
        else:
            bits = _place(word, 4 * i, 17, 4) | _place(h, 2 * i, 21, 2)
    else:
        bits = _place(word, 8 * i, 15, 8)
    return (bits | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _lanes4(xt, GT: tl.constexpr, GW: tl.constexpr):
    """x tile (1, GT, GW, 4), a word's four elements held by one thread (one wide load), as four
    tensors (1, GT, GW): element i of every word."""
    e, o = tl.split(tl.reshape(xt, (1, GT, GW, 2, 2)))  # (0, 2), (1, 3)
    x0, x2 = tl.split(e)
    x1, x3 = tl.split(o)
    return x0, x1, x2, x3


@triton.jit
def _fp8x4(word):
    """The four e4m3 bytes of each word (element i at bits 8i) as four float32 tensors: two
    cvt.rn.f16x2.e4m3x2 (sm_89+) and four f16 -> f32 conversions, about 1.5 instructions per element."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b16 lo, hi, h0, h1, h2, h3;
        .reg .b32 a, b;
        mov.b32 {lo, hi}, $4;
        cvt.rn.f16x2.e4m3x2 a, lo;
        cvt.rn.f16x2.e4m3x2 b, hi;
        mov.b32 {h0, h1}, a;
        mov.b32 {h2, h3}, b;
        cvt.f32.f16 $0, h0;
        cvt.f32.f16 $1, h1;
        cvt.f32.f16 $2, h2;
        cvt.f32.f16 $3, h3;
        }""", "=f,=f,=f,=f,r", [word], dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _gemv4(x_ptr, y_ptr, bias_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, N, K, row0,
           s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin,
           CODES: tl.constexpr, HI_BITS: tl.constexpr, SUB: tl.constexpr, SC_ROWS: tl.constexpr,
           TWO_LEVEL: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr, MINS: tl.constexpr,
           HAS_BIAS: tl.constexpr, BK: tl.constexpr):
    """M = 1, four rows per program as four separate tensors. All tensors share the layout of one
    row's code words (GT, GW): each x element is loaded and converted once and used by the four rows, the
    elements of a word are taken one at a time (unrolled), and threads combine their sums once,
    after the loop. Per element: a shift, an and/or and one FMA (see _element); per word:
    sum c x = 2^CB (sum f x - sum x), then W x = s (sum c x - z sum x) - m sum x. The weight's
    rows start at row `row0` of the planes (an expert's in stacked planes: _gemv_experts)."""
    EPW: tl.constexpr = 8 if CODES == 0 else 4  # elements per 32-bit word
    CB: tl.constexpr = 4 + HI_BITS if CODES == 0 else 8  # code bits
    SC: tl.constexpr = 1 << CB
    GS: tl.constexpr = SUB if SUB < BK else BK  # elements per scale group inside a tile
    GT: tl.constexpr = BK // GS
    GW: tl.constexpr = GS // EPW
    r0 = tl.program_id(0) * 4
    wt = (tl.arange(0, GT) * GW)[:, None] + tl.arange(0, GW)[None, :]  # word index in the tile
    et = (tl.arange(0, GT) * GS)[:, None]  # first element of each group (GT, 1): loaded once, broadcast
    KW = K // EPW
    a0 = tl.zeros((GT, GW), dtype=tl.float32)
    a1 = tl.zeros((GT, GW), dtype=tl.float32)
    a2 = tl.zeros((GT, GW), dtype=tl.float32)
    a3 = tl.zeros((GT, GW), dtype=tl.float32)
    for k0 in range(0, K, BK):
        w = k0 // EPW + wt
        e = k0 + et
        km = w < KW
        rw = wt * 0 + r0  # the row index as tensors (masks of tensor & tensor), per word and per group
        rv = et * 0 + r0
        em = e < K
        q0, s0, z0, h0, m0 = _row_load(lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, row0 + r0, w, e,
                                       km & (rw < N), em & (rv < N), s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin,
                                       CODES, HI_BITS, SUB, SC_ROWS, TWO_LEVEL, ZERO, OFFSET, MINS)
        q1, s1, z1, h1, m1 = _row_load(lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, row0 + r0 + 1, w, e,
                                       km & (rw + 1 < N), em & (rv + 1 < N), s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin,
                                       CODES, HI_BITS, SUB, SC_ROWS, TWO_LEVEL, ZERO, OFFSET, MINS)
        q2, s2, z2, h2, m2 = _row_load(lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, row0 + r0 + 2, w, e,
                                       km & (rw + 2 < N), em & (rv + 2 < N), s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin,
                                       CODES, HI_BITS, SUB, SC_ROWS, TWO_LEVEL, ZERO, OFFSET, MINS)
        q3, s3, z3, h3, m3 = _row_load(lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, row0 + r0 + 3, w, e,
                                       km & (rw + 3 < N), em & (rv + 3 < N), s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin,
                                       CODES, HI_BITS, SUB, SC_ROWS, TWO_LEVEL, ZERO, OFFSET, MINS)
        t0 = tl.zeros((GT, GW), dtype=tl.float32)
        t1 = tl.zeros((GT, GW), dtype=tl.float32)
        t2 = tl.zeros((GT, GW), dtype=tl.float32)
        t3 = tl.zeros((GT, GW), dtype=tl.float32)
        xs = tl.zeros((GT, GW), dtype=tl.float32)
        for i in tl.static_range(EPW):
            xv = tl.load(x_ptr + w * EPW + i, mask=km, other=0).to(tl.float32)
            t0 += _element(q0, h0, i, CODES, HI_BITS) * xv
            t1 += _element(q1, h1, i, CODES, HI_BITS) * xv
            t2 += _element(q2, h2, i, CODES, HI_BITS) * xv
            t3 += _element(q3, h3, i, CODES, HI_BITS) * xv
            xs += xv
        if CODES == 3:
            a0 += (256.0 * s0) * t0
            a1 += (256.0 * s1) * t1
            a2 += (256.0 * s2) * t2
            a3 += (256.0 * s3) * t3
        else:
            a0 += s0 * (SC * t0 - (SC + z0) * xs) - m0 * xs
            a1 += s1 * (SC * t1 - (SC + z1) * xs) - m1 * xs
            a2 += s2 * (SC * t2 - (SC + z2) * xs) - m2 * xs
            a3 += s3 * (SC * t3 - (SC + z3) * xs) - m3 * xs
    for r in tl.static_range(4):
        acc = a0 if r == 0 else (a1 if r == 1 else (a2 if r == 2 else a3))
        out = tl.sum(tl.sum(acc, axis=1), axis=0)
        if HAS_BIAS:
            out += tl.load(bias_ptr + r0 + r, mask=r0 + r < N, other=0).to(tl.float32)
        tl.store(y_ptr + r0 + r, out.to(y_ptr.dtype.element_ty), mask=r0 + r < N)


@triton.jit
def _gemv_rows(x_ptr, y_ptr, bias_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, N, K, row0,
               s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin,
               CODES: tl.constexpr, HI_BITS: tl.constexpr, SUB: tl.constexpr, SC_ROWS: tl.constexpr,
               TWO_LEVEL: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr, MINS: tl.constexpr,
               HAS_BIAS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
               EVEN_K: tl.constexpr = False, FP8_HW: tl.constexpr = False):
    """M = 1, BN rows as a tensor dimension: words (BN, GT, GW), group parameters (BN, GT, 1), and
    x's elements (1, GT, GW, EPW) loaded 16 bytes at a time, once for all BN rows, then split per
    element of a word (_lanes4, FP8). The K loop is software-pipelined (tl.range: the next tiles' words
    are copied asynchronously while this one is computed). EVEN_K (K % BK == 0): no K mask, so the
    copies are full width. FP8_HW (sm_89 and later): FP8 codes convert in hardware (_fp8x4). The
    weight's rows start at row `row0` of the planes (as _gemv4)."""
    EPW: tl.constexpr = 8 if CODES == 0 else 4
    CB: tl.constexpr = 4 + HI_BITS if CODES == 0 else 8
    SC: tl.constexpr = 1 << CB
    GS: tl.constexpr = SUB if SUB < BK else BK
    GT: tl.constexpr = BK // GS
    GW: tl.constexpr = GS // EPW
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    r3 = rn[:, None, None]
    wt = (tl.arange(0, GT) * GW)[None, :, None] + tl.arange(0, GW)[None, None, :]  # (1, GT, GW)
    et = (tl.arange(0, GT) * GS)[None, :, None]  # (1, GT, 1)
    KW = K // EPW
    acc = tl.zeros((BN, GT, GW), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        w = k0 // EPW + wt
        e = k0 + et
        if EVEN_K:
            km = w >= 0
            em = e >= 0
        else:
            km = w < KW
            em = e < K
        q, s, z, h, m = _row_load(lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, row0 + r3, w, e,
                                  km & (r3 < N), em & (r3 < N), s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin,
                                  CODES, HI_BITS, SUB, SC_ROWS, TWO_LEVEL, ZERO, OFFSET, MINS)
        t = tl.zeros((BN, GT, GW), dtype=tl.float32)
        xs = tl.zeros((1, GT, GW), dtype=tl.float32)
        if CODES == 3:  # FP8: x 16 bytes at a time, split per element (fewer, wider loads: 2x fewer instructions)
            xt = tl.load(x_ptr + (w * EPW)[:, :, :, None] + tl.arange(0, EPW)[None, None, None, :],
                         mask=km[:, :, :, None], other=0).to(tl.float32)
            xl = _lanes4(xt, GT, GW)
            if FP8_HW:
                fl = _fp8x4(q)
            for i in tl.static_range(EPW):
                if FP8_HW:
                    t += fl[i] * xl[i]
                else:
                    t += _element(q, h, i, CODES, HI_BITS) * xl[i]
            acc += ((1.0 if FP8_HW else 256.0) * s) * t
        else:  # one x element per word at a time (for 8 elements a word the split costs more than it saves)
            for i in tl.static_range(EPW):
                xv = tl.load(x_ptr + w * EPW + i, mask=km, other=0).to(tl.float32)
                t += _element(q, h, i, CODES, HI_BITS) * xv
                xs += xv
            acc += s * (SC * t - (SC + z) * xs) - m * xs
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + rn, mask=rn < N, other=0).to(tl.float32)
    tl.store(y_ptr + rn, out.to(y_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _gemv_at(x_ptr, y_ptr, bias_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, N, K, row0,
             s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin,
             CODES: tl.constexpr, HI_BITS: tl.constexpr, SUB: tl.constexpr, SC_ROWS: tl.constexpr,
             TWO_LEVEL: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr, MINS: tl.constexpr,
             HAS_BIAS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
             EVEN_K: tl.constexpr, FP8_HW: tl.constexpr):
    """M = 1 over the weight at rows row0.. of the planes: BN == 4 takes _gemv4 (four row tensors,
    no pipelining: the faster one for K-quants and Q6_K on an H200), any other BN, and FP8,
    _gemv_rows (int4, FP8: 1.2-1.5x faster there)."""
    if BN == 4 and CODES != 3:
        _gemv4(x_ptr, y_ptr, bias_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, N, K, row0,
               s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin, CODES, HI_BITS, SUB, SC_ROWS, TWO_LEVEL, ZERO, OFFSET,
               MINS, HAS_BIAS, BK)
    else:
        _gemv_rows(x_ptr, y_ptr, bias_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, N, K, row0,
                   s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin, CODES, HI_BITS, SUB, SC_ROWS, TWO_LEVEL, ZERO, OFFSET,
                   MINS, HAS_BIAS, BN, BK, STAGES, EVEN_K, FP8_HW)


@triton.jit
def _gemv(x_ptr, y_ptr, bias_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, N, K,
          s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin,
          CODES: tl.constexpr, HI_BITS: tl.constexpr, SUB: tl.constexpr, SC_ROWS: tl.constexpr,
          TWO_LEVEL: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr, MINS: tl.constexpr,
          HAS_BIAS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
          EVEN_K: tl.constexpr = False, FP8_HW: tl.constexpr = False):
    """M = 1: y = x W^T (+ bias), a program per BN rows (_gemv_at)."""
    _gemv_at(x_ptr, y_ptr, bias_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, N, K, 0,
             s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin, CODES, HI_BITS, SUB, SC_ROWS, TWO_LEVEL, ZERO, OFFSET,
             MINS, HAS_BIAS, BN, BK, STAGES, EVEN_K, FP8_HW)


@triton.jit
def _gemv_experts(x_ptr, y_ptr, ids_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, N, K, XDIV,
                  s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin,
                  CODES: tl.constexpr, HI_BITS: tl.constexpr, SUB: tl.constexpr, SC_ROWS: tl.constexpr,
                  TWO_LEVEL: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr, MINS: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                  EVEN_K: tl.constexpr = False, FP8_HW: tl.constexpr = False):
    """Grouped GEMV with expert indirection: program (n, p) computes BN outputs of pair p,
    y[p] = x[p // XDIV] W_ids[p]^T, where the planes stack E weights of N rows each (expert e's
    rows are e*N..e*N+N-1) and the expert id is read here, on the device (no host round trip)."""
    p = tl.program_id(1)
    e = tl.load(ids_ptr + p).to(tl.int64)  # int64: E * N rows times a row stride may pass 2^31
    _gemv_at(x_ptr + (p // XDIV).to(tl.int64) * K, y_ptr + p.to(tl.int64) * N, y_ptr, lo_ptr, hi_ptr, sc_ptr,
             d_ptr, zp_ptr, mn_ptr, dmin_ptr, N, K, e * N, s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin, CODES, HI_BITS,
             SUB, SC_ROWS, TWO_LEVEL, ZERO, OFFSET, MINS, False, BN, BK, STAGES, EVEN_K, FP8_HW)


# the winners of an H200 sweep of fixed configs, BN 4 = _gemv4 (docs/benchmarks.md#gpu-kernels-by-rows-of-x)
_GEMV_CONFIGS = [triton.Config({"BN": bn, "BK": bk, "STAGES": st}, num_warps=w)
                 for bn, bk, w, st in [(8, 1024, 2, 3), (16, 1024, 4, 3), (8, 1024, 4, 1), (8, 1024, 4, 3),
                                       (4, 2048, 2, 1), (4, 1024, 2, 1), (4, 2048, 4, 1), (4, 4096, 4, 1)]]
_gemv_tuned = autotune(_GEMV_CONFIGS, ["N", "K", *FMT_KEYS])(even_k(_gemv))
_gemv_experts_tuned = autotune(_GEMV_CONFIGS, ["N", "K", *FMT_KEYS])(even_k(_gemv_experts))


@functools.lru_cache(maxsize=None)
def _fp8_hw(device: torch.device) -> bool:
    """Whether the GPU converts e4m3 in hardware (cvt.rn.f16x2.e4m3x2: sm_89 and later); never
    under the interpreter."""
    return not INTERPRET and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def gemv_linear(x: torch.Tensor, p: Packed, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                config: dict | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for one row of float x, y in x's dtype. `out` (1, N) may be given (the
    tests poison it); `config` fixes the tile sizes (no autotuning)."""
    x2, y, planes, strides, flags, b = float_args(x, p, bias, out)
    flags["FP8_HW"] = p.fmt.codes == FP8 and _fp8_hw(x.device)
    if config is None and not INTERPRET:
        grid = lambda meta: (triton.cdiv(p.N, meta["BN"]),)  # noqa: E731
        _gemv_tuned[grid](x2, y, b, *planes, p.N, p.K, *strides, **flags)
    else:
        cfg = {"BN": 8, "BK": 64, "STAGES": 1, **(config or {})}
        cfg.setdefault("EVEN_K", p.K % cfg["BK"] == 0)
        _gemv[(triton.cdiv(p.N, cfg["BN"]),)](x2, y, b, *planes, p.N, p.K, *strides, **flags, **cfg)
    return y.reshape(*x.shape[:-1], p.N)



def gemv_experts(x: torch.Tensor, p: Packed, ids: torch.Tensor, n_expert: int, out: torch.Tensor | None = None,
                 config: dict | None = None) -> torch.Tensor:
    """Pairs (token, expert) through their experts' weights, the ids read on the device: `p`
    stacks `n_expert` weights of N = p.N / n_expert rows each along N (expert e's rows e*N..);
    for P = ids.numel() pairs, y (P, N) with y[i] = x[i // (P / T)] W_ids[i]^T, x (T, K): one
    row per token against its k experts (ids (T, k): gate/up), or one per pair (T = P: down).
    y in x's dtype; `out` (P, N) may be given (the tests poison it); `config` fixes the tile
    sizes (no autotuning). Never syncs with the host (a CUDA graph can hold it)."""
    P = ids.numel()
    x2 = x.reshape(-1, p.K)
    if x2.stride(-1) != 1 or x2.stride(0) != p.K:
        x2 = x2.contiguous()
    T = x2.shape[0]
    if P % T or p.perm is not None or p.N % n_expert or (p.N // n_expert) % p.fmt.sc_rows:
        raise ValueError("gemv_experts takes one row of x per token or per pair, no act-order, and experts of "
                         "equal rows (whole scale blocks)")
    N = p.N // n_expert
    ids1 = ids.reshape(P)
    if ids1.stride(0) != 1:
        ids1 = ids1.contiguous()
    y = out if out is not None else torch.empty(P, N, dtype=x.dtype, device=x.device)
    planes, strides = plane_args(p)
    flags = {**fmt_flags(p), "FP8_HW": p.fmt.codes == FP8 and _fp8_hw(x.device)}
    if config is None and not INTERPRET:
        grid = lambda meta: (triton.cdiv(N, meta["BN"]), P)  # noqa: E731
        _gemv_experts_tuned[grid](x2, y, ids1, *planes, N, p.K, P // T, *strides, **flags)
    else:
        cfg = {"BN": 8, "BK": 64, "STAGES": 1, **(config or {})}
        cfg.setdefault("EVEN_K", p.K % cfg["BK"] == 0)
        _gemv_experts[(triton.cdiv(N, cfg["BN"]), P)](x2, y, ids1, *planes, N, p.K, P // T, *strides, **flags, **cfg)
    return y
