"""Tensor cores for a few rows of x (batched decode, short prompts; the dispatcher sends 3-64 rows)
against 4-bit grouped codes (AWQ/GPTQ int4, act-order included, groups of 64-256 elements or one a
row): `mma_linear`. On an H200 it beats the tl.dot GEMM (`_gemm`) at every row count it is sent
(docs/benchmarks.md#gpu-kernels-by-rows-of-x).

Why a kernel of its own: dequantizing a weight tile to bf16 and handing it to `tl.dot` the usual
way (`_gemm` in triton_gemm.py) sends every dequantized weight through shared memory to reach
the tensor cores' operand layout, about 4 bytes of shared-memory traffic a weight, more than an
SM moves while HBM delivers one int4 weight. Here:

- **swap AB**: y^T (BN, MP) = W (BN, K) x^T (K, MP). Weight rows fill the MMA's long side (64 rows
  a warpgroup: wgmma, whose A operand may come from registers), the few rows of x its short side
  (MP = 8, 16, 32 or 64). Only the packed codes (0.5 byte a weight) and x pass through shared memory.
- **codes to bf16 without a conversion**: a nibble written under bf16 128.0's bits (0x4300 | c) is
  128 + c. One 32-bit register holds two 16-bit code words (four nibbles each) of one row, so one
  `lop3` (and a shift) makes two bf16 operands: sub-dot i takes nibble i of every code word.
- **x in the sub-dots' order**: `_prep_x` writes x permuted within each 64 elements so that sub-dot
  i's operand is contiguous (x_p[64c + 16i + j] = x[64c + 4j + i]), through the act-order
  permutation if any, and each scale group's sum xs. Then
      y[m, n] = sum_g s[n, g] * (sum_{k in g} (128 + c[n, k]) x[m, k] - (128 + z[n, g]) xs[m, g]),
  the offset and zero point folded into one product per group, after the group's MMAs.
- **split-K** (`SPLIT`) where N is short: programs along K leave partial sums in a workspace; the
  last to arrive at a row tile (an atomic count) adds them up and zeroes the count.

`mma_linear_scaled` (`_mma_s`) is the variant for formats whose scales change every 32 elements
(Q4_0, Q4_K, int4 in groups of 32), where a 16-element MMA step spans two blocks: the weights are
made in bf16 before the MMA (one fma.rn.bf16x2 a pair, the block's scale and offset broadcast in
registers). The dispatcher sends it 5-64 rows (int8 x keeps up to 4), where it beats `_gemm` on an
H200 (docs/benchmarks.md#gpu-kernels-by-rows-of-x).

Computes packed.linear_ref with bf16 products and float32 sums (the tensor cores); x float32 is
rounded to bf16 first. Runs under TRITON_INTERPRET=1 (float32 dots, no inline PTX) for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from dsq.kernels.packed import NIB, Z_ARRAY, Z_CONST, Packed
from dsq.kernels.triton_common import (INTERPRET, INTERPRET_K, autotune, even_kn, group_params, grouped_tile,
                                       plane_args)

MAX_ROWS = 64  # the most rows the kernels take (the dispatcher sends up to dispatch.MMA_MAX_ROWS)
CHUNK = 64  # x's permutation period: four sub-dots of 16 code words (K 16 each: one MMA step)


def supported(p: Packed, rows: int) -> bool:
    """4-bit codes without high bits, plain scales (no K-quant mins or super-scales), groups of 64,
    128 or 256 elements dividing K, or one a row; K a multiple of 64; 1..MAX_ROWS rows."""
    f = p.fmt
    group_ok = f.sub >= p.K or (f.sub in (64, 128, 256) and p.K % f.sub == 0)
    return (1 <= rows <= MAX_ROWS and f.codes == NIB and f.hi_bits == 0 and not f.two_level and not f.mins
            and f.sc_rows == 1 and p.K % CHUNK == 0 and group_ok)


@triton.jit
def _bf16(v):
    """v rounded to bf16 to nearest even, as torch does (the interpreter's own conversion truncates)."""
    if INTERPRET_K and v.dtype == tl.float32:
        b = v.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return b.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return v.to(tl.bfloat16)


@triton.jit
def _prep_x(x_ptr, perm_ptr, xp_ptr, xs_ptr, K, s_x, GS, HAS_PERM: tl.constexpr, SUMS: tl.constexpr = True):
    """Row program_id(1) of x (stride s_x), group program_id(0) (GS elements): x_p (bf16, row
    stride K) permuted within each 64 (x_p[64c + 16i + j] = x[64c + 4j + i]), read through perm
    (act-order), and the group's sum of the rounded values into xs (float32, K / GS a row)."""
    row = tl.program_id(1)
    g = tl.program_id(0)
    o = tl.arange(0, 64)
    src = 4 * (o % 16) + o // 16
    x_ptr += row * s_x
    xp_ptr += row * K
    tot = tl.zeros((64,), dtype=tl.float32)
    for c0 in range(g * GS, g * GS + GS, 64):
        e = c0 + src
        if HAS_PERM:
            e = tl.load(perm_ptr + e)
        v = _bf16(tl.load(x_ptr + e))
        tl.store(xp_ptr + c0 + o, v)
        tot += v.to(tl.float32)
    if SUMS:  # the scaled variant (_mma_s) reads none
        tl.store(xs_ptr + row * (K // GS) + g, tl.sum(tot, axis=0))


@triton.jit
def _nib_bf16(h, NIB_I: tl.constexpr, USE_ASM: tl.constexpr):
    """Nibble NIB_I of each 16-bit code word h as bf16 128 + c: in PTX two words a register, one
    lop3 (c & 15 | 0x4300 on both halves) after a shift."""
    if USE_ASM:
        if NIB_I == 0:
            return tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xea;", "=r,r", [h],
                                             dtype=tl.bfloat16, is_pure=True, pack=2)
        elif NIB_I == 1:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t; shr.b32 t, $1, 4; lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xea; }", "=r,r", [h],
                dtype=tl.bfloat16, is_pure=True, pack=2)
        elif NIB_I == 2:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t; shr.b32 t, $1, 8; lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xea; }", "=r,r", [h],
                dtype=tl.bfloat16, is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t; shr.b32 t, $1, 12; lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xea; }", "=r,r", [h],
                dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        return (((h >> (4 * NIB_I)) & 15) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _code_tile(lo_ptr, rn, nm, mm, jh, jx, kg, K, s_lo, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """The code words (BN, T/4) of rows rn from element kg on, and the mask of x's operand rows
    (x_p offsets jx) and columns (rows of x): elements past K are masked (K is a multiple of 64:
    whole sub-dot rows)."""
    wm = nm[:, None]
    xm = mm[None, :]
    if not EVEN_K:
        wm = wm & (kg + 4 * jh[None, :] < K)
        xm = xm & (kg + jx[:, None] < K)
    if EVEN_N and EVEN_K:
        h = tl.load(lo_ptr + rn[:, None] * s_lo + kg // 4 + jh[None, :])
    else:
        h = tl.load(lo_ptr + rn[:, None] * s_lo + kg // 4 + jh[None, :], mask=wm, other=0)
    return h, xm


@triton.jit
def _tile_dot(lo_ptr, xp_ptr, rn, rm, nm, mm, jh, jx, kg, K, s_lo, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
              USE_ASM: tl.constexpr):
    """The (BN, MP) products of one tile: its code words (BN, T/4) from elements kg on, four
    independent sub-dots (none waits for another's result), summed."""
    h, xm = _code_tile(lo_ptr, rn, nm, mm, jh, jx, kg, K, s_lo, EVEN_N, EVEN_K)
    xq = xp_ptr + rm[None, :] * K + kg + jx[:, None]
    return ((_sub_dot(h, xq, xm, 0, USE_ASM) + _sub_dot(h, xq, xm, 1, USE_ASM))
            + (_sub_dot(h, xq, xm, 2, USE_ASM) + _sub_dot(h, xq, xm, 3, USE_ASM)))


@triton.jit
def _sub_dot(h, xq, xm, NIB_I: tl.constexpr, USE_ASM: tl.constexpr):
    """Nibble NIB_I of the code words h (BN, T/4) against x's rows for it (pointers xq + 16 NIB_I)."""
    a = _nib_bf16(h, NIB_I, USE_ASM)
    xt = tl.load(xq + NIB_I * 16, mask=xm, other=0)
    if USE_ASM:
        return tl.dot(a, xt)
    return tl.dot(a.to(tl.float32), xt.to(tl.float32), input_precision="ieee")  # the interpreter's bf16 dot is inexact


@triton.jit
def _fence(t, USE_ASM: tl.constexpr):
    """A GPU-scope acquire/release fence by every thread (t: any tensor, one fence per element
    held), ordering this program's partial sums around the split counter. The interpreter runs
    programs one after another: nothing to order."""
    if USE_ASM:
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r,r", [t.to(tl.int32, bitcast=True)],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _mma_t(xp_ptr, xs_ptr, y_ptr, bias_ptr, lo_ptr, sc_ptr, zp_ptr, ws_ptr, cnt_ptr, M, N, K, s_ym, s_lo, s_sc,
           s_zp, ZERO: tl.constexpr, OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr,
           GS: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
           SPLIT: tl.constexpr = 1, NG: tl.constexpr = 1, EVEN_N: tl.constexpr = False,
           EVEN_K: tl.constexpr = False):
    """y (M, N) for BN weight rows a program, over K / SPLIT of the inputs (program_id(1)), NG (1 or
    2) tiles an iteration, each a scale group of GS elements (GS 0: one group a row, applied at the
    end; tiles of BK). Split ranges are whole iterations.
    lo_ptr: the codes as 16-bit words (row stride s_lo words); xp_ptr/xs_ptr: _prep_x's (xs: K / GS
    sums a row, or one). SPLIT > 1: each program leaves its partial sums in ws (SPLIT, MP, N) and
    counts itself in cnt[row tile]; the last to arrive adds them up, writes y and zeroes the count."""
    ONE: tl.constexpr = GS == 0
    T: tl.constexpr = BK if ONE else GS  # elements between scale applications
    pid_n = tl.program_id(0)
    rn = pid_n * BN + tl.arange(0, BN)
    nm = rn < N
    rm = tl.arange(0, MP)
    mm = rm < M
    jh = tl.arange(0, T // 4)  # the tile's code words
    jx = (jh // 16) * 64 + jh % 16  # where sub-dot 0's operand row of each word lies in x_p
    G = 1 if ONE else K // GS
    k_lo = 0
    k_hi = K
    if SPLIT > 1:
        per = tl.cdiv(tl.cdiv(K, T * NG), SPLIT) * T * NG
        k_lo = tl.program_id(1) * per
        k_hi = tl.minimum(k_lo + per, K)
    acc = tl.zeros((BN, MP), dtype=tl.float32)
    if not ONE:  # the first groups' parameters; each iteration loads the next ones' (latency hidden)
        s_n, z_n, xs_n = _group(sc_ptr, zp_ptr, xs_ptr, rn, rm, nm, mm, k_lo // GS, G, s_sc, s_zp, ZERO, OFFSET)
        s_m, z_m, xs_m = s_n, z_n, xs_n
        if NG == 2:
            s_m, z_m, xs_m = _group(sc_ptr, zp_ptr, xs_ptr, rn, rm, nm, mm, k_lo // GS + 1, G, s_sc, s_zp, ZERO,
                                    OFFSET)
    for kg in tl.range(k_lo, k_hi, T * NG, num_stages=STAGES):
        d = _tile_dot(lo_ptr, xp_ptr, rn, rm, nm, mm, jh, jx, kg, K, s_lo, EVEN_N, EVEN_K, USE_ASM)
        if NG == 2:
            d2 = _tile_dot(lo_ptr, xp_ptr, rn, rm, nm, mm, jh, jx, kg + T, K, s_lo, EVEN_N, EVEN_K, USE_ASM)
        if ONE:
            acc += d
            if NG == 2:
                acc += d2
        else:
            s, z, xs = s_n, z_n, xs_n
            s_n, z_n, xs_n = _group(sc_ptr, zp_ptr, xs_ptr, rn, rm, nm, mm, kg // GS + NG, G, s_sc, s_zp, ZERO,
                                    OFFSET)
            acc += s[:, None] * (d - z[:, None] * xs[None, :])
            if NG == 2:
                s, z, xs = s_m, z_m, xs_m
                s_m, z_m, xs_m = _group(sc_ptr, zp_ptr, xs_ptr, rn, rm, nm, mm, kg // GS + 3, G, s_sc, s_zp, ZERO,
                                        OFFSET)
                acc += s[:, None] * (d2 - z[:, None] * xs[None, :])
    if SPLIT == 1:
        _mma_store(acc, y_ptr, bias_ptr, xs_ptr, sc_ptr, zp_ptr, rn, rm, nm, mm, s_ym, s_sc, s_zp, ZERO, OFFSET,
                   HAS_BIAS, ONE)
    else:
        last, tot = _split_sum(acc, ws_ptr, cnt_ptr, pid_n, rn, rm, nm, N, MP, SPLIT, USE_ASM)
        if last:
            _mma_store(tot, y_ptr, bias_ptr, xs_ptr, sc_ptr, zp_ptr, rn, rm, nm, mm, s_ym, s_sc, s_zp, ZERO, OFFSET,
                       HAS_BIAS, ONE)


@triton.jit
def _split_sum(acc, ws_ptr, cnt_ptr, pid_n, rn, rm, nm, N, MP: tl.constexpr, SPLIT: tl.constexpr,
               USE_ASM: tl.constexpr):
    """Split-K: leaves this program's partial sums acc in ws (SPLIT, MP, N) and counts it at its
    row tile. Returns whether it arrived last, and then the sum of all SPLIT partials (its count
    zeroed for the next call)."""
    ws = ws_ptr + rm[None, :] * N + rn[:, None]
    tl.store(ws + tl.program_id(1) * MP * N, acc, mask=nm[:, None])
    _fence(acc, USE_ASM)
    last = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
    tot = tl.zeros_like(acc)
    if last:
        _fence(acc, USE_ASM)
        for k in tl.static_range(SPLIT):
            tot += tl.load(ws + k * MP * N, mask=nm[:, None], other=0, cache_modifier=".cg")
        tl.store(cnt_ptr + pid_n, 0)
    return last, tot


@triton.jit
def _mma_store(acc, y_ptr, bias_ptr, xs_ptr, sc_ptr, zp_ptr, rn, rm, nm, mm, s_ym, s_sc, s_zp, ZERO: tl.constexpr,
               OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr, ONE: tl.constexpr):
    """y^T tile = acc (ONE: the row's single scale and zero point applied here) + bias."""
    if ONE:
        xs = tl.load(xs_ptr + rm, mask=mm, other=0)
        s, z = _scale_zero(sc_ptr, zp_ptr, rn, 0, nm, s_sc, s_zp, ZERO, OFFSET)
        acc = s[:, None] * (acc - z[:, None] * xs[None, :])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=nm, other=0).to(tl.float32)[:, None]
    tl.store(y_ptr + rm[None, :] * s_ym + rn[:, None], acc.to(y_ptr.dtype.element_ty), mask=mm[None, :] & nm[:, None])


@triton.jit
def _group(sc_ptr, zp_ptr, xs_ptr, rn, rm, nm, mm, gi, G, s_sc, s_zp, ZERO: tl.constexpr, OFFSET: tl.constexpr):
    """Group gi's scale and zero point (+128) per row rn and x sums per row rm; zeros past G."""
    s, z = _scale_zero(sc_ptr, zp_ptr, rn, gi, nm & (rn * 0 + gi < G), s_sc, s_zp, ZERO, OFFSET)
    xs = tl.load(xs_ptr + rm * G + gi, mask=mm & (rm * 0 + gi < G), other=0)  # tensor masks (the interpreter)
    return s, z, xs


@triton.jit
def _scale_zero(sc_ptr, zp_ptr, rn, gi, gm, s_sc, s_zp, ZERO: tl.constexpr, OFFSET: tl.constexpr):
    """Group gi's scale s and zero point plus the codes' 128 offset z, rows rn (mask gm)."""
    s = tl.load(sc_ptr + rn * s_sc + gi, mask=gm, other=0).to(tl.float32)
    if ZERO == 2:
        z = tl.load(zp_ptr + rn * s_zp + gi, mask=gm, other=0).to(tl.float32) + 128.0
    elif ZERO == 1:
        z = tl.full(s.shape, 128.0 + OFFSET, tl.float32)
    else:
        z = tl.full(s.shape, 128.0, tl.float32)
    return s, z


def supported_scaled(p: Packed, rows: int) -> bool:
    """`mma_linear_scaled`: 4-bit codes without high bits (int4 any group of 32k elements, Q4_0,
    Q4_K), row scales (no 128-row blocks), K a multiple of 64, 1..MAX_ROWS rows."""
    f = p.fmt
    return (1 <= rows <= MAX_ROWS and f.codes == NIB and f.hi_bits == 0 and f.sc_rows == 1 and p.K % CHUNK == 0
            and (f.sub >= p.K or f.sub % 32 == 0))


@triton.jit
def _nib_scaled(h, SW, OW, NIB_I: tl.constexpr, USE_ASM: tl.constexpr):
    """Nibble NIB_I of each 16-bit code word h as the dequantized weight SW c + OW in bf16 (SW, OW
    bf16 per element): c exact in bf16 (128 + c from a lop3 after a shift, minus 128), then one
    fma.rn.bf16x2 a pair. (Writing c as 1 + c/16 saves the subtraction but makes OW = o - 16 s,
    whose rounding cost 2.4-6x the error: tests/test_mma_triton.py, encoding.)"""
    if USE_ASM:
        if NIB_I == 0:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t, k; mov.b32 k, 0x43004300; lop3.b32 t, $1, 0x000F000F, k, 0xea; "
                "sub.rn.bf16x2 t, t, k; fma.rn.bf16x2 $0, t, $2, $3; }",
                "=r,r,r,r", [h, SW, OW], dtype=tl.bfloat16, is_pure=True, pack=2)
        elif NIB_I == 1:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t, k; mov.b32 k, 0x43004300; shr.b32 t, $1, 4; lop3.b32 t, t, 0x000F000F, k, 0xea; "
                "sub.rn.bf16x2 t, t, k; fma.rn.bf16x2 $0, t, $2, $3; }",
                "=r,r,r,r", [h, SW, OW], dtype=tl.bfloat16, is_pure=True, pack=2)
        elif NIB_I == 2:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t, k; mov.b32 k, 0x43004300; shr.b32 t, $1, 8; lop3.b32 t, t, 0x000F000F, k, 0xea; "
                "sub.rn.bf16x2 t, t, k; fma.rn.bf16x2 $0, t, $2, $3; }",
                "=r,r,r,r", [h, SW, OW], dtype=tl.bfloat16, is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t, k; mov.b32 k, 0x43004300; shr.b32 t, $1, 12; lop3.b32 t, t, 0x000F000F, k, 0xea; "
                "sub.rn.bf16x2 t, t, k; fma.rn.bf16x2 $0, t, $2, $3; }",
                "=r,r,r,r", [h, SW, OW], dtype=tl.bfloat16, is_pure=True, pack=2)
    c = ((h >> (4 * NIB_I)) & 15).to(tl.float32)  # one rounding, as the fma's
    return _bf16(SW.to(tl.float32) * c + OW.to(tl.float32))


@triton.jit
def _mma_s(xp_ptr, y_ptr, bias_ptr, lo_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, ws_ptr, cnt_ptr, M, N, K, s_ym,
           s_lo, s_sc, s_d, s_zp, s_mn, s_dmin, SUB: tl.constexpr, TWO_LEVEL: tl.constexpr, ZERO: tl.constexpr,
           OFFSET: tl.constexpr, MINS: tl.constexpr, HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr,
           MP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, SPLIT: tl.constexpr = 1,
           EVEN_N: tl.constexpr = False, EVEN_K: tl.constexpr = False, tile_ptr=None, GROUPED: tl.constexpr = False):
    """_mma_t with the scales applied to the codes before the MMA: each 32-element block's weights
    W = s (c - z) - m are made in bf16 (one fma a pair of weights), so a tile (BK elements, any
    number of scale groups, K-quants' two-level scales and mins included) needs no per-group
    epilogue and no x sums. Weights rounded to bf16 (as _gemm's), products exact, sums float32.
    GROUPED (SPLIT 1): the weight stacks experts of N rows each, and program_id(1) is a row tile of
    tile_ptr's (expert, first row of x and y, rows): that expert's rows against those rows of x."""
    NB: tl.constexpr = BK // 32  # 32-element blocks a tile
    pid_n = tl.program_id(0)
    rn = pid_n * BN + tl.arange(0, BN)
    nm = rn < N
    if GROUPED:
        ex, r0, M = grouped_tile(tile_ptr, tl.program_id(1))
        xp_ptr += r0 * K
        y_ptr += r0 * s_ym
        rw = ex * N + rn  # the expert's weight rows
    else:
        rw = rn
    rm = tl.arange(0, MP)
    mm = rm < M
    jh = tl.arange(0, BK // 4)
    jx = (jh // 16) * 64 + jh % 16
    jb = tl.arange(0, NB)
    k_lo = 0
    k_hi = K
    if SPLIT > 1:
        per = tl.cdiv(tl.cdiv(K, BK), SPLIT) * BK
        k_lo = tl.program_id(1) * per
        k_hi = tl.minimum(k_lo + per, K)
    if GROUPED:
        k_hi = K * tl.minimum(M, 1)  # a tile past the last (a table made on the device) reads nothing
    acc = tl.zeros((BN, MP), dtype=tl.float32)
    for kg in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
        h, xm = _code_tile(lo_ptr, rw, nm, mm, jh, jx, kg, K, s_lo, EVEN_N, EVEN_K)
        e2 = kg + 32 * jb[None, :]  # each block's first element
        s, z, m = group_params(sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, rw[:, None], e2, nm[:, None] & (e2 < K),
                               s_sc, s_d, s_zp, s_mn, s_dmin, SUB, 1, TWO_LEVEL, ZERO, OFFSET, MINS)
        # W = s c - (s z + m) per block, SW and OW broadcast to its 8 code words (in registers)
        sb = _bf16(s)
        ob = _bf16(-(s * z + m))
        SW = tl.reshape(tl.broadcast_to(sb[:, :, None], (BN, NB, 8)), (BN, BK // 4))
        OW = tl.reshape(tl.broadcast_to(ob[:, :, None], (BN, NB, 8)), (BN, BK // 4))
        xq = xp_ptr + rm[None, :] * K + kg + jx[:, None]
        for i in tl.static_range(4):
            a = _nib_scaled(h, SW, OW, i, USE_ASM)
            xt = tl.load(xq + 16 * i, mask=xm, other=0)
            if USE_ASM:
                acc = tl.dot(a, xt, acc)
            else:  # the interpreter's bf16 dot is not exact: float32
                acc = tl.dot(a.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
    if SPLIT == 1:
        _mma_store(acc, y_ptr, bias_ptr, y_ptr, y_ptr, y_ptr, rn, rm, nm, mm, s_ym, 0, 0, 0, 0, HAS_BIAS, False)
    else:
        last, tot = _split_sum(acc, ws_ptr, cnt_ptr, pid_n, rn, rm, nm, N, MP, SPLIT, USE_ASM)
        if last:
            _mma_store(tot, y_ptr, bias_ptr, y_ptr, y_ptr, y_ptr, rn, rm, nm, mm, s_ym, 0, 0, 0, 0, HAS_BIAS, False)


# The winners of an H200 sweep (benchmarks.mma_sweep; docs/benchmarks.md#gpu-kernels-by-rows-of-x) on the
# four decode shapes at 4, 8 and 16 rows: BN 64/128 with 4 warps use wgmma (a warpgroup, the codes from registers), with 2 warps
# mma.sync. SPLIT: programs along K, for short N and long K (4096 x 14336, 4096 x 4096); NG 2: two
# scale groups an iteration. BK: the tile when a row is one scale group (GS 0); else a tile is a group.
_CONFIGS = [triton.Config({"BN": bn, "BK": 128, "STAGES": st, "SPLIT": sp, "NG": ng}, num_warps=w)
            for bn, w, st, sp, ng in [(128, 4, 4, 1, 1), (64, 4, 3, 1, 1), (64, 4, 3, 1, 2), (64, 2, 3, 1, 2),
                                      (128, 2, 3, 1, 2), (64, 4, 3, 4, 1), (64, 4, 3, 4, 2), (128, 4, 3, 4, 2),
                                      (64, 4, 3, 2, 2)]]
MAX_SPLIT = 4


def _step(a) -> int:
    """Elements of K an iteration: NG tiles of a scale group (or of BK)."""
    return (a["GS"] or a["BK"]) * a.get("NG", 1)


_even = triton.heuristics({"EVEN_K": lambda a: a["K"] % _step(a) == 0, "EVEN_N": lambda a: a["N"] % a["BN"] == 0})


_mma_t_tuned = autotune(_CONFIGS, ["N", "K", "MP", "GS", "ZERO"])(_even(_mma_t))
_scratch: dict = {}


def _split_scratch(device: torch.device, N: int, mp: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial sums (MAX_SPLIT, mp, N) float32 and per-row-tile counts (zero between calls: the
    last program of a tile zeroes its count), kept per device and grown when N grows. Inside a
    CUDA graph capture a too-small one is not grown but made for the graph (zeroed in it). One
    set a device: split calls must not run concurrently on two streams (dsq runs one)."""
    ws_n, cnt_n = MAX_SPLIT * mp * N, triton.cdiv(N, 16)
    have = _scratch.get(device)
    if have is not None and have[0].numel() >= ws_n and have[1].numel() >= cnt_n:
        return have
    ws = torch.empty(ws_n, dtype=torch.float32, device=device)
    cnt = torch.zeros(cnt_n, dtype=torch.int32, device=device)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _scratch[device] = (ws, cnt)
    return ws, cnt


def _prepare(x: torch.Tensor, p: Packed, group: int, ok, what: str, sums: bool = True):
    """x as rows (M, K) through _prep_x (permuted bf16 x_p; with `sums` its sums per `group`
    elements, else None) and the width of its MMA side; ValueError(what) if not ok(p, M)."""
    x1 = x.reshape(-1, p.K)
    if x1.stride(-1) != 1:
        x1 = x1.contiguous()
    M = x1.shape[0]
    if not ok(p, M):
        raise ValueError(what)
    xp = torch.empty(M, p.K, dtype=torch.bfloat16, device=x.device)
    xs = torch.empty(M, p.K // group, dtype=torch.float32, device=x.device) if sums else None
    _prep_x[(p.K // group, M)](x1, p.perm if p.perm is not None else x1, xp, xs if sums else xp, p.K, x1.stride(0),
                               group, HAS_PERM=p.perm is not None, SUMS=sums)
    return M, xp, xs, max(8, 1 << (M - 1).bit_length())  # MP: 8, 16, 32 or 64


def _launch(kernel, tuned, p: Packed, args: tuple, flags: dict, config: dict | None, defaults: dict, step) -> None:
    """The autotuned kernel, or with `config` (or under the interpreter) the plain one on fixed tiles;
    programs (row tiles, SPLIT); step(cfg): elements of K an iteration (EVEN_K)."""
    if config is None and not INTERPRET:
        tuned[lambda meta: (triton.cdiv(p.N, meta["BN"]), meta["SPLIT"])](*args, **flags)
        return
    cfg = {"BN": 16, "STAGES": 1, "SPLIT": 1, **defaults, **(config or {})}
    if not 1 <= cfg["SPLIT"] <= MAX_SPLIT:
        raise ValueError(f"SPLIT is 1 to {MAX_SPLIT}")
    cfg.setdefault("EVEN_K", p.K % step(cfg) == 0)
    cfg.setdefault("EVEN_N", p.N % cfg["BN"] == 0)
    kernel[(triton.cdiv(p.N, cfg["BN"]), cfg["SPLIT"])](*args, **flags, **cfg)


def mma_linear(x: torch.Tensor, p: Packed, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
               config: dict | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for 1 to 64 rows of x (formats: `supported`), y in x's dtype. `config`
    (BN, BK, STAGES[, SPLIT, NG, num_warps]) fixes the tiles (no autotuning)."""
    f = p.fmt
    GS = f.sub if f.sub < p.K else 0  # 0: one group a row
    M, xp, xs, MP = _prepare(x, p, GS or p.K, supported,
                             "mma_linear takes 1-64 rows and 4-bit codes in groups of 64, 128 or 256 (K % 64 == 0)")
    y = out if out is not None else torch.empty(M, p.N, dtype=x.dtype, device=x.device)
    lo = p.lo.view(torch.int16)
    zp = p.zp if p.zp is not None else p.sc
    ws, cnt = _split_scratch(x.device, p.N, MP)
    args = (xp, xs, y, bias if bias is not None else y, lo, p.sc, zp, ws, cnt, M, p.N, p.K, y.stride(0), lo.stride(0),
            p.sc.stride(0), zp.stride(0))
    flags = {"ZERO": f.zero if f.zero in (Z_CONST, Z_ARRAY) else 0, "OFFSET": f.offset, "HAS_BIAS": bias is not None,
             "USE_ASM": not INTERPRET, "GS": GS, "MP": MP}
    _launch(_mma_t, _mma_t_tuned, p, args, flags, config, {"BK": GS or 128, "NG": 1}, lambda c: _step({**flags, **c}))
    return y.reshape(*x.shape[:-1], p.N)


_SCALED_CONFIGS = [triton.Config({"BN": bn, "BK": bk, "STAGES": st, "SPLIT": sp}, num_warps=4)
                   for bn, bk, st, sp in [(128, 128, 4, 1), (64, 128, 3, 1), (128, 256, 3, 1), (64, 256, 3, 1),
                                          (64, 128, 3, 4), (64, 256, 3, 4), (128, 128, 3, 4)]]
_mma_s_tuned = autotune(_SCALED_CONFIGS, ["N", "K", "MP", "SUB", "TWO_LEVEL", "ZERO", "MINS"])(even_kn(_mma_s))


def mma_linear_scaled(x: torch.Tensor, p: Packed, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                      config: dict | None = None) -> torch.Tensor:
    """`mma_linear` for more formats (Q4_0, Q4_K, int4 with groups of 32): the weights are made in
    bf16 per 32-element block before the MMA (`_mma_s`). The dispatcher sends it the rows int8 x
    does not take (Q8_MAX_ROWS < rows <= MMA_MAX_ROWS); y in x's dtype."""
    f = p.fmt
    M, xp, _, MP = _prepare(x, p, CHUNK, supported_scaled,
                            "mma_linear_scaled takes 1-64 rows and 4-bit codes without high bits (K % 64 == 0)",
                            sums=False)
    y = out if out is not None else torch.empty(M, p.N, dtype=x.dtype, device=x.device)
    planes, strides = plane_args(p, hi=False)
    planes[0], strides[0] = p.lo.view(torch.int16), p.lo.view(torch.int16).stride(0)
    ws, cnt = _split_scratch(x.device, p.N, MP)
    args = (xp, y, bias if bias is not None else y, *planes, ws, cnt, M, p.N, p.K, y.stride(0), *strides)
    flags = {"SUB": f.sub, "TWO_LEVEL": f.two_level, "ZERO": f.zero, "OFFSET": f.offset, "MINS": f.mins,
             "HAS_BIAS": bias is not None, "USE_ASM": not INTERPRET, "MP": MP}
    _launch(_mma_s, _mma_s_tuned, p, args, flags, config, {"BK": 128}, lambda c: c["BK"])
    return y.reshape(*x.shape[:-1], p.N)


# _SCALED_CONFIGS without split-K (program_id(1) is the row tile), plus 2 stages (~42 KB of shared memory against
# 91-133 KB: room for two programs an SM, by benchmarks.sass_count for sm_90), the H100's pick for V2-Lite's
# gate/up at 64 rows a tile. Each config is a compile in a cold serve warm-up, so the list stays short;
# benchmarks.moe_prefill times the path and prints the picks
# (docs/benchmarks.md#part-3-again-serve-ahead-of-llama-server-h100-machine-2026-12-07-night)
_GROUPED_CONFIGS = [triton.Config({"BN": bn, "BK": bk, "STAGES": st}, num_warps=4)
                    for bn, bk, st in [(128, 128, 4), (64, 128, 3), (128, 256, 3), (64, 256, 3), (128, 128, 2)]]
_mma_s_grouped = autotune(_GROUPED_CONFIGS, ["N", "K", "MP", "SUB", "TWO_LEVEL", "ZERO", "MINS"])(even_kn(_mma_s))


def grouped_tiles(counts: list[int], mp: int) -> list[tuple[int, int, int]]:
    """(expert, first row, rows) of each row tile of at most mp rows over rows grouped by expert in
    order (counts[e] rows of expert e); no tile for an expert without rows."""
    tiles, r = [], 0
    for e, c in enumerate(counts):
        tiles += [(e, r + i, min(mp, c - i)) for i in range(0, c, mp)]
        r += c
    return tiles


def grouped_tile_table(counts, mp: int, rows: int, device) -> tuple[torch.Tensor, int]:
    """The row tiles (grouped_tiles) as an int32 (n, 3) table on `device`, and n. From counts on the
    host: exactly the tiles. From counts in a tensor on the device: made there without a host sync
    (so a prompt chunk's MoE layer can be captured in a CUDA graph), n = rows // mp + experts (no
    expert has more than one partial tile), the tiles past the last with 0 rows (their programs read
    nothing)."""
    if not isinstance(counts, torch.Tensor):
        tiles = grouped_tiles(counts, mp)
        return torch.tensor(tiles, dtype=torch.int32).reshape(-1, 3).to(device, non_blocking=True), len(tiles)
    c = counts.to(device=device, dtype=torch.int64)
    E = c.numel()
    n = rows // mp + E
    per = (c + mp - 1) // mp  # tiles an expert
    cum = per.cumsum(0)
    t = torch.arange(n, device=device)
    e = torch.searchsorted(cum, t, right=True)  # tile t's expert (E: past the last tile)
    ec = e.clamp(max=E - 1)
    i = (t - (cum[ec] - per[ec])) * mp  # the tile's first row inside its expert's rows
    m = torch.where(e < E, (c[ec] - i).clamp(0, mp), 0)
    r = torch.where(m > 0, c.cumsum(0)[ec] - c[ec] + i, 0)
    return torch.stack([ec, r, m], 1).to(torch.int32), n


def tile_rows(counts, rows: int, n_expert: int) -> int:
    """Rows of x a grouped tile takes (16, 32 or 64): the fullest expert's, from counts on the host;
    from counts on the device (not read), the mean expert's."""
    big = max(counts, default=0) if not isinstance(counts, torch.Tensor) else -(-rows // n_expert)
    return max(16, min(MAX_ROWS, 1 << (max(big, 1) - 1).bit_length()))


def grouped_mma_scaled(x: torch.Tensor, p: Packed, counts, n_expert: int,
                       config: dict | None = None) -> torch.Tensor:
    """y (P, N) = each row of x (P, K) through its expert's weight, the rows grouped by expert in
    order (counts[e] rows of expert e: a list, or an int tensor on x's device, read there without a
    host sync); `p` stacks n_expert weights of N = p.N / n_expert rows in a format
    `supported_scaled` takes. One launch for every expert and row tile, each reading its expert's
    codes straight into the tensor cores (no weight written out): each chosen expert's weight is read
    once per tile of up to MAX_ROWS of its rows. Weights and x rounded to bf16, sums float32 (as
    `mma_linear_scaled`); y in x's dtype."""
    f = p.fmt
    N, K = p.N // n_expert, p.K
    if (p.N % n_expert or len(counts) != n_expert or not supported_scaled(p, 1) or p.perm is not None
            or (not isinstance(counts, torch.Tensor) and sum(counts) != x.shape[0])):
        raise ValueError("grouped_mma_scaled takes a stack of n_expert 4-bit weights (K % 64 == 0) and counts per expert")
    P = x.shape[0]
    y = torch.empty(P, N, dtype=x.dtype, device=x.device)
    mp = tile_rows(counts, P, n_expert)
    tile, n = grouped_tile_table(counts, mp, P, x.device)
    if not n or not P:
        return y
    x1 = x if x.stride(-1) == 1 else x.contiguous()
    xp = torch.empty(P, K, dtype=torch.bfloat16, device=x.device)
    _prep_x[(K // CHUNK, P)](x1, x1, xp, xp, K, x1.stride(0), CHUNK, HAS_PERM=False, SUMS=False)
    planes, strides = plane_args(p, hi=False)
    planes[0], strides[0] = p.lo.view(torch.int16), p.lo.view(torch.int16).stride(0)
    args = (xp, y, y, *planes, y, y, 0, N, K, y.stride(0), *strides)
    flags = {"SUB": f.sub, "TWO_LEVEL": f.two_level, "ZERO": f.zero, "OFFSET": f.offset, "MINS": f.mins,
             "HAS_BIAS": False, "USE_ASM": not INTERPRET, "MP": mp, "SPLIT": 1, "tile_ptr": tile, "GROUPED": True}
    if config is None and not INTERPRET:
        _mma_s_grouped[lambda meta: (triton.cdiv(N, meta["BN"]), n)](*args, **flags)
    else:
        cfg = {"BN": 16, "BK": 128, "STAGES": 1, **(config or {})}
        cfg.setdefault("EVEN_K", K % cfg["BK"] == 0)
        cfg.setdefault("EVEN_N", N % cfg["BN"] == 0)
        _mma_s[(triton.cdiv(N, cfg["BN"]), n)](*args, **flags, **cfg)
    return y
