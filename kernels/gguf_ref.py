"""Plain torch dequantization of GGUF block formats: the reference every GGUF kernel is held to.

Input: the raw bytes of a weight as a uint8 tensor of shape (rows, row_bytes) - one row per
output feature, blocks along the row (GGUF's ne[0] is the row length). Output: float32
(rows, row_length). Layouts follow ggml (see ../shared/docs/formats.md); `gguf.quants` (numpy)
is the test oracle.
"""

from __future__ import annotations

import torch

QK_K = 256
# type name -> (elements per block, bytes per block)
BLOCKS = {"Q4_0": (32, 18), "Q5_0": (32, 22), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176),
          "Q6_K": (256, 210), "F16": (1, 2), "BF16": (1, 2), "F32": (1, 4)}


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) uint8 -> (...,) float32 from little-endian fp16."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., n) uint8 -> (..., 2, n): low nibbles, then high nibbles."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def _q4_0(b):  # (nb, 18): d f16, 16 bytes of nibbles (low: 0..15, high: 16..31)
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, 2:18]).reshape(-1, 32).to(torch.int16) - 8
    return d[:, None] * q.float()


_BITS = None


def _bits(device) -> torch.Tensor:
    global _BITS
    if _BITS is None or _BITS.device != device:
        _BITS = torch.arange(8, dtype=torch.uint8, device=device)
    return _BITS


def _q5_0(b):  # (nb, 22): d f16, qh u32 little-endian (bit j = high bit of element j), 16 bytes of nibbles
    d = _f16(b[:, 0:2])
    hi = ((b[:, 2:6, None] >> _bits(b.device)) & 1).reshape(-1, 32)  # byte j//8, bit j%8
    lo = _nibbles(b[:, 6:22]).reshape(-1, 32)
    return d[:, None] * ((lo | (hi << 4)).to(torch.int16) - 16).float()


def _q8_0(b):  # (nb, 34): d f16, 32 int8
    return _f16(b[:, 0:2])[:, None] * b[:, 2:34].view(torch.int8).float()


