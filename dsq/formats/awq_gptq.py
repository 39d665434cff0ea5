"""Integer-quantized Linear formats on disk: AutoAWQ "GEMM" and GPTQ (v1/v2), both ways.

Notation (../shared/docs/formats.md): a Linear has K inputs, N outputs, torch weight (N, K),
group size g; `q` holds the integer codes as (K, N) or (N, K) as stated; zeros are integers.
Dequantized weight: W[n, k] = scale[group(k), n] * (q[k, n] - zero[group(k), n]).
"""

from __future__ import annotations

import torch

from dsq.errors import DsqError

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a word holds output column 8c + AWQ_ORDER[i]
AWQ_REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]  # column j of a group of 8 sits in nibble AWQ_REVERSE[j]


def check_shape(name: str, n_out: int, n_in: int, bits: int, group: int, method: str) -> None:
    """Refuse, before any work, a layer the format cannot hold."""
    g = n_in if group == -1 else group
    if n_in % g:
        raise DsqError(f"{name}: {n_in} inputs do not split into groups of {g}",
                       "choose a --group-size that divides every layer's input width (or -1 per channel)")
    per_word = 32 // bits
    if method == "awq" and n_out % per_word:
        raise DsqError(f"{name}: {n_out} outputs cannot be packed {per_word} to a 32-bit word (AWQ)",
                       "this layer's width does not fit the AWQ format; use gptq")
    if method in ("gptq", "rtn") and (n_in % per_word or n_out % per_word):
        raise DsqError(f"{name}: {n_in}x{n_out} cannot be packed {per_word} to a 32-bit word (GPTQ)",
                       "this layer's width does not fit the GPTQ format")


# -- AWQ GEMM ----------------------------------------------------------------------------------
def pack_awq(q_kn: torch.Tensor) -> torch.Tensor:
    """(K, N) codes 0..15 -> int32 (K, N/8), packed along N with AWQ's interleave."""
    K, N = q_kn.shape
    q = q_kn.to(torch.int64).reshape(K, N // 8, 8)[:, :, AWQ_ORDER]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    words = (q << shifts).sum(-1)
    return _to_int32(words)


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """int32 (R, N/8) -> codes (R, N) in natural column order."""
    R, W = words.shape
    w = words.to(torch.int64) & 0xFFFFFFFF
    nib = (w[:, :, None] >> torch.arange(0, 32, 4, dtype=torch.int64, device=w.device)) & 0xF  # (R, W, 8) by nibble
    return nib[:, :, torch.tensor(AWQ_REVERSE, device=w.device)].reshape(R, W * 8)


def awq_tensors(q_nk: torch.Tensor, scales_gn: torch.Tensor, zeros_gn: torch.Tensor) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM tensors from codes (N, K), scales and integer zeros (G, N)."""
    return {"qweight": pack_awq(q_nk.t().contiguous()), "qzeros": pack_awq(zeros_gn),
            "scales": scales_gn.to(torch.float16).contiguous()}


def awq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """-> float32 (N, K)."""
    q = unpack_awq(qweight).float()  # (K, N)
    z = unpack_awq(qzeros).float()  # (G, N)
    K = q.shape[0]
    g = torch.arange(K) // (K if group == -1 else group)
    return ((q - z[g]) * scales.float()[g]).t().contiguous()


def awq_config(group: int, skip: list[str] | None) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": skip or None}


# -- GPTQ --------------------------------------------------------------------------------------
def _to_int32(words: torch.Tensor) -> torch.Tensor:
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack along dim 0, LSB first: (R, C) codes -> int32 (R*bits/32, C)."""
    per = 32 // bits
    R, C = q.shape
    q = q.to(torch.int64).reshape(R // per, per, C)
    shifts = (torch.arange(per, dtype=torch.int64) * bits)[None, :, None]
    return _to_int32((q << shifts).sum(1))


def unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    per = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = (torch.arange(per, dtype=torch.int64, device=w.device) * bits)[None, :, None]
    return ((w[:, None, :] >> shifts) & ((1 << bits) - 1)).reshape(-1, words.shape[1])


def gptq_tensors(q_nk: torch.Tensor, scales_gn: torch.Tensor, zeros_gn: torch.Tensor, g_idx: torch.Tensor,
                 bits: int, v1: bool) -> dict[str, torch.Tensor]:
    """GPTQ tensors from codes (N, K) in original channel order, per-group scales/zeros (G, N)."""
    z = zeros_gn.to(torch.int64) - (1 if v1 else 0)  # v1 stores zero - 1
    if v1 and (z < 0).any():
        raise DsqError("a zero point of 0 cannot be stored in GPTQ v1", "use the v2 checkpoint format (asymmetric)")
    return {"qweight": pack_rows(q_nk.t().contiguous(), bits),
            "qzeros": pack_rows(z.t().contiguous(), bits).t().contiguous(),
            "scales": scales_gn.to(torch.float16).contiguous(), "g_idx": g_idx.to(torch.int32).contiguous()}


def gptq_dequantize(qweight, qzeros, scales, g_idx, bits: int, v1: bool) -> torch.Tensor:
    """-> float32 (N, K)."""
    q = unpack_rows(qweight, bits).float()  # (K, N)
    z = unpack_rows(qzeros.t().contiguous(), bits).t().float() + (1 if v1 else 0)  # (G, N)
    gi = g_idx.long()
    return ((q - z[gi]) * scales.float()[gi]).t().contiguous()


def gptq_config(bits: int, group: int, desc_act: bool, sym: bool, damp: float, v1: bool) -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
            "damp_percent": damp, "true_sequential": True, "lm_head": False,
            "checkpoint_format": "gptq" if v1 else "gptq_v2"}
