"""Triton kernels: fused dequantize + matmul over the packed layout (kernels/packed.py), for every
format dsq holds (int4/int8 from AWQ and GPTQ, FP8, GGUF Q4_0..Q6_K).

- `_gemv_q8` (1-4 rows of x, integer codes incl. Q6_K at one row, the default there): x rounded
  to int8 per 32 elements by `_quant_x` (llama.cpp's Q8_1 scheme), codes and x meet in dp4a
  (four products per instruction, exact int32 per 32-element block), then block and group scales
  in float. Computes exactly packed.linear_ref_q8. Small programs (1-4 weight rows, one warp)
  with the next tile's loads held in registers ran fastest on an H200. (3-16 rows of int4 AWQ/GPTQ
  run on tensor cores instead: triton_mma.py.)
- `_gemv` (M = 1, float x): `_gemv_rows` holds BN rows as a tensor dimension, so each x element is
  loaded once for all of them, with the K loop software-pipelined (tl.range, cp.async);
  `_gemv4` (four row tensors, not pipelined) stays for GGUF formats with high-bit planes. Codes
  become floats by writing them into a float's mantissa (no conversion instruction).
- `_gemm` (M > 1: batched decode and prefill): dequantized tiles fed to `tl.dot` (tensor cores),
  BM rows of x per program; M is the fastest grid axis so weight tiles are reused from L2.

Runs under TRITON_INTERPRET=1 on the CPU (the CI tests; inline PTX is replaced by the same
integer ops there); on a GPU the tile shapes are autotuned per (N, K, format) on first use.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from dsq.kernels.packed import FP8, NIB, Packed, q8_ok

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
INTERPRET_K = tl.constexpr(INTERPRET)


@triton.jit
def _to_float(c):
    """Small non-negative int32 (< 2^23) -> float32 without a conversion instruction: 2^23 + c has
    c in its mantissa bits."""
    return (c | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _codes(lo_ptr, hi_ptr, rn4, w, i4, mask, s_lo, s_hi, CODES: tl.constexpr, HI_BITS: tl.constexpr):
    """Codes of rows rn4 (BN,1,1,1) in 32-bit words w (1,GT,GW,1), element i4 (1,1,1,EPW) of each word,
    as float32 (BN, GT, GW, EPW). Words are read whole (wide loads), elements split in registers."""
    word = tl.load(lo_ptr + rn4 * s_lo + w, mask=mask, other=0)
    if CODES == 0:  # 8 nibbles per word, element 8w + i at bits 4i
        c = (word >> (4 * i4)) & 15
        if HI_BITS == 1:  # one bit per element: 32 per word of the plane
            h = tl.load(hi_ptr + rn4 * s_hi + w // 4, mask=mask, other=0)
            c = c | (((h >> (8 * (w % 4) + i4)) & 1) << 4)
        if HI_BITS == 2:  # two bits per element: 16 per word
            h = tl.load(hi_ptr + rn4 * s_hi + w // 2, mask=mask, other=0)
            c = c | (((h >> (16 * (w % 2) + 2 * i4)) & 3) << 4)
        v = _to_float(c)
    else:  # 4 bytes per word
        c = (word >> (8 * i4)) & 0xFF
        if CODES == 3:  # e4m3 -> fp16 bits (value / 256): sign to bit 15, exponent and mantissa shifted by 7
            hb = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
            v = hb.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        else:
            v = _to_float(c)
            if CODES == 2:  # int8: two's complement bytes
                v = tl.where(v > 127.0, v - 256.0, v)
    return v


@triton.jit
def _group_params(sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, rn2, e2, gmask, s_sc, s_d, s_zp, s_mn, s_dmin,
                  SUB: tl.constexpr, SC_ROWS: tl.constexpr, TWO_LEVEL: tl.constexpr, ZERO: tl.constexpr,
                  OFFSET: tl.constexpr, MINS: tl.constexpr, EVEN: tl.constexpr = False):
    """Per scale group (rows rn2 (BN,1), first elements e2 (1,GT)): scale s, zero z and min m with
    W = s * (c - z) - m. EVEN: gmask is all true, so the loads go unmasked (_ld)."""
    s = _ld(sc_ptr + (rn2 // SC_ROWS) * s_sc + e2 // SUB, gmask, EVEN).to(tl.float32)
    if TWO_LEVEL:
        s = s * _ld(d_ptr + rn2 * s_d + e2 // 256, gmask, EVEN).to(tl.float32)
    z = tl.zeros_like(s)
    if ZERO == 1:
        z += OFFSET
    if ZERO == 2:
        z = _ld(zp_ptr + rn2 * s_zp + e2 // SUB, gmask, EVEN).to(tl.float32)
    m = tl.zeros_like(s)
    if MINS:
        m = (_ld(dmin_ptr + rn2 * s_dmin + e2 // 256, gmask, EVEN).to(tl.float32)
             * _ld(mn_ptr + rn2 * s_mn + e2 // 32, gmask, EVEN).to(tl.float32))
    return s, z, m


@triton.jit
def _row_load(lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, row, w, e, wm, gm,
              s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin, CODES: tl.constexpr,
              HI_BITS: tl.constexpr, SUB: tl.constexpr, SC_ROWS: tl.constexpr, TWO_LEVEL: tl.constexpr,
              ZERO: tl.constexpr, OFFSET: tl.constexpr, MINS: tl.constexpr):
    """One row's code words (GT, GW) and, per word, its group's scale s, zero point z, high-bit
    word (already shifted to this word's bits) and min m."""
    word = tl.load(lo_ptr + row * s_lo + w, mask=wm, other=0)
    s, z, m = _group_params(sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, row, e, gm, s_sc, s_d, s_zp, s_mn, s_dmin,
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
def _gemv4(x_ptr, y_ptr, bias_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, N, K,
           s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin,
           CODES: tl.constexpr, HI_BITS: tl.constexpr, SUB: tl.constexpr, SC_ROWS: tl.constexpr,
           TWO_LEVEL: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr, MINS: tl.constexpr,
           HAS_BIAS: tl.constexpr, BK: tl.constexpr):
    """M = 1, four rows per program as four separate tensors. All tensors share the layout of one
    row's code words (GT, GW): each x element is loaded and converted once and used by the four rows, the
    elements of a word are taken one at a time (unrolled), and threads combine their sums once,
    after the loop. Per element: a shift, an and/or and one FMA (see _element); per word:
    sum c x = 2^CB (sum f x - sum x), then W x = s (sum c x - z sum x) - m sum x."""
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
        q0, s0, z0, h0, m0 = _row_load(lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, r0, w, e,
                                       km & (rw < N), em & (rv < N), s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin,
                                       CODES, HI_BITS, SUB, SC_ROWS, TWO_LEVEL, ZERO, OFFSET, MINS)
        q1, s1, z1, h1, m1 = _row_load(lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, r0 + 1, w, e,
                                       km & (rw + 1 < N), em & (rv + 1 < N), s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin,
                                       CODES, HI_BITS, SUB, SC_ROWS, TWO_LEVEL, ZERO, OFFSET, MINS)
        q2, s2, z2, h2, m2 = _row_load(lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, r0 + 2, w, e,
                                       km & (rw + 2 < N), em & (rv + 2 < N), s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin,
                                       CODES, HI_BITS, SUB, SC_ROWS, TWO_LEVEL, ZERO, OFFSET, MINS)
        q3, s3, z3, h3, m3 = _row_load(lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, r0 + 3, w, e,
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
def _gemv_rows(x_ptr, y_ptr, bias_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, N, K,
               s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin,
               CODES: tl.constexpr, HI_BITS: tl.constexpr, SUB: tl.constexpr, SC_ROWS: tl.constexpr,
               TWO_LEVEL: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr, MINS: tl.constexpr,
               HAS_BIAS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
               EVEN_K: tl.constexpr = False, FP8_HW: tl.constexpr = False):
    """M = 1, BN rows as a tensor dimension: words (BN, GT, GW), group parameters (BN, GT, 1), and
    x's elements (1, GT, GW, EPW) loaded 16 bytes at a time, once for all BN rows, then split per
    element of a word (_lanes4, FP8). The K loop is software-pipelined (tl.range: the next tiles' words
    are copied asynchronously while this one is computed). EVEN_K (K % BK == 0): no K mask, so the
    copies are full width. FP8_HW (sm_89 and later): FP8 codes convert in hardware (_fp8x4)."""
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
        q, s, z, h, m = _row_load(lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, r3, w, e,
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
def _gemv(x_ptr, y_ptr, bias_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, N, K,
          s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin,
          CODES: tl.constexpr, HI_BITS: tl.constexpr, SUB: tl.constexpr, SC_ROWS: tl.constexpr,
          TWO_LEVEL: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr, MINS: tl.constexpr,
          HAS_BIAS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
          EVEN_K: tl.constexpr = False, FP8_HW: tl.constexpr = False):
    """M = 1: BN == 4 takes _gemv4 (four row tensors, no pipelining: the faster one for K-quants
    and Q6_K on an H200), any other BN, and FP8, _gemv_rows (int4, FP8: 1.2-1.5x faster there)."""
    if BN == 4 and CODES != 3:
        _gemv4(x_ptr, y_ptr, bias_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, N, K,
               s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin, CODES, HI_BITS, SUB, SC_ROWS, TWO_LEVEL, ZERO, OFFSET,
               MINS, HAS_BIAS, BK)
    else:
        _gemv_rows(x_ptr, y_ptr, bias_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, N, K,
                   s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin, CODES, HI_BITS, SUB, SC_ROWS, TWO_LEVEL, ZERO, OFFSET,
                   MINS, HAS_BIAS, BN, BK, STAGES, EVEN_K, FP8_HW)


@triton.jit
def _dp4a(a, b, c, SIGNED_A: tl.constexpr, USE_ASM: tl.constexpr):
    """c + the dot product of the four bytes of a (unsigned, or signed) and of b (signed): one
    instruction (dp4a) on the GPU, the same sum in plain integer ops under the interpreter."""
    if USE_ASM:
        if SIGNED_A:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
    else:
        r = c
        for j in tl.static_range(4):
            ab = (a >> (8 * j)) & 0xFF
            if SIGNED_A:
                ab = (ab ^ 0x80) - 0x80
            bb = (b >> (8 * j)) & 0xFF
            r += ab * ((bb ^ 0x80) - 0x80)
        return r


@triton.jit
def _ld(ptr, mask, EVEN: tl.constexpr):
    """tl.load, without a mask (and the zeroing a masked load needs) when EVEN says none is needed."""
    if EVEN:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=mask, other=0)


@triton.jit
def _xld(ptr, kmask, rmask, EVEN_K: tl.constexpr, MR: tl.constexpr):
    """A load of x's words or block values: one row (MR 1) as _ld; MR rows with the row mask rmask
    (rows past M), and the K mask kmask unless EVEN_K."""
    if MR == 1:
        return _ld(ptr, kmask, EVEN_K)
    elif EVEN_K:
        return tl.load(ptr, mask=rmask, other=0)
    else:
        return tl.load(ptr, mask=rmask & kmask, other=0)


@triton.jit
def _q8_tile(xw_ptr, sx_ptr, xsum_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, k0, M, N, K, r3, r2, bt,
             wt, s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin,
             CODES: tl.constexpr, HI_BITS: tl.constexpr, SUB: tl.constexpr, TWO_LEVEL: tl.constexpr,
             ZERO: tl.constexpr, OFFSET: tl.constexpr, MINS: tl.constexpr, WB: tl.constexpr, NB: tl.constexpr,
             EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, MR: tl.constexpr):
    """_gemv_q8's loads for the K tile at k0: code words q (BN, NB, WB), x words xe (and xo: the
    odd elements, 4-bit codes), the high-bit words h (Q6_K), x's block scales sx and sums xs, and
    per row and block the group's s, z, m (Q6_K: s per half block (BN, NB, 2), z = the super-block
    scale d). x's tensors are (1, NB, WB) and (1, NB) for one row of x, (MR, 1, NB, WB) and
    (MR, 1, NB) for MR rows (of which M are real). Formats without a part return a stand-in that
    is never used."""
    w = k0 // (32 // WB) + wt
    b = k0 // 32 + bt[None, :]  # (1, NB) x block
    EV: tl.constexpr = EVEN_K and EVEN_N
    if EVEN_K:  # only the row mask: a K mask would split the 16-byte copies
        wm = r3 < N
        bm = b >= 0
    else:
        wm = (w < K // (32 // WB)) & (r3 < N)
        bm = b < K // 32
    q = _ld(lo_ptr + r3 * s_lo + w, wm, EV)
    h = q
    m4 = 0  # x's row offsets: none for one row, else a leading dimension (rows past M masked)
    m3 = 0
    if MR > 1:
        m4 = tl.arange(0, MR)[:, None, None, None]
        m3 = tl.arange(0, MR)[:, None, None]
    if CODES == 0:
        xi = k0 // 4 + (bt * 8)[None, :, None] + tl.arange(0, WB)[None, None, :]  # block's even words
        xe = _xld(xw_ptr + m4 * (K // 4) + xi, xi < K // 4, m4 < M, EVEN_K, MR)
        xo = _xld(xw_ptr + m4 * (K // 4) + xi + 4, xi < K // 4, m4 < M, EVEN_K, MR)
        if HI_BITS > 0:  # the word's high bits: 8 (Q5) or 16 (Q6_K) of a plane word
            h = _ld(hi_ptr + r3 * s_hi + w // (4 // HI_BITS), wm, EV)
    else:
        xe = _xld(xw_ptr + m4 * (K // 4) + w, w < K // 4, m4 < M, EVEN_K, MR)
        xo = xe
    sx = _xld(sx_ptr + m3 * (K // 32) + b, bm, m3 < M, EVEN_K, MR)
    if HI_BITS == 2:  # two 16-element scale groups a block
        eh = (b * 32)[:, :, None] + (tl.arange(0, 2) * 16)[None, None, :]
        s = _ld(sc_ptr + r3 * s_sc + eh // 16, (bm & (r2 < N))[:, :, None], EV).to(tl.float32)
        z = _ld(d_ptr + r2 * s_d + (b * 32) // 256, bm & (r2 < N), EV).to(tl.float32)
        xs = sx
        m = z
    else:
        xs = _xld(xsum_ptr + m3 * (K // 32) + b, bm, m3 < M, EVEN_K, MR)
        s, z, m = _group_params(sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, r2, b * 32, bm & (r2 < N), s_sc, s_d, s_zp,
                                s_mn, s_dmin, SUB, 1, TWO_LEVEL, ZERO, OFFSET, MINS, EV)
    return q, xe, xo, h, sx, xs, s, z, m


@triton.jit
def _q8_dot(q, xe, xo, h, sx, xs, s, z, m, w, CODES: tl.constexpr, HI_BITS: tl.constexpr, USE_ASM: tl.constexpr,
            BN: tl.constexpr, NB: tl.constexpr):
    """One K tile of _gemv_q8 from _q8_tile's loads: per row and block (BN, NB; (MR, BN, NB) for
    MR rows of x), dp = sum c xq (exact int32, dp4a), then s (sx dp - z xsum) - m xsum (Q6_K, one
    row only: d sx sum_half s dp_half). Q5_0 / Q5_K: each byte gets its fifth bit from the plane
    (codes 0..31, unsigned)."""
    if CODES == 0:
        ce = q & 0x0F0F0F0F  # byte j: element 2j of the word
        co = (q >> 4) & 0x0F0F0F0F  # element 2j + 1
        if HI_BITS == 1:  # Q5_0 / Q5_K: the word's 8 high bits, a pair to each byte, then bit 4 of each code
            hh = (h >> ((w % 4) * 8)) & 0xFF
            hh = ((hh & 0xF0) << 12) | (hh & 0x0F)
            hh = ((hh & 0x000C000C) << 6) | (hh & 0x00030003)
            ce = ce | ((hh & 0x01010101) << 4)
            co = co | ((hh & 0x02020202) << 3)
        if HI_BITS == 2:  # the word's 16 high bits: nibble j -> byte j, then 2 bits to each element
            hh = (h >> ((w % 2) * 16)) & 0xFFFF
            hh = ((hh & 0xFF00) << 8) | (hh & 0xFF)
            hh = ((hh & 0x00F000F0) << 4) | (hh & 0x000F000F)
            ce = (ce | ((hh & 0x03030303) << 4)) ^ 0x20202020  # c - 32 in 6-bit two's complement
            co = (co | ((hh & 0x0C0C0C0C) << 2)) ^ 0x20202020
            ce = ce | ((ce & 0x20202020) * 6)  # sign bit 5 copied to bits 6, 7
            co = co | ((co & 0x20202020) * 6)
        dp = _dp4a(ce, xe, tl.zeros_like(q), HI_BITS == 2, USE_ASM)
        dp = _dp4a(co, xo, dp, HI_BITS == 2, USE_ASM)
    else:
        dp = _dp4a(q, xe, tl.zeros_like(q), CODES == 2, USE_ASM)
    if HI_BITS == 2:
        dph = tl.sum(tl.reshape(dp, (BN, NB, 2, 2)), axis=3).to(tl.float32)
        r = (z * sx) * tl.sum(s * dph, axis=2)
    else:
        dps = tl.sum(dp, axis=len(dp.shape) - 1).to(tl.float32)  # (BN, NB) or (MR, BN, NB)
        r = s * (sx * dps - z * xs) - m * xs
    return r


@triton.jit
def _gemv_q8(xw_ptr, sx_ptr, xsum_ptr, y_ptr, bias_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr,
             M, N, K, s_ym, s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin,
             CODES: tl.constexpr, HI_BITS: tl.constexpr, SUB: tl.constexpr, TWO_LEVEL: tl.constexpr, ZERO: tl.constexpr,
             OFFSET: tl.constexpr, MINS: tl.constexpr, HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, EVEN_K: tl.constexpr = False,
             EVEN_N: tl.constexpr = False, PREFETCH: tl.constexpr = False, PERSIST: tl.constexpr = 0,
             PDL: tl.constexpr = False, MR: tl.constexpr = 1):
    """M rows of x (MR, a power of two >= M; MR = 1: the GEMV) as int8 per 32-element block
    (quantize_x_q8, llama.cpp's Q8_1 scheme): integer codes meet x in dp4a, four products per
    instruction; each code word is loaded and split once for all rows of x. Tiles (BN rows, NB
    blocks, WB words of a block); per row and block: dp = sum c xq (exact int32), then y += s (sx dp - z xsum) - m xsum
    with xsum = sx sum xq: exactly W (xq sx), packed.linear_ref_q8. EVEN_K (K % BK == 0) and
    EVEN_N (N % BN == 0): no masks, so code and x words are copied 16 bytes at a time (a K mask
    has the constancy of K's divisibility, which halved the copies' width) and no load zeroes its
    registers first. Loads are kept in flight either by Triton's pipeliner (STAGES > 1: cp.async
    through shared memory) or, with PREFETCH, in registers: each iteration issues the next tile's
    loads before it computes the current one (no shared memory, no barrier, about 40% fewer
    instructions a loop on sm_90). Q6_K (HI_BITS 2, 16-element scale groups, codes offset by 32):
    each byte gets its two high bits from the plane, c - 32 becomes a signed byte (bit 5 is the
    6-bit sign: flip it, extend it), dp4a runs signed and the two halves of a block take their
    own scales; no zero-point term is left. PERSIST (with PREFETCH; the grid is PERSIST programs
    per SM, fewer than the row tiles): each program walks row tiles pid, pid + P, ... and the
    prefetch runs on across them, so a program's next row is in flight while its current one
    ends (no load-latency bubble per row tile, which short rows, K = 4096, pay most). PDL (launched
    as a programmatic dependent of _quant_x, which lets it start at once): the first tile's code
    words are prefetched into L2 before the kernel waits for x, so the weight stream starts while
    x is still being rounded."""
    WB: tl.constexpr = 4 if CODES == 0 else 8  # code words per 32-element block
    NB: tl.constexpr = BK // 32
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    r3 = rn[:, None, None]
    r2 = rn[:, None]
    bt = tl.arange(0, NB)
    wt = (bt * WB)[None, :, None] + tl.arange(0, WB)[None, None, :]  # (1, NB, WB) word in the tile
    if MR == 1:
        acc = tl.zeros((BN, NB), dtype=tl.float32)
    else:
        acc = tl.zeros((MR, BN, NB), dtype=tl.float32)
    if PDL:
        _prefetch_l2(lo_ptr + r3 * s_lo + (bt * WB)[None, :, None])  # a 16-byte block's first word: its line
        tl.extra.cuda.gdc_wait()  # x (the previous kernel's output) is read only after this
    if PERSIST:
        P = tl.num_programs(0)
        RT = tl.cdiv(N, BN)  # row tiles; the grid is at most RT
        rt = tl.program_id(0)
        k0 = rt * 0
        q, xe, xo, h, sx, xs, s, z, m = _q8_tile(
            xw_ptr, sx_ptr, xsum_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, 0, M, N, K, r3, r2, bt, wt,
            s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin, CODES, HI_BITS, SUB, TWO_LEVEL, ZERO, OFFSET, MINS, WB, NB,
            EVEN_K, EVEN_N, MR)
        for _ in range(0, tl.cdiv(RT - rt, P) * tl.cdiv(K, BK)):
            last = k0 + BK >= K  # this tile ends its row
            kn = tl.multiple_of(tl.where(last, 0, k0 + BK), BK)
            rtn = tl.minimum(tl.where(last, rt + P, rt), RT - 1)  # past the end: reload a real tile, unused
            rnn = rtn * BN + tl.arange(0, BN)
            q1, xe1, xo1, h1, sx1, xs1, s1, z1, m1 = _q8_tile(
                xw_ptr, sx_ptr, xsum_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, kn, M, N, K,
                rnn[:, None, None], rnn[:, None], bt, wt, s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin, CODES, HI_BITS,
                SUB, TWO_LEVEL, ZERO, OFFSET, MINS, WB, NB, EVEN_K, EVEN_N, MR)
            acc += _q8_dot(q, xe, xo, h, sx, xs, s, z, m, k0 // (32 // WB) + wt, CODES, HI_BITS, USE_ASM, BN, NB)
            if last:
                _q8_store(y_ptr, bias_ptr, rt * BN + tl.arange(0, BN), acc, M, N, s_ym, HAS_BIAS, EVEN_N, MR)
                acc = tl.zeros_like(acc)
            q, xe, xo, h, sx, xs, s, z, m = q1, xe1, xo1, h1, sx1, xs1, s1, z1, m1
            rt = tl.where(last, rt + P, rt)
            k0 = kn
    elif PREFETCH:
        q, xe, xo, h, sx, xs, s, z, m = _q8_tile(
            xw_ptr, sx_ptr, xsum_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, 0, M, N, K, r3, r2, bt, wt,
            s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin, CODES, HI_BITS, SUB, TWO_LEVEL, ZERO, OFFSET, MINS, WB, NB,
            EVEN_K, EVEN_N, MR)
        for k0 in range(0, K, BK):
            if EVEN_K:  # the last iteration reloads its own tile (an L2 hit) rather than masking every load
                kn = tl.multiple_of(tl.minimum(k0 + BK, K - BK), BK)  # keeps the copies 16 bytes wide
            else:
                kn = k0 + BK
            q1, xe1, xo1, h1, sx1, xs1, s1, z1, m1 = _q8_tile(
                xw_ptr, sx_ptr, xsum_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, kn, M, N, K, r3, r2,
                bt, wt, s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin, CODES, HI_BITS, SUB, TWO_LEVEL, ZERO, OFFSET, MINS,
                WB, NB, EVEN_K, EVEN_N, MR)
            acc += _q8_dot(q, xe, xo, h, sx, xs, s, z, m, k0 // (32 // WB) + wt, CODES, HI_BITS, USE_ASM, BN, NB)
            q, xe, xo, h, sx, xs, s, z, m = q1, xe1, xo1, h1, sx1, xs1, s1, z1, m1
    else:
        for k0 in tl.range(0, K, BK, num_stages=STAGES):
            q, xe, xo, h, sx, xs, s, z, m = _q8_tile(
                xw_ptr, sx_ptr, xsum_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, k0, M, N, K, r3, r2,
                bt, wt, s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin, CODES, HI_BITS, SUB, TWO_LEVEL, ZERO, OFFSET, MINS,
                WB, NB, EVEN_K, EVEN_N, MR)
            acc += _q8_dot(q, xe, xo, h, sx, xs, s, z, m, k0 // (32 // WB) + wt, CODES, HI_BITS, USE_ASM, BN, NB)
    if not PERSIST:
        _q8_store(y_ptr, bias_ptr, rn, acc, M, N, s_ym, HAS_BIAS, EVEN_N, MR)


@triton.jit
def _prefetch_l2(ptrs):
    """Fetch the lines at ptrs into L2 (no registers written; kept: not pure)."""
    tl.inline_asm_elementwise("{ mov.u32 $0, 0; prefetch.global.L2 [$1]; }", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _q8_store(y_ptr, bias_ptr, rn, acc, M, N, s_ym, HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr, MR: tl.constexpr):
    """y[:, rn] = the sums of acc (BN, NB), or (MR, BN, NB) for M <= MR rows of x (+ bias)."""
    out = tl.sum(acc, axis=len(acc.shape) - 1)
    if HAS_BIAS:
        out += _ld(bias_ptr + rn, rn < N, EVEN_N).to(tl.float32)
    if MR == 1:
        if EVEN_N:
            tl.store(y_ptr + rn, out.to(y_ptr.dtype.element_ty))
        else:
            tl.store(y_ptr + rn, out.to(y_ptr.dtype.element_ty), mask=rn < N)
    else:
        rm = tl.arange(0, MR)[:, None]
        tl.store(y_ptr + rm * s_ym + rn[None, :], out.to(y_ptr.dtype.element_ty), mask=(rm < M) & (rn[None, :] < N))


@triton.jit
def _quant_x(x_ptr, perm_ptr, xw_ptr, sx_ptr, xsum_ptr, K, s_x, NIBBLES: tl.constexpr, NBLK: tl.constexpr,
             HAS_PERM: tl.constexpr = False, PDL: tl.constexpr = False):
    """packed.quantize_x_q8 as one kernel: NBLK blocks of 32 elements per program, row
    program_id(1) of x (stride s_x) into row program_id(1) of the outputs (K/4 words, K/32 blocks).
    HAS_PERM (act-order weights): element e is read from x[perm[e]], so the permutation costs no
    kernel of its own. PDL: lets the GEMV that reads its output launch at once (it waits for this
    kernel's results itself)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(1)
    x_ptr += row * s_x
    xw_ptr += row * (K // 4)
    sx_ptr += row * (K // 32)
    xsum_ptr += row * (K // 32)
    blk = tl.program_id(0) * NBLK + tl.arange(0, NBLK)
    bm = blk < K // 32
    j = tl.arange(0, 8)
    w4 = tl.arange(0, 4)
    # x as (NBLK, 4 words, 8 elements): in nibble order each word of 8 splits into even / odd
    # elements, four bytes each; byte order: element e of a word of 8
    e = (blk[:, None, None] * 32 + (w4 * 8)[None, :, None] + j[None, None, :])
    if HAS_PERM:
        e = tl.load(perm_ptr + e, mask=bm[:, None, None], other=0)
    x = tl.load(x_ptr + e, mask=bm[:, None, None], other=0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)
    inv = tl.where(amax > 0, tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32), amax), 0.0)  # IEEE, as torch
    v = x * inv[:, None, None]
    if INTERPRET_K:  # round half to even, as torch.round and rint do (floor(v + 0.5) is not)
        q = (v + 12582912.0) - 12582912.0
    else:
        q = tl.extra.cuda.libdevice.rint(v)
    qs = tl.sum(tl.sum(q, axis=2), axis=1)
    qi = q.to(tl.int32) & 0xFF
    if NIBBLES:
        # element 2i of word w of a block: byte i of the block's word w; element 2i+1: of word 4 + w
        sh = 8 * (j // 2)
        ev = tl.sum(tl.where((j % 2 == 0)[None, None, :], qi << sh[None, None, :], 0), axis=2)
        od = tl.sum(tl.where((j % 2 == 1)[None, None, :], qi << sh[None, None, :], 0), axis=2)
        ow = blk[:, None] * 8 + w4[None, :]
        tl.store(xw_ptr + ow, ev, mask=bm[:, None])
        tl.store(xw_ptr + ow + 4, od, mask=bm[:, None])
    else:
        sh = 8 * (j % 4)
        lo = tl.sum(tl.where((j < 4)[None, None, :], qi << sh[None, None, :], 0), axis=2)
        hi = tl.sum(tl.where((j >= 4)[None, None, :], qi << sh[None, None, :], 0), axis=2)
        ow = blk[:, None] * 8 + w4[None, :] * 2
        tl.store(xw_ptr + ow, lo, mask=bm[:, None])
        tl.store(xw_ptr + ow + 1, hi, mask=bm[:, None])
    sx = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
    tl.store(sx_ptr + blk, sx, mask=bm)
    tl.store(xsum_ptr + blk, sx * qs, mask=bm)


@triton.jit
def _tile(lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, rn, k0, N, K, s_lo, s_hi, s_sc, s_d, s_zp, s_mn,
          s_dmin, CODES: tl.constexpr, HI_BITS: tl.constexpr, SUB: tl.constexpr, SC_ROWS: tl.constexpr,
          TWO_LEVEL: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr, MINS: tl.constexpr,
          BN: tl.constexpr, BK: tl.constexpr):
    """Weights (BN, BK) in float32 for rows rn from column k0: group parameters broadcast, not gathered."""
    EPW: tl.constexpr = 8 if CODES == 0 else 4
    GS: tl.constexpr = SUB if SUB < BK else BK
    GT: tl.constexpr = BK // GS
    GW: tl.constexpr = GS // EPW
    rn4 = rn[:, None, None, None]
    rn2 = rn[:, None]
    g2 = tl.arange(0, GT)[None, :]
    wt = (tl.arange(0, GT) * GW)[None, :, None, None] + tl.arange(0, GW)[None, None, :, None]
    i4 = tl.arange(0, EPW)[None, None, None, :]
    w = k0 // EPW + wt
    v = _codes(lo_ptr, hi_ptr, rn4, w, i4, (rn4 < N) & (w < K // EPW), s_lo, s_hi, CODES, HI_BITS)
    e2 = k0 + g2 * GS
    s, z, m = _group_params(sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, rn2, e2, (rn2 < N) & (e2 < K),
                            s_sc, s_d, s_zp, s_mn, s_dmin, SUB, SC_ROWS, TWO_LEVEL, ZERO, OFFSET, MINS)
    return tl.reshape((v - z[:, :, None, None]) * s[:, :, None, None] - m[:, :, None, None], (BN, BK))


@triton.jit
def _gemm(x_ptr, y_ptr, bias_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, M, N, K, s_xm, s_ym,
          s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin,
          CODES: tl.constexpr, HI_BITS: tl.constexpr, SUB: tl.constexpr, SC_ROWS: tl.constexpr,
          TWO_LEVEL: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr, MINS: tl.constexpr,
          HAS_BIAS: tl.constexpr, F32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """M > 1: tiles dequantized in registers (_tile) into tl.dot."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    kt = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        wf = _tile(lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, rn, k0, N, K, s_lo, s_hi, s_sc, s_d, s_zp,
                   s_mn, s_dmin, CODES, HI_BITS, SUB, SC_ROWS, TWO_LEVEL, ZERO, OFFSET, MINS, BN, BK)
        kk = k0 + kt
        xt = tl.load(x_ptr + rm[:, None] * s_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0)
        if F32:
            acc += tl.dot(xt.to(tl.float32), tl.trans(wf), input_precision="ieee")
        else:
            acc += tl.dot(xt, tl.trans(wf.to(xt.dtype)))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0).to(tl.float32)[None, :]
    ym = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm[:, None] * s_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=ym)


@triton.jit
def _dequant(w_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, N, K, s_w,
             s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin,
             CODES: tl.constexpr, HI_BITS: tl.constexpr, SUB: tl.constexpr, SC_ROWS: tl.constexpr,
             TWO_LEVEL: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr, MINS: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr):
    """W (N, K) in w's dtype, tile (program_id(0), program_id(1)): for a cuBLAS GEMM at many rows."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * BK
    wf = _tile(lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, rn, k0, N, K, s_lo, s_hi, s_sc, s_d, s_zp,
               s_mn, s_dmin, CODES, HI_BITS, SUB, SC_ROWS, TWO_LEVEL, ZERO, OFFSET, MINS, BN, BK)
    kk = k0 + tl.arange(0, BK)
    tl.store(w_ptr + rn[:, None] * s_w + kk[None, :], wf.to(w_ptr.dtype.element_ty),
             mask=(rn[:, None] < N) & (kk[None, :] < K))


_FMT_KEYS = ["CODES", "HI_BITS", "SUB", "SC_ROWS", "TWO_LEVEL", "ZERO", "MINS"]
# The winners of an H200 sweep of fixed configs (docs/benchmarks.md): BN 4 = _gemv4, else _gemv_rows.
_GEMV_CONFIGS = [triton.Config({"BN": bn, "BK": bk, "STAGES": st}, num_warps=w)
                 for bn, bk, w, st in [(8, 1024, 2, 3), (16, 1024, 4, 3), (8, 1024, 4, 1), (8, 1024, 4, 3),
                                       (4, 2048, 2, 1), (4, 1024, 2, 1), (4, 2048, 4, 1), (4, 4096, 4, 1)]]
_GEMM_CONFIGS = [triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=s)
                 for bm, bn, bk, w, s in [(16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 32, 256, 4, 3),
                                          (64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 64, 128, 8, 3)]]

def _autotune(configs, key, **kw):
    """triton.autotune, keeping its choices on disk where this Triton can (cache_results)."""
    try:
        return triton.autotune(configs, key=key, cache_results=True, **kw)
    except TypeError:
        return triton.autotune(configs, key=key, **kw)


_even_k = triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BK"] == 0})
_even_kn = triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BK"] == 0, "EVEN_N": lambda a: a["N"] % a["BN"] == 0})
_gemv_tuned = _autotune(_GEMV_CONFIGS, ["N", "K", *_FMT_KEYS])(_even_k(_gemv))
_Q8_CONFIGS = ([triton.Config({"BN": bn, "BK": bk, "STAGES": st}, num_warps=w)  # pipelined through shared memory
                for bn, bk, w, st in [(4, 512, 1, 3), (4, 512, 1, 2), (8, 512, 1, 3), (4, 1024, 2, 3), (2, 512, 1, 3)]]
               # register prefetch, one 32-element block per thread and row; PERSIST: programs per SM. The
               # H200 winners of benchmarks.q8_sweep per decode shape and format (docs/benchmarks.md, session 5)
               + [triton.Config({"BN": bn, "BK": bk, "STAGES": 1, "PREFETCH": True, "PERSIST": pe}, num_warps=w)
                  for bn, bk, w, pe in [(1, 1024, 1, 0), (2, 1024, 1, 0), (4, 1024, 1, 0), (1, 2048, 1, 0),
                                        (2, 2048, 1, 0), (2, 1024, 1, 32), (1, 2048, 1, 32), (1, 2048, 1, 16)]])
_Q8_KEYS = ["N", "K", "MR", "CODES", "HI_BITS", "SUB", "TWO_LEVEL", "ZERO", "MINS"]
_gemv_q8_tuned = _autotune(_Q8_CONFIGS, _Q8_KEYS)(_even_kn(_gemv_q8))
_Q8M_CONFIGS = ([triton.Config({"BN": bn, "BK": bk, "STAGES": st}, num_warps=w)
                 for bn, bk, w, st in [(4, 256, 1, 3), (8, 256, 2, 3), (4, 512, 1, 2), (16, 256, 4, 3),
                                       (8, 128, 1, 3), (2, 512, 1, 3)]]
                # the M=1 winners' register prefetch, not yet measured at 2-4 rows
                + [triton.Config({"BN": bn, "BK": bk, "STAGES": 1, "PREFETCH": True, "PERSIST": pe}, num_warps=w)
                   for bn, bk, w, pe in [(1, 1024, 1, 0), (2, 1024, 1, 0), (4, 1024, 1, 0), (1, 2048, 1, 32)]])
_gemm_q8_tuned = _autotune(_Q8M_CONFIGS, _Q8_KEYS)(_even_kn(_gemv_q8))  # the same kernel with MR rows of x


def _m_bucket(m: int) -> int:
    return 16 if m <= 16 else 64 if m <= 64 else 256 if m <= 256 else 1024


@triton.jit
def _gemm_bucketed(x_ptr, y_ptr, bias_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, M, N, K,
                   s_xm, s_ym, s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin, M_BUCKET,
                   CODES: tl.constexpr, HI_BITS: tl.constexpr, SUB: tl.constexpr, SC_ROWS: tl.constexpr,
                   TWO_LEVEL: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr, MINS: tl.constexpr,
                   HAS_BIAS: tl.constexpr, F32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr):
    """_gemm with an extra M_BUCKET argument so the autotuner keeps one choice per size class."""
    _gemm(x_ptr, y_ptr, bias_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, M, N, K, s_xm, s_ym,
          s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin, CODES, HI_BITS, SUB, SC_ROWS, TWO_LEVEL, ZERO, OFFSET, MINS,
          HAS_BIAS, F32, BM, BN, BK)


def _prune_gemm(configs, named_args, **kw):
    """Small M: only BM=16 tiles; large M: no BM=16 tiles."""
    small = named_args["M_BUCKET"] <= 16
    return [c for c in configs if (c.kwargs["BM"] == 16) == small] or configs


_gemm_tuned = _autotune(_GEMM_CONFIGS, ["N", "K", "M_BUCKET", *_FMT_KEYS],
                        prune_configs_by={"early_config_prune": _prune_gemm})(_gemm_bucketed)


def autotune_choices() -> dict[str, dict[str, str]]:
    """The autotuner's picks so far, per kernel and key ("N=28672, K=8192, CODES=0, ..."): for
    benchmark records (two machines can pick differently for the same shape)."""
    from dsq.kernels import triton_mma

    out = {}
    for name, tuned in (("gemv_q8", _gemv_q8_tuned), ("gemv_q8 (2-4 rows)", _gemm_q8_tuned), ("gemv", _gemv_tuned),
                        ("gemm", _gemm_tuned), ("mma_t", triton_mma._mma_t_tuned),
                        ("mma_s", triton_mma._mma_s_tuned)):
        picks = {", ".join(f"{n}={v}" for n, v in zip(tuned.keys, key)): str(cfg)
                 for key, cfg in getattr(tuned, "cache", {}).items()}
        if picks:
            out[name] = picks
    return out


@functools.lru_cache(maxsize=None)
def _fp8_hw(device: torch.device) -> bool:
    """Whether the GPU converts e4m3 in hardware (cvt.rn.f16x2.e4m3x2: sm_89 and later); never
    under the interpreter."""
    return not INTERPRET and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors (persistent grids); 1 off the GPU (the interpreter), so a
    persistent test grid is PERSIST programs, each walking many row tiles."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


@functools.lru_cache(maxsize=None)
def _pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (griddepcontrol): Hopper and later, with a Triton that has it;
    never under the interpreter. DSQ_PDL=0 turns it off."""
    return (not INTERPRET and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
            and hasattr(tl.extra.cuda, "gdc_wait") and os.environ.get("DSQ_PDL", "1") != "0")


def _rows_grid(N: int, BN: int, persist: int, sms: int) -> int:
    """Programs over N rows in tiles of BN: one per tile, or with `persist` (programs per SM) at
    most that many per SM, each walking several tiles."""
    tiles = triton.cdiv(N, BN)
    return min(tiles, persist * sms) if persist else tiles


def _tiles_ok(p: Packed) -> bool:
    """Tiles hold whole scale groups or lie inside one: a group is a power of two >= 16, or a row;
    codes are read as 32-bit words."""
    sub = p.fmt.sub
    group_ok = sub >= p.K or (sub >= 16 and sub & (sub - 1) == 0)
    return group_ok and p.K % (8 if p.fmt.codes == NIB else 4) == 0


def supported(p: Packed, x: torch.Tensor) -> bool:
    return _tiles_ok(p) and x.dtype in (torch.float16, torch.bfloat16, torch.float32)


def _x_rows(x: torch.Tensor, p: Packed) -> torch.Tensor:
    """x as contiguous rows (M, K) in the weight's stored column order (act-order permuted)."""
    x2 = x.reshape(-1, p.K)
    if p.perm is not None:
        x2 = x2[:, p.perm]
    return x2.contiguous()


def _fmt_flags(f) -> dict:
    """A Fmt's compile-time flags, as _gemv and _gemm / _dequant (through _tile) take them."""
    return {"CODES": f.codes, "HI_BITS": f.hi_bits, "SUB": f.sub, "SC_ROWS": f.sc_rows, "TWO_LEVEL": f.two_level,
            "ZERO": f.zero, "OFFSET": f.offset, "MINS": f.mins}


def _planes(p: Packed, hi: bool = True) -> tuple[list[torch.Tensor], list[int]]:
    """The kernels' plane arguments (lo as int32 words, [hi,] sc, d, zp, mn, dmin) and their row
    strides; an absent plane is stood in for by sc (never read: its constexpr flag is off)."""
    none = p.sc
    planes = [p.lo.view(torch.int32)] + ([p.hi.view(torch.int32) if p.hi is not None else none] if hi else [])
    planes += [p.sc] + [t if t is not None else none for t in (p.d, p.zp, p.mn, p.dmin)]
    return planes, [t.stride(0) for t in planes]


def q8_linear(x: torch.Tensor, p: Packed, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
              config: dict | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for 1 to 16 rows of x, each rounded to int8 per 32 elements by _quant_x
    (_gemv_q8 with MR = 1 for one row, the next power of two above; computes
    packed.linear_ref_q8). Formats: packed.q8_ok."""
    x1 = x.reshape(-1, p.K)  # act-order: _quant_x reads x through the permutation
    if x1.stride(-1) != 1:
        x1 = x1.contiguous()
    M = x1.shape[0]
    if not 1 <= M <= 16:
        raise ValueError("q8_linear takes 1 to 16 rows of x")
    if not q8_ok(p, M):
        raise ValueError(f"the int8-activation kernels do not take this format at {M} rows (packed.q8_ok)")
    xw = torch.empty(M, p.K // 4, dtype=torch.int32, device=x.device)
    sx = torch.empty(M, p.K // 32, dtype=torch.float32, device=x.device)
    xs = torch.empty_like(sx)
    pdl = _pdl(x.device)
    _quant_x[(triton.cdiv(p.K // 32, 4), M)](x1, p.perm if p.perm is not None else x1, xw, sx, xs, p.K, x1.stride(0),
                                             NIBBLES=p.fmt.codes == NIB, NBLK=4, HAS_PERM=p.perm is not None, PDL=pdl)
    y = out if out is not None else torch.empty(M, p.N, dtype=x.dtype, device=x.device)
    f = p.fmt
    planes, strides = _planes(p)
    flags = {**_fmt_flags(f), "HAS_BIAS": bias is not None, "USE_ASM": not INTERPRET,
             "MR": 1 << (M - 1).bit_length()}  # MR: 1 for one row; an autotune key
    del flags["SC_ROWS"]  # q8_ok refuses row-block scales
    if pdl:
        flags.update(PDL=True, launch_pdl=True)
    args = (xw, sx, xs, y, bias if bias is not None else y, *planes, M, p.N, p.K, y.stride(0), *strides)
    sms = _sm_count(x.device)
    if config is None and not INTERPRET:
        grid = lambda meta: (_rows_grid(p.N, meta["BN"], meta.get("PERSIST", 0), sms),)  # noqa: E731
        (_gemv_q8_tuned if M == 1 else _gemm_q8_tuned)[grid](*args, **flags)
    else:
        cfg = {"BN": 8, "BK": 64, "STAGES": 1, **(config or {})}
        cfg.setdefault("EVEN_K", p.K % cfg["BK"] == 0)
        cfg.setdefault("EVEN_N", p.N % cfg["BN"] == 0)
        _gemv_q8[(_rows_grid(p.N, cfg["BN"], cfg.get("PERSIST", 0), sms),)](*args, **flags, **cfg)
    return y.reshape(*x.shape[:-1], p.N)


def q8_rows_linear(x: torch.Tensor, p: Packed, bias: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """q8_linear one row at a time, into one output: for formats the int8-activation kernel takes
    at one row only (Q6_K). On an H200 a Q6_K GEMV runs at 1.5-2.0x bf16, so 2-4 rows this way
    (0.39-1.09x) beat the tl.dot GEMM (0.18-0.26x) and the bf16 weight for cuBLAS (0.25-0.37x)."""
    x1 = x.reshape(-1, p.K)
    y = out if out is not None else torch.empty(x1.shape[0], p.N, dtype=x.dtype, device=x.device)
    for i in range(x1.shape[0]):
        q8_linear(x1[i:i + 1], p, bias, out=y[i:i + 1])
    return y.reshape(*x.shape[:-1], p.N)


def packed_linear(x: torch.Tensor, p: Packed, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for a Packed weight on x's device; y in x's dtype. `out` (M, N) may be
    given (the tests poison it); `config` fixes the tile sizes (no autotuning)."""
    shape = x.shape
    x2 = _x_rows(x, p)
    M = x2.shape[0]
    y = out if out is not None else torch.empty(M, p.N, dtype=x.dtype, device=x.device)
    f = p.fmt
    planes, strides = _planes(p)
    flags = {**_fmt_flags(f), "HAS_BIAS": bias is not None}
    b = bias if bias is not None else y
    tune = config is None and not INTERPRET
    if M == 1:
        flags["FP8_HW"] = f.codes == FP8 and _fp8_hw(x.device)
        if tune:
            grid = lambda meta: (triton.cdiv(p.N, meta["BN"]),)  # noqa: E731
            _gemv_tuned[grid](x2, y, b, *planes, p.N, p.K, *strides, **flags)
        else:
            cfg = {"BN": 8, "BK": 64, "STAGES": 1, **(config or {})}
            cfg.setdefault("EVEN_K", p.K % cfg["BK"] == 0)
            _gemv[(triton.cdiv(p.N, cfg["BN"]),)](x2, y, b, *planes, p.N, p.K, *strides, **flags, **cfg)
    else:
        # float32 dots for float32 x, and under the interpreter (its bf16 dot is wrong)
        flags["F32"] = x.dtype == torch.float32 or INTERPRET
        if tune:
            grid = lambda meta: (triton.cdiv(M, meta["BM"]), triton.cdiv(p.N, meta["BN"]))  # noqa: E731
            _gemm_tuned[grid](x2, y, b, *planes, M, p.N, p.K, x2.stride(0), y.stride(0), *strides, _m_bucket(M),
                              **flags)
        else:
            cfg = config or {"BM": 16, "BN": 16, "BK": 64}
            grid = (triton.cdiv(M, cfg["BM"]), triton.cdiv(p.N, cfg["BN"]))
            _gemm[grid](x2, y, b, *planes, M, p.N, p.K, x2.stride(0), y.stride(0), *strides, **flags, **cfg)
    return y.reshape(*shape[:-1], p.N)


def dequantize(p: Packed, dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None,
               config: dict | None = None) -> torch.Tensor:
    """The weight (N, K) in `dtype` on p's device, in its stored column order (act-order permuted,
    as _x_rows permutes x): the same tile dequantization as the tl.dot GEMM, written out."""
    if not _tiles_ok(p):
        raise ValueError(f"dequantize: groups of {p.fmt.sub} do not fit power-of-two tiles")
    planes, strides = _planes(p)
    w = out if out is not None else torch.empty(p.N, p.K, dtype=dtype, device=p.lo.device)
    cfg = {"BN": 32, "BK": 128, **(config or {})}
    grid = (triton.cdiv(p.N, cfg["BN"]), triton.cdiv(p.K, cfg["BK"]))
    _dequant[grid](w, *planes, p.N, p.K, w.stride(0), *strides, **_fmt_flags(p.fmt), **cfg, num_warps=4)
    return w


def dequant_linear(x: torch.Tensor, p: Packed, bias: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) by writing W out in x's dtype (`dequantize`) and one cuBLAS GEMM: for
    many rows of x (prefill), where the GEMM's arithmetic outweighs writing W once. `out` (M, N)
    may be given."""
    x2 = _x_rows(x, p)
    wt = dequantize(p, x.dtype).t()
    y = torch.mm(x2, wt, out=out) if bias is None else torch.addmm(bias.to(x.dtype), x2, wt, out=out)
    return y.reshape(*x.shape[:-1], p.N)
