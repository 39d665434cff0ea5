"""GGUF Q4_K and Q6_K blocks turned into the GPU kernels' layout (kernels/packed.py) by one Triton
launch per chunk of rows, where packed.from_gguf's torch path runs ~25 elementwise ops a chunk: ~760
dispatched ops for one 8B layer, which made a streamed CPU layer's prefill (runtime/streamed.py)
CPU-bound at ~9 ms a layer against its ~2.4 ms copy (docs/benchmarks.md#split-between-gpu-and-cpu).
Each program writes the planes of BLOCKS super-blocks (256 weights) straight from their bytes, with
no intermediate codes; the result is bit for bit packed._from_gguf's (tests/test_kernels_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsq.kernels.packed import Packed, kquant_fmt

TYPES = ("Q4_K", "Q6_K")
# bytes of one super-block of 256 weights
_BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}
# super-blocks a program converts: 64 x 144 bytes read a program, a few thousand programs an 8B
# module; not yet tuned on a GPU (docs/benchmarks.md#split-between-gpu-and-cpu)
BLOCKS = 64


@triton.jit
def _q4k(raw, lo, sc, mn, d, dmin, nb, BLOCKS: tl.constexpr):
    """Q4_K: d (f16), dmin (f16), 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit codes."""
    b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    ok = b < nb
    src = raw + b.to(tl.int64) * 144
    # codes: group g of 64 (32 bytes of qs: the low nibbles, then the high), lo byte p pairs codes 2p, 2p+1
    p = tl.arange(0, 128)
    g, q = p // 32, p % 32
    at = 16 + g * 32 + 2 * (q % 16)
    shift = 4 * (q // 16)
    m2 = ok[:, None]
    c0 = (tl.load(src[:, None] + at[None, :], mask=m2, other=0).to(tl.int32) >> shift[None, :]) & 15
    c1 = (tl.load(src[:, None] + at[None, :] + 1, mask=m2, other=0).to(tl.int32) >> shift[None, :]) & 15
    tl.store(lo + b.to(tl.int64)[:, None] * 128 + p[None, :], (c0 | (c1 << 4)).to(tl.uint8), mask=m2)
    # scales and mins: the first 4 are 6 bits of bytes 0-3 (4-7); the last 4 take 4 bits of bytes 8-11
    # and the top 2 bits of bytes 0-3 (4-7)
    j = tl.arange(0, 4)
    s_lo = tl.load(src[:, None] + 4 + j[None, :], mask=m2, other=0).to(tl.int32)
    m_lo = tl.load(src[:, None] + 8 + j[None, :], mask=m2, other=0).to(tl.int32)
    md = tl.load(src[:, None] + 12 + j[None, :], mask=m2, other=0).to(tl.int32)
    out8 = b.to(tl.int64)[:, None] * 8 + j[None, :]
    tl.store(sc + out8, (s_lo & 0x3F).to(tl.uint8), mask=m2)
    tl.store(sc + out8 + 4, ((md & 0x0F) | ((s_lo >> 2) & 0x30)).to(tl.uint8), mask=m2)
    tl.store(mn + out8, (m_lo & 0x3F).to(tl.uint8), mask=m2)
    tl.store(mn + out8 + 4, ((md >> 4) | ((m_lo >> 2) & 0x30)).to(tl.uint8), mask=m2)
    # the two f16 factors, byte for byte
    two = tl.arange(0, 2)
    out2 = b.to(tl.int64)[:, None] * 2 + two[None, :]
    tl.store(d + out2, tl.load(src[:, None] + two[None, :], mask=m2, other=0), mask=m2)
    tl.store(dmin + out2, tl.load(src[:, None] + 2 + two[None, :], mask=m2, other=0), mask=m2)


@triton.jit
def _q6k_low(src, j, m2):
    """The low 4 bits of codes j (0-255) of Q6_K blocks at src: 128 bytes of nibbles, in two halves
    of 128 codes, each 64 bytes' low nibbles then their high ones."""
    h, s, col = j // 128, (j % 128) // 32, j % 32
    byte = tl.load(src[:, None] + (h * 64 + (s % 2) * 32 + col)[None, :], mask=m2, other=0).to(tl.int32)
    return (byte >> (4 * (s // 2))[None, :]) & 15


@triton.jit
def _q6k_high(src, j, m2):
    """The top 2 bits of codes j of Q6_K blocks at src: 64 bytes from byte 128, four 2-bit fields each."""
    h, s, col = j // 128, (j % 128) // 32, j % 32
    byte = tl.load(src[:, None] + (128 + h * 32 + col)[None, :], mask=m2, other=0).to(tl.int32)
    return (byte >> (2 * s)[None, :]) & 3


@triton.jit
def _q6k(raw, lo, hi, sc, d, nb, BLOCKS: tl.constexpr):
    """Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d (f16)."""
    b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    ok = b < nb
    m2 = ok[:, None]
    src = raw + b.to(tl.int64) * 210
    p = tl.arange(0, 128)
    lo_b = _q6k_low(src, 2 * p, m2) | (_q6k_low(src, 2 * p + 1, m2) << 4)
    tl.store(lo + b.to(tl.int64)[:, None] * 128 + p[None, :], lo_b.to(tl.uint8), mask=m2)
    t = tl.arange(0, 64)
    hi_b = (_q6k_high(src, 4 * t, m2) | (_q6k_high(src, 4 * t + 1, m2) << 2) | (_q6k_high(src, 4 * t + 2, m2) << 4)
            | (_q6k_high(src, 4 * t + 3, m2) << 6))
    tl.store(hi + b.to(tl.int64)[:, None] * 64 + t[None, :], hi_b.to(tl.uint8), mask=m2)
    k = tl.arange(0, 16)
    tl.store(sc + b.to(tl.int64)[:, None] * 16 + k[None, :], tl.load(src[:, None] + 192 + k[None, :], mask=m2,
                                                                      other=0), mask=m2)
    two = tl.arange(0, 2)
    tl.store(d + b.to(tl.int64)[:, None] * 2 + two[None, :], tl.load(src[:, None] + 208 + two[None, :], mask=m2,
                                                                      other=0), mask=m2)


def empty(qtype: str, N: int, K: int, device) -> Packed:
    """An unfilled Packed of packed._from_gguf's layout for N rows of K weights of `qtype`."""
    nb = K // 256
    u8 = {"dtype": torch.uint8, "device": device}
    f16 = {"dtype": torch.float16, "device": device}
    if qtype == "Q4_K":
        return Packed(kquant_fmt(qtype), N, K, lo=torch.empty(N, K // 2, **u8),
                      sc=torch.empty(N, nb * 8, **u8), d=torch.empty(N, nb, **f16), mn=torch.empty(N, nb * 8, **u8),
                      dmin=torch.empty(N, nb, **f16))
    if qtype == "Q6_K":
        return Packed(kquant_fmt(qtype), N, K, lo=torch.empty(N, K // 2, **u8), hi=torch.empty(N, K // 4, **u8),
                      sc=torch.empty(N, nb * 16, dtype=torch.int8, device=device), d=torch.empty(N, nb, **f16))
    raise ValueError(f"no Triton conversion for {qtype}")


def convert_into(raw: torch.Tensor, qtype: str, out: Packed, row0: int) -> None:
    """Rows row0.. of `out` (empty(), on raw's device) from GGUF blocks raw (rows, row bytes), one launch."""
    rows = raw.shape[0]
    nb = rows * (out.K // 256)
    if raw.shape[1] != out.K // 256 * _BLOCK_BYTES[qtype] or not raw.is_contiguous():
        raise ValueError(f"convert_into: {qtype} rows of {out.K} weights need contiguous rows of "
                         f"{out.K // 256 * _BLOCK_BYTES[qtype]} bytes, got {tuple(raw.shape)}")
    u8 = lambda t: t[row0:row0 + rows].view(torch.uint8)  # noqa: E731 - the rows' bytes, whatever the plane's dtype
    grid = (triton.cdiv(nb, BLOCKS),)
    if qtype == "Q4_K":
        _q4k[grid](raw, u8(out.lo), u8(out.sc), u8(out.mn), u8(out.d), u8(out.dmin), nb, BLOCKS=BLOCKS)
    else:
        _q6k[grid](raw, u8(out.lo), u8(out.hi), u8(out.sc), u8(out.d), nb, BLOCKS=BLOCKS)
