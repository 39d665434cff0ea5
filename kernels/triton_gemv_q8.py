"""1 to 16 rows of x rounded to int8 against integer codes (int4/int8 AWQ and GPTQ, Q4_0, Q5_0,
Q8_0, Q4_K, Q5_K; Q6_K at one row): `q8_linear`, and `q8_rows_linear` (one row at a time);
`q8_experts`: one row a (token, expert) pair of a MoE layer, the expert ids read on the device.

`_quant_x` rounds x to int8 per 32 elements (llama.cpp's Q8_1 scheme); in `_gemv_q8` codes and x
meet in dp4a (four products per instruction, exact int32 per 32-element block), then block and
group scales apply in float. Computes exactly packed.linear_ref_q8. Small programs (1-4 weight
rows, one warp) with the next tile's loads held in registers run fastest on an H200
(docs/benchmarks.md#gpu-kernels-by-rows-of-x).
"""

from __future__ import annotations

import functools
import os
import weakref

import torch
import triton
import triton.language as tl
from dsq.kernels.packed import NIB, Packed, q8_ok
from dsq.kernels.triton_common import (INTERPRET, INTERPRET_K, autotune, even_kn, fmt_flags, group_params, ld,
                                       plane_args, sm_count)


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
def _xld(ptr, kmask, rmask, EVEN_K: tl.constexpr, MR: tl.constexpr):
    """A load of x's words or block values: one row (MR 1) as ld; MR rows with the row mask rmask
    (rows past M), and the K mask kmask unless EVEN_K."""
    if MR == 1:
        return ld(ptr, kmask, EVEN_K)
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
    q = ld(lo_ptr + r3 * s_lo + w, wm, EV)
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
            h = ld(hi_ptr + r3 * s_hi + w // (4 // HI_BITS), wm, EV)
    else:
        xe = _xld(xw_ptr + m4 * (K // 4) + w, w < K // 4, m4 < M, EVEN_K, MR)
        xo = xe
    sx = _xld(sx_ptr + m3 * (K // 32) + b, bm, m3 < M, EVEN_K, MR)
    if HI_BITS == 2:  # two 16-element scale groups a block
        eh = (b * 32)[:, :, None] + (tl.arange(0, 2) * 16)[None, None, :]
        s = ld(sc_ptr + r3 * s_sc + eh // 16, (bm & (r2 < N))[:, :, None], EV).to(tl.float32)
        z = ld(d_ptr + r2 * s_d + (b * 32) // 256, bm & (r2 < N), EV).to(tl.float32)
        xs = sx
        m = z
    else:
        xs = _xld(xsum_ptr + m3 * (K // 32) + b, bm, m3 < M, EVEN_K, MR)
        s, z, m = group_params(sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, r2, b * 32, bm & (r2 < N), s_sc, s_d, s_zp,
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
        out += ld(bias_ptr + rn, rn < N, EVEN_N).to(tl.float32)
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
    # x as (NBLK, 4 words, 8 elements)
    e = (blk[:, None, None] * 32 + (w4 * 8)[None, :, None] + j[None, None, :])
    if HAS_PERM:
        e = tl.load(perm_ptr + e, mask=bm[:, None, None], other=0)
    x = tl.load(x_ptr + e, mask=bm[:, None, None], other=0).to(tl.float32)
    _q8_blocks(x, blk, bm, xw_ptr, sx_ptr, xsum_ptr, NIBBLES, xw_ptr, False)


@triton.jit
def _q8_blocks(x, blk, bm, xw_ptr, sx_ptr, xsum_ptr, NIBBLES: tl.constexpr, xb_ptr, BOTH: tl.constexpr):
    """x (NB, 4, 8) float32, blocks `blk` (NB,) of 32 elements of one row as 4 words of 8, rounded to
    int8 and stored where `bm` into that row's words, scales and sums (xw_ptr, sx_ptr, xsum_ptr: the
    row's first): _quant_x's work, which the kernels that make x (triton_elementwise's norm and
    activation, the decode attention's combination) also do in their own launch. Words in byte
    order go to xb_ptr's row (xw_ptr's without NIBBLES); BOTH (with NIBBLES) writes them as well as
    the nibble-order ones (the scales and sums are the same), for GEMVs of byte-order formats (Q6_K,
    Q8_0) that read the same x."""
    j = tl.arange(0, 8)
    w4 = tl.arange(0, 4)
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
        # in nibble order each word of 8 splits into even / odd elements, four bytes each: element 2i of
        # word w of a block is byte i of the block's word w; element 2i+1, of its word 4 + w
        sh = 8 * (j // 2)
        ev = tl.sum(tl.where((j % 2 == 0)[None, None, :], qi << sh[None, None, :], 0), axis=2)
        od = tl.sum(tl.where((j % 2 == 1)[None, None, :], qi << sh[None, None, :], 0), axis=2)
        ow = blk[:, None] * 8 + w4[None, :]
        tl.store(xw_ptr + ow, ev, mask=bm[:, None])
        tl.store(xw_ptr + ow + 4, od, mask=bm[:, None])
    if BOTH or not NIBBLES:  # byte order: element e of a word of 8
        sh = 8 * (j % 4)
        lo = tl.sum(tl.where((j < 4)[None, None, :], qi << sh[None, None, :], 0), axis=2)
        hi = tl.sum(tl.where((j >= 4)[None, None, :], qi << sh[None, None, :], 0), axis=2)
        ob = blk[:, None] * 8 + w4[None, :] * 2
        tl.store(xb_ptr + ob, lo, mask=bm[:, None])
        tl.store(xb_ptr + ob + 1, hi, mask=bm[:, None])
    sx = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
    tl.store(sx_ptr + blk, sx, mask=bm)
    tl.store(xsum_ptr + blk, sx * qs, mask=bm)


@triton.jit
def _gemv_q8_experts(xw_ptr, sx_ptr, xsum_ptr, y_ptr, ids_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr,
                     dmin_ptr, N, K, XDIV, s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin,
                     CODES: tl.constexpr, HI_BITS: tl.constexpr, SUB: tl.constexpr, TWO_LEVEL: tl.constexpr,
                     ZERO: tl.constexpr, OFFSET: tl.constexpr, MINS: tl.constexpr, USE_ASM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, EVEN_K: tl.constexpr = False,
                     EVEN_N: tl.constexpr = False, PREFETCH: tl.constexpr = False):
    """_gemv_q8 (one row of int8 x) over (token, expert) pairs: program (n, p) computes BN outputs
    of pair p, y[p] = x[p // XDIV] W_ids[p]^T, the planes stacking the experts' weights of N rows
    each. The expert id is read here, on the device, and moves every plane's base pointer to the
    expert's first row (per-row planes: q8_ok formats have no row-block scales)."""
    p = tl.program_id(1)
    e = tl.load(ids_ptr + p).to(tl.int64) * N  # the expert's first row; int64: E * N rows may pass 2^31 words
    xr = (p // XDIV).to(tl.int64)
    _gemv_q8(xw_ptr + xr * (K // 4), sx_ptr + xr * (K // 32), xsum_ptr + xr * (K // 32), y_ptr + p.to(tl.int64) * N,
             y_ptr, lo_ptr + e * s_lo, hi_ptr + e * s_hi, sc_ptr + e * s_sc, d_ptr + e * s_d, zp_ptr + e * s_zp,
             mn_ptr + e * s_mn, dmin_ptr + e * s_dmin, 1, N, K, N, s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin,
             CODES, HI_BITS, SUB, TWO_LEVEL, ZERO, OFFSET, MINS, False, USE_ASM, BN, BK, STAGES, EVEN_K, EVEN_N,
             PREFETCH, 0, False, 1)


# pipelined through shared memory, and register prefetch (one 32-element block a thread and row; PERSIST:
# programs per SM): the H200 winners of benchmarks.q8_sweep per decode shape and format
# (docs/benchmarks.md#gpu-kernels-by-rows-of-x)
_Q8_CONFIGS = ([triton.Config({"BN": bn, "BK": bk, "STAGES": st}, num_warps=w)
                for bn, bk, w, st in [(4, 512, 1, 3), (4, 512, 1, 2), (8, 512, 1, 3), (4, 1024, 2, 3), (2, 512, 1, 3)]]
               + [triton.Config({"BN": bn, "BK": bk, "STAGES": 1, "PREFETCH": True, "PERSIST": pe}, num_warps=w)
                  for bn, bk, w, pe in [(1, 1024, 1, 0), (2, 1024, 1, 0), (4, 1024, 1, 0), (1, 2048, 1, 0),
                                        (2, 2048, 1, 0), (2, 1024, 1, 32), (1, 2048, 1, 32), (1, 2048, 1, 16)]])
_Q8_KEYS = ["N", "K", "MR", "CODES", "HI_BITS", "SUB", "TWO_LEVEL", "ZERO", "MINS"]
_gemv_q8_tuned = autotune(_Q8_CONFIGS, _Q8_KEYS)(even_kn(_gemv_q8))
_Q8M_CONFIGS = ([triton.Config({"BN": bn, "BK": bk, "STAGES": st}, num_warps=w)
                 for bn, bk, w, st in [(4, 256, 1, 3), (8, 256, 2, 3), (4, 512, 1, 2), (16, 256, 4, 3),
                                       (8, 128, 1, 3), (2, 512, 1, 3)]]
                # the one-row winners' register prefetch (untimed at 2-4 rows)
                + [triton.Config({"BN": bn, "BK": bk, "STAGES": 1, "PREFETCH": True, "PERSIST": pe}, num_warps=w)
                   for bn, bk, w, pe in [(1, 1024, 1, 0), (2, 1024, 1, 0), (4, 1024, 1, 0), (1, 2048, 1, 32)]])
_gemm_q8_tuned = autotune(_Q8M_CONFIGS, _Q8_KEYS)(even_kn(_gemv_q8))  # the same kernel with MR rows of x
# the one-row candidates that keep one program a row tile (no PERSIST: the grid's second axis is the pairs)
_Q8E_CONFIGS = [triton.Config({k: v for k, v in c.kwargs.items() if k != "PERSIST"}, num_warps=c.num_warps)
                for c in _Q8_CONFIGS if not c.kwargs.get("PERSIST")]
_gemv_q8_experts_tuned = autotune(_Q8E_CONFIGS, [k for k in _Q8_KEYS if k != "MR"])(even_kn(_gemv_q8_experts))


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


def q8_linear(x: torch.Tensor, p: Packed, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
              config: dict | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for 1 to 16 rows of x, each rounded to int8 per 32 elements by _quant_x
    (_gemv_q8 with MR = 1 for one row, the next power of two above; computes
    packed.linear_ref_q8). Formats: packed.q8_ok."""
    x1 = _x_rows(x, p)
    M = x1.shape[0]
    pdl = _pdl(x.device)
    xw, sx, xs = _quantize_x(x1, p, pdl)
    y = out if out is not None else torch.empty(M, p.N, dtype=x.dtype, device=x.device)
    planes, strides = plane_args(p)
    flags = {**fmt_flags(p), "HAS_BIAS": bias is not None, "USE_ASM": not INTERPRET,
             "MR": 1 << (M - 1).bit_length()}  # MR: 1 for one row; an autotune key
    del flags["SC_ROWS"]  # q8_ok refuses row-block scales
    if pdl:
        flags.update(PDL=True, launch_pdl=True)
    args = (xw, sx, xs, y, bias if bias is not None else y, *planes, M, p.N, p.K, y.stride(0), *strides)
    _launch(p, args, flags, config, M == 1, sm_count(x.device))
    return y.reshape(*x.shape[:-1], p.N)


def _x_rows(x: torch.Tensor, p: Packed) -> torch.Tensor:
    """x as rows (M, K) with unit stride along K (act-order: _quant_x reads x through the
    permutation); ValueError unless q8_linear takes M rows of this format."""
    x1 = x.reshape(-1, p.K)
    if x1.stride(-1) != 1:
        x1 = x1.contiguous()
    M = x1.shape[0]
    if not 1 <= M <= 16:
        raise ValueError("q8_linear takes 1 to 16 rows of x")
    if not q8_ok(p, M):
        raise ValueError(f"the int8-activation kernels do not take this format at {M} rows (packed.q8_ok)")
    return x1


# x rounded to int8 by the kernel that made x (triton_elementwise's norm and activation, the decode
# attention's combination), for the GEMVs that read x next: (weakref to x, its address, its size,
# (words in nibble order, scales, sums, words in byte order)), newest last; a decode layer reads at
# most two such x before it makes the next
_MADE: list = []
_MADE_KEEP = 4


def offer(x: torch.Tensor, xq: tuple[torch.Tensor, ...]) -> None:
    """Record xq (q8_room(..., both=True): words (M, K / 4) in nibble order, scales and sums
    (M, K / 32), words in byte order) as x's rows rounded to int8, made in the launch that made x:
    q8 GEMVs of x, or of a view of all of it, in nibble order (the GGUF K-quants' and int4's) or
    byte order (Q6_K, Q8_0) then skip their _quant_x launch. The
    producers' outputs are never written in place after (the models' norm and activation outputs are
    read, not updated), and an entry lives only as long as x: its memory cannot be another tensor's
    meanwhile."""
    keep = [e for e in _MADE[-(_MADE_KEEP - 1):] if e[0]() is not None]
    _MADE[:] = keep + [(weakref.ref(x), x.data_ptr(), x.numel(), xq)]


def _made(x1: torch.Tensor, p: Packed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The offered rounding of rows x1 for weight p (words in p's order, scales, sums), or None."""
    if p.perm is not None:
        return None
    ptr, n = x1.data_ptr(), x1.numel()
    for ref, at, size, xq in reversed(_MADE):
        if (at == ptr and size == n and xq[0].shape == (x1.shape[0], p.K // 4)
                and xq[0].device == x1.device and ref() is not None):
            return xq[:3] if p.fmt.codes == NIB else (xq[3], xq[1], xq[2])
    return None


def q8_room(M: int, K: int, device, both: bool = False) -> tuple[torch.Tensor, ...]:
    """Room for M rows of K values rounded to int8: words (M, K / 4), block scales and sums (M, K / 32);
    with `both`, words in byte order after them (_q8_blocks' BOTH)."""
    sx = torch.empty(M, K // 32, dtype=torch.float32, device=device)
    xw = torch.empty(M, K // 4, dtype=torch.int32, device=device)
    return (xw, sx, torch.empty_like(sx)) + ((torch.empty_like(xw),) if both else ())


def _quantize_x(x1: torch.Tensor, p: Packed, pdl: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_quant_x on rows x1: x's int8 codes as words (M, K / 4), block scales and block sums (M, K / 32);
    what the kernel that made x1 offered instead, if it did."""
    made = _made(x1, p)
    if made is not None:
        return made
    M = x1.shape[0]
    xw, sx, xs = q8_room(M, p.K, x1.device)
    _quant_x[(triton.cdiv(p.K // 32, 4), M)](x1, p.perm if p.perm is not None else x1, xw, sx, xs, p.K, x1.stride(0),
                                             NIBBLES=p.fmt.codes == NIB, NBLK=4, HAS_PERM=p.perm is not None, PDL=pdl)
    return xw, sx, xs


def _launch(p: Packed, args: tuple, flags: dict, config: dict | None, one_row: bool, sms: int) -> None:
    """_gemv_q8 autotuned (one row, or MR rows: their own candidates), or with `config` (and under
    the interpreter) on fixed tiles."""
    if config is None and not INTERPRET:
        grid = lambda meta: (_rows_grid(p.N, meta["BN"], meta.get("PERSIST", 0), sms),)  # noqa: E731
        (_gemv_q8_tuned if one_row else _gemm_q8_tuned)[grid](*args, **flags)
    else:
        cfg = {"BN": 8, "BK": 64, "STAGES": 1, **(config or {})}
        cfg.setdefault("EVEN_K", p.K % cfg["BK"] == 0)
        cfg.setdefault("EVEN_N", p.N % cfg["BN"] == 0)
        _gemv_q8[(_rows_grid(p.N, cfg["BN"], cfg.get("PERSIST", 0), sms),)](*args, **flags, **cfg)


def q8_rows_linear(x: torch.Tensor, p: Packed, bias: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """q8_linear one row at a time, into one output: for formats the int8-activation kernel takes
    at one row only (Q6_K): on an H200, 2-4 rows this way beat the tl.dot GEMM and the bf16 weight
    through cuBLAS (docs/benchmarks.md#gpu-kernels-by-rows-of-x)."""
    x1 = x.reshape(-1, p.K)
    y = out if out is not None else torch.empty(x1.shape[0], p.N, dtype=x.dtype, device=x.device)
    for i in range(x1.shape[0]):
        q8_linear(x1[i:i + 1], p, bias, out=y[i:i + 1])
    return y.reshape(*x.shape[:-1], p.N)


def q8_experts(x: torch.Tensor, p: Packed, ids: torch.Tensor, n_expert: int, out: torch.Tensor | None = None,
               config: dict | None = None) -> torch.Tensor:
    """triton_gemv.gemv_experts with x rounded to int8 per 32 elements (_quant_x, once per row of x):
    y[i] = x_q8[i // (P / T)] W_ids[i]^T for the P = ids.numel() pairs, `p` stacking n_expert
    weights of p.N / n_expert rows; computes packed.linear_ref_q8 per pair. Formats: packed.q8_ok
    at one row. The ids stay on the device (no host sync)."""
    P = ids.numel()
    x1 = x.reshape(-1, p.K)
    if x1.stride(-1) != 1:
        x1 = x1.contiguous()
    T = x1.shape[0]
    if P % T or p.perm is not None or p.N % n_expert or not q8_ok(p, 1):
        raise ValueError("q8_experts takes one row of x per token or per pair, no act-order, experts of equal rows "
                         "and a format packed.q8_ok takes at one row")
    N = p.N // n_expert
    ids1 = ids.reshape(P)
    if ids1.stride(0) != 1:
        ids1 = ids1.contiguous()
    xw, sx, xs = _quantize_x(x1, p, False)
    y = out if out is not None else torch.empty(P, N, dtype=x.dtype, device=x.device)
    planes, strides = plane_args(p)
    flags = {**fmt_flags(p), "USE_ASM": not INTERPRET}
    del flags["SC_ROWS"]
    args = (xw, sx, xs, y, ids1, *planes, N, p.K, P // T, *strides)
    if config is None and not INTERPRET:
        grid = lambda meta: (triton.cdiv(N, meta["BN"]), P)  # noqa: E731
        _gemv_q8_experts_tuned[grid](*args, **flags)
    else:
        cfg = {"BN": 8, "BK": 64, "STAGES": 1, **(config or {})}
        cfg.setdefault("EVEN_K", p.K % cfg["BK"] == 0)
        cfg.setdefault("EVEN_N", N % cfg["BN"] == 0)
        _gemv_q8_experts[(triton.cdiv(N, cfg["BN"]), P)](*args, **flags, **cfg)
    return y
