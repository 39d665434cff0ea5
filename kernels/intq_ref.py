"""dsq's one internal layout for integer weights (AWQ, GPTQ v1/v2, act-order, int4 and int8), its
torch reference kernel, and the repacking from the on-disk formats (dsq.formats.awq_gptq).

Layout, for a Linear with K inputs, N outputs, group size g (g = K for per channel), G = K / g:
- `qweight` uint8: 4 bits -> (N, K/2), byte j of row n = q[n, 2j] | q[n, 2j+1] << 4;
                   8 bits -> (N, K), one code per byte. Codes are unsigned (0..15 / 0..255).
- `scales`  float16 (N, G);  `zeros` uint8 (N, G) (integer zero points).
- W[n, k] = scales[n, k // g] * (q[n, k] - zeros[n, k // g]), computed in float32.
- act-order: `perm` int64 (K,) or None. The stored columns are W_orig[:, perm] (so groups are
  contiguous); y = x[..., perm] @ W_stored^T.
Rows stay contiguous along K so one kernel serves every M: CPU row dots, Triton GEMV and tl.dot.
"""

from __future__ import annotations

import torch

from dsq.errors import DsqError


def unpack_codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 (N, K*bits/8) -> int32 codes (N, K)."""
    if bits == 8:
        return qweight.to(torch.int32)
    w = qweight.to(torch.int32)
    return torch.stack([w & 0xF, w >> 4], dim=-1).reshape(w.shape[0], -1)


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int codes (N, K) -> uint8 (N, K*bits/8)."""
    q = q.to(torch.int32)
    if bits == 8:
        return q.to(torch.uint8).contiguous()
    if q.shape[1] % 2:
        raise DsqError(f"a 4-bit layer needs an even input width, got {q.shape[1]}", "use --bits 8")
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8).contiguous()


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """-> float32 (N, K) in stored column order."""
    q = unpack_codes(qweight, bits).float()
    _N, K = q.shape
    g = K // scales.shape[1]
    s = scales.float().repeat_interleave(g, dim=1)
    z = zeros.float().repeat_interleave(g, dim=1)
    return (q - z) * s


def int_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                   perm: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference kernel: y = x W^T (+ bias), in x's dtype (accumulated in float32)."""
    xf = x.float()
    if perm is not None:
        xf = xf[..., perm]
    y = xf @ dequantize(qweight, scales, zeros, bits).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def pack(q_nk: torch.Tensor, scales_ng: torch.Tensor, zeros_ng: torch.Tensor, bits: int,
         perm: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Internal tensors from codes (N, K) (stored order), scales and integer zeros (N, G)."""
    out = {"qweight": pack_codes(q_nk, bits), "scales": scales_ng.to(torch.float16).contiguous(),
           "zeros": zeros_ng.to(torch.uint8).contiguous()}
    if perm is not None:
        out["perm"] = perm.to(torch.int64).contiguous()
    return out


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM (qweight (K, N/8), qzeros (G, N/8), scales (G, N)) -> internal int4."""
    from dsq.formats.awq_gptq import unpack_awq

    q = unpack_awq(qweight).t()  # (N, K)
    z = unpack_awq(qzeros).t()  # (N, G)
    return pack(q, scales.t(), z, 4)


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int,
              v1: bool) -> dict[str, torch.Tensor]:
    """GPTQ (qweight (K*b/32, N), qzeros (G, N*b/32), scales (G, N), g_idx (K,)) -> internal layout.
    Act-order checkpoints (g_idx not k // g) get their columns sorted by group and a `perm`."""
    from dsq.formats.awq_gptq import unpack_rows

    q = unpack_rows(qweight, bits).t()  # (N, K), original channel order
    z = unpack_rows(qzeros.t().contiguous(), bits).t() + (1 if v1 else 0)  # (G, N)
    if v1 and bits == 8:
        z = z.clamp(max=255)
    K, G = q.shape[1], scales.shape[0]
    gi = g_idx.to(torch.int64)
    g = K // G
    perm = None
    natural = torch.arange(K, device=gi.device) // g
    if not torch.equal(gi, natural):
        perm = torch.argsort(gi, stable=True)
        if not torch.equal(gi[perm], natural):
            raise DsqError("this GPTQ checkpoint's g_idx does not give every group the same size",
                           "re-quantize it with dsq quantize --method gptq")
        q = q[:, perm]
    return pack(q, scales.t(), z.t(), bits, perm)