def _k_scale_min(s: torch.Tensor):
    """Q4_K/Q5_K 12-byte scales -> 8 six-bit scales and 8 six-bit mins per super-block."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc.float(), mn.float()


def _q4_k(b):  # (nb, 144): d, dmin f16, scales[12], qs[128]
    nb = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    q = _nibbles(b[:, 16:144].reshape(nb, 4, 32)).reshape(nb, 8, 32).float()  # sub-block j: 32 values
    return ((d[:, None] * sc)[:, :, None] * q - (dmin[:, None] * mn)[:, :, None]).reshape(nb, QK_K)


def _q5_k(b):  # (nb, 176): d, dmin f16, scales[12], qh[32], qs[128]
    nb = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qh = b[:, 16:48]
    lo = _nibbles(b[:, 48:176].reshape(nb, 4, 32)).reshape(nb, 8, 32)
    hi = (qh[:, None, :] >> torch.arange(8, device=b.device, dtype=torch.uint8)[None, :, None]) & 1
    q = (lo | (hi << 4)).float()
    return ((d[:, None] * sc)[:, :, None] * q - (dmin[:, None] * mn)[:, :, None]).reshape(nb, QK_K)


def _q6_k(b):  # (nb, 210): ql[128], qh[64], int8 scales[16], d f16
    nb = b.shape[0]
    ql = _nibbles(b[:, 0:128].reshape(nb, 2, 64)).reshape(nb, 2, 2, 64)  # (half, lo/hi nibble, 64)
    ql = ql.reshape(nb, 8, 32)
    qh = b[:, 128:192].reshape(nb, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8,
                                                             device=b.device).reshape(1, 1, 4, 1)
    qh = (qh & 3).reshape(nb, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int16) - 32).reshape(nb, 16, 16).float()
    scales = b[:, 192:208].view(torch.int8).float()
    d = _f16(b[:, 208:210])
    return ((d[:, None] * scales)[:, :, None] * q).reshape(nb, QK_K)


_DEQUANT = {"Q4_0": _q4_0, "Q5_0": _q5_0, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
SUPPORTED = tuple(_DEQUANT) + ("F16", "BF16", "F32")


def row_bytes(qtype: str, row_length: int) -> int:
    per, nbytes = BLOCKS[qtype]
    if row_length % per:
        raise ValueError(f"{qtype} rows must be a multiple of {per} elements, got {row_length}")
    return row_length // per * nbytes


def dequantize(raw: torch.Tensor, qtype: str, row_length: int) -> torch.Tensor:
    """raw uint8 (rows, row_bytes) -> float32 (rows, row_length)."""
    rows = raw.shape[0]
    if qtype == "F32":
        return raw.contiguous().view(torch.float32).reshape(rows, row_length)
    if qtype == "F16":
        return raw.contiguous().view(torch.float16).reshape(rows, row_length).float()
    if qtype == "BF16":
        return raw.contiguous().view(torch.bfloat16).reshape(rows, row_length).float()
    per, nbytes = BLOCKS[qtype]
    blocks = raw.reshape(rows * (row_length // per), nbytes)
    return _DEQUANT[qtype](blocks).reshape(rows, row_length)


def gguf_linear_ref(x: torch.Tensor, raw: torch.Tensor, qtype: str, in_features: int,
                    bias: torch.Tensor | None = None, chunk_elements: int = 1 << 24) -> torch.Tensor:
    """y = x @ W^T (+ bias) with W stored as GGUF blocks. x: (..., in_features).

    Large weights (an output head of 262k x 640) are dequantized a slab of rows at a time, so
    the temporary float copy stays under `chunk_elements`.
    """
    rows = max(1, chunk_elements // in_features)
    if raw.shape[0] <= rows:
        w = dequantize(raw, qtype, in_features).to(x.dtype)
        return torch.nn.functional.linear(x, w, bias)
    parts = [torch.nn.functional.linear(x, dequantize(raw[i:i + rows], qtype, in_features).to(x.dtype))
             for i in range(0, raw.shape[0], rows)]
    y = torch.cat(parts, dim=-1)
    return y + bias if bias is not None else y


def round_x_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) as 32-element blocks (-1, 32): xq = round(x / sx) (float, in [-127, 127], ties to
    even) and sx = max|x| / 127 (-1, 1), the int8 rounding of llama.cpp's Q8 blocks, which the
    int8-x kernels share (the GPU's int8-x GEMV, the CPU's avx2 integer dots). 127 / max|x| is one
    correctly rounded division here and in the kernels (`127 / t` in torch is 127 * (1 / t): two
    roundings, which flipped near-ties against a kernel). A block whose 127 / max|x| overflows
    (zeros, or max|x| < 127 / FLT_MAX ~ 3.7e-37) rounds to zeros."""
    xb = x.float().reshape(-1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.div(torch.full_like(amax, 127.0), amax)
    return torch.round(xb * torch.where(torch.isfinite(inv), inv, torch.zeros_like(amax))), amax / 127


def gguf_linear_ref_q8(x: torch.Tensor, raw: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """What the CPU's int8-x kernels compute (the avx2 build, kernels/csrc/gguf_avx2_cpu.inc and
    gguf_i8gemm_cpu.inc), in float64: W times x rounded to int8 per 32 values (round_x_q8),
    xq * sx formed exactly. (..., in_features) -> (..., N) float64."""
    xq, sx = round_x_q8(x)
    xd = (xq.double() * sx.double()).reshape(*x.shape)
    return torch.nn.functional.linear(xd, dequantize(raw, qtype, in_features).double())


def gguf_embedding_ref(ids: torch.Tensor, raw: torch.Tensor, qtype: str, dim: int,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `ids` of a GGUF-stored embedding table, dequantized. ids: any shape -> (..., dim)."""
    flat = ids.reshape(-1)
    return dequantize(raw[flat], qtype, dim).to(dtype).reshape(*ids.shape, dim)
