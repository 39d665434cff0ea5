"""FP8 (e4m3) weights as the runtime holds them, unchanged from disk: `weight` float8_e4m3fn (N, K)
and a float32 `scale` that is per tensor (1,), per output channel (N, 1) or per 128x128 block
(ceil(N/128), ceil(K/128)) (dsq.formats.fp8_checkpoint). The torch reference kernel."""

from __future__ import annotations

import torch

BLOCK = 128


def scale_kind(scale: torch.Tensor, n: int) -> str:
    if scale.numel() == 1:
        return "tensor"
    if scale.numel() == n and (scale.ndim == 1 or scale.shape[-1] == 1):
        return "channel"
    return "block"


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x (weight * scale)^T (+ bias), in x's dtype (accumulated in float32)."""
    from dsq.formats.fp8_checkpoint import fp8_dequantize

    y = x.float() @ fp8_dequantize(weight, scale).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
