"""What the Triton kernels over the packed layout (kernels/packed.py) share: the format flags they
compile for (`fmt_flags`), the plane arguments (`plane_args`), reading one scale group's
parameters (`group_params`) and dequantizing a weight tile (`dequant_tile`: the tl.dot GEMM and the
written-out weight use it), the autotuner's setup and picks, and which weights the kernels take
(`supported`).

The kernel families, one module each: triton_gemv.py (one row of float x), triton_gemv_q8.py (1-16
rows of x rounded to int8), triton_gemm.py (tl.dot GEMM), triton_dequant.py (the weight written
out for cuBLAS), triton_mma.py (tensor cores for a few rows).

Runs under TRITON_INTERPRET=1 on the CPU (the CI tests; inline PTX is replaced by the same
integer ops there); on a GPU the tile shapes are autotuned per (N, K, format) on first use.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from dsq.kernels.packed import NIB, Packed

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
INTERPRET_K = tl.constexpr(INTERPRET)
# the format flags an autotuner keys on (OFFSET follows from them)
FMT_KEYS = ["CODES", "HI_BITS", "SUB", "SC_ROWS", "TWO_LEVEL", "ZERO", "MINS"]


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
def ld(ptr, mask, EVEN: tl.constexpr):
    """tl.load, without a mask (and the zeroing a masked load needs) when EVEN says none is needed."""
    if EVEN:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=mask, other=0)


@triton.jit
def grouped_tile(tile_ptr, t):
    """Row tile t of a grouped launch's table (triton_mma.grouped_tile_table): its expert and first
    row of x and y (int64, for the offsets) and its rows."""
    return (tl.load(tile_ptr + 3 * t).to(tl.int64), tl.load(tile_ptr + 3 * t + 1).to(tl.int64),
            tl.load(tile_ptr + 3 * t + 2))


@triton.jit
def group_params(sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, rn2, e2, gmask, s_sc, s_d, s_zp, s_mn, s_dmin,
                 SUB: tl.constexpr, SC_ROWS: tl.constexpr, TWO_LEVEL: tl.constexpr, ZERO: tl.constexpr,
                 OFFSET: tl.constexpr, MINS: tl.constexpr, EVEN: tl.constexpr = False):
    """Per scale group (rows rn2 (BN,1), first elements e2 (1,GT)): scale s, zero z and min m with
    W = s * (c - z) - m. EVEN: gmask is all true, so the loads go unmasked (ld)."""
    s = ld(sc_ptr + (rn2 // SC_ROWS) * s_sc + e2 // SUB, gmask, EVEN).to(tl.float32)
    if TWO_LEVEL:
        s = s * ld(d_ptr + rn2 * s_d + e2 // 256, gmask, EVEN).to(tl.float32)
    z = tl.zeros_like(s)
    if ZERO == 1:
        z += OFFSET
    if ZERO == 2:
        z = ld(zp_ptr + rn2 * s_zp + e2 // SUB, gmask, EVEN).to(tl.float32)
    m = tl.zeros_like(s)
    if MINS:
        m = (ld(dmin_ptr + rn2 * s_dmin + e2 // 256, gmask, EVEN).to(tl.float32)
             * ld(mn_ptr + rn2 * s_mn + e2 // 32, gmask, EVEN).to(tl.float32))
    return s, z, m


@triton.jit
def dequant_tile(lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, rn, k0, N, K, s_lo, s_hi, s_sc, s_d, s_zp,
                 s_mn, s_dmin, CODES: tl.constexpr, HI_BITS: tl.constexpr, SUB: tl.constexpr, SC_ROWS: tl.constexpr,
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
    s, z, m = group_params(sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, rn2, e2, (rn2 < N) & (e2 < K),
                           s_sc, s_d, s_zp, s_mn, s_dmin, SUB, SC_ROWS, TWO_LEVEL, ZERO, OFFSET, MINS)
    return tl.reshape((v - z[:, :, None, None]) * s[:, :, None, None] - m[:, :, None, None], (BN, BK))


def autotune(configs, key, **kw):
    """triton.autotune, keeping its choices on disk where this Triton can (cache_results)."""
    try:
        return triton.autotune(configs, key=key, cache_results=True, **kw)
    except TypeError:
        return triton.autotune(configs, key=key, **kw)


even_k = triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BK"] == 0})
even_kn = triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BK"] == 0, "EVEN_N": lambda a: a["N"] % a["BN"] == 0})


def autotune_choices() -> dict[str, dict[str, str]]:
    """The autotuner's picks so far, per kernel and key ("N=28672, K=8192, CODES=0, ..."): for
    benchmark records (two machines can pick differently for the same shape)."""
    from dsq.kernels import triton_gemm, triton_gemv, triton_gemv_q8, triton_mma

    out = {}
    for name, tuned in (("gemv_q8", triton_gemv_q8._gemv_q8_tuned), ("gemv_q8 (2-4 rows)", triton_gemv_q8._gemm_q8_tuned),
                        ("gemv", triton_gemv._gemv_tuned), ("gemm", triton_gemm._gemm_tuned),
                        ("mma_t", triton_mma._mma_t_tuned), ("mma_s", triton_mma._mma_s_tuned),
                        ("gemv_q8 experts", triton_gemv_q8._gemv_q8_experts_tuned),
                        ("gemv experts", triton_gemv._gemv_experts_tuned),
                        ("mma_s grouped", triton_mma._mma_s_grouped), ("gemm grouped", triton_gemm._gemm_grouped)):
        picks = {", ".join(f"{n}={v}" for n, v in zip(tuned.keys, key)): str(cfg)
                 for key, cfg in getattr(tuned, "cache", {}).items()}
        if picks:
            out[name] = picks
    return out


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors (persistent grids); 1 off the GPU (the interpreter), so a
    persistent test grid is PERSIST programs, each walking many row tiles."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def tiles_ok(p: Packed) -> bool:
    """Tiles hold whole scale groups or lie inside one: a group is a power of two >= 16, or a row;
    codes are read as 32-bit words."""
    sub = p.fmt.sub
    group_ok = sub >= p.K or (sub >= 16 and sub & (sub - 1) == 0)
    return group_ok and p.K % (8 if p.fmt.codes == NIB else 4) == 0


def supported(p: Packed, x: torch.Tensor) -> bool:
    """Whether the float-x kernels (GEMV, tl.dot GEMM, written-out weight) take this weight and x."""
    return tiles_ok(p) and x.dtype in (torch.float16, torch.bfloat16, torch.float32)


def x_rows(x: torch.Tensor, p: Packed) -> torch.Tensor:
    """x as contiguous rows (M, K) in the weight's stored column order (act-order permuted)."""
    x2 = x.reshape(-1, p.K)
    if p.perm is not None:
        x2 = x2[:, p.perm]
    return x2.contiguous()


def fmt_flags(p: Packed) -> dict:
    """A weight's compile-time flags, as _gemv and _gemm / _dequant (through dequant_tile) take them.
    A group as long as a row (FP8 per tensor or channel, GPTQ without groups) is given as the power of
    two at or above K: every column is in group 0 either way, and the kernels' tile shapes built from
    SUB (tl.arange) must be powers of two on a GPU (the interpreter does not check)."""
    f = p.fmt
    sub = f.sub if f.sub < p.K else triton.next_power_of_2(p.K)
    return {"CODES": f.codes, "HI_BITS": f.hi_bits, "SUB": sub, "SC_ROWS": f.sc_rows, "TWO_LEVEL": f.two_level,
            "ZERO": f.zero, "OFFSET": f.offset, "MINS": f.mins}


def plane_args(p: Packed, hi: bool = True) -> tuple[list[torch.Tensor], list[int]]:
    """The kernels' plane arguments (lo as int32 words, [hi,] sc, d, zp, mn, dmin) and their row
    strides; an absent plane is stood in for by sc (never read: its constexpr flag is off)."""
    none = p.sc
    planes = [p.lo.view(torch.int32)] + ([p.hi.view(torch.int32) if p.hi is not None else none] if hi else [])
    planes += [p.sc] + [t if t is not None else none for t in (p.d, p.zp, p.mn, p.dmin)]
    return planes, [t.stride(0) for t in planes]


def float_args(x: torch.Tensor, p: Packed, bias: torch.Tensor | None, out: torch.Tensor | None) -> tuple:
    """What the float-x kernels (GEMV, tl.dot GEMM) take: x as rows (x_rows), y (`out`, or a new
    (M, N) in x's dtype), the planes and their strides, the format's flags with HAS_BIAS, and the
    bias pointer (y when there is no bias)."""
    x2 = x_rows(x, p)
    y = out if out is not None else torch.empty(x2.shape[0], p.N, dtype=x.dtype, device=x.device)
    planes, strides = plane_args(p)
    flags = {**fmt_flags(p), "HAS_BIAS": bias is not None}
    return x2, y, planes, strides, flags, bias if bias is not None else y
