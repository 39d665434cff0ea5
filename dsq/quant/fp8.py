"""FP8 e4m3 weight quantization, per output channel or per 128x128 block: scale = amax / 448.

Needs no calibration (activations are quantized dynamically by the serving engine)."""

from __future__ import annotations

import torch

from dsq.formats.fp8_checkpoint import BLOCK, FP8_MAX, expand_block_scale


def fp8_quantize(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> (float8_e4m3fn (N, K), float32 scale (N, 1) or (ceil(N/128), ceil(K/128)))."""
    w = w.float()
    N, K = w.shape
    if scheme == "channel":
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        full = scale
    elif scheme == "block":
        nb, kb = -(-N // BLOCK), -(-K // BLOCK)
        padded = torch.zeros(nb * BLOCK, kb * BLOCK)
        padded[:N, :K] = w.abs()
        scale = (padded.reshape(nb, BLOCK, kb, BLOCK).amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
        full = expand_block_scale(scale, N, K)
    else:
        raise ValueError(f"unknown FP8 scheme {scheme!r}")
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale
