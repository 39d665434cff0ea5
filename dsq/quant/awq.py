"""AWQ (Lin et al., 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration"): per input channel scales s = mean|x|^a / mean|w|^(1-a), searched over a in [0, 1)
to minimize the output error of the quantized layers, folded into the operation before them
(norm weights, or the previous Linear's rows) so the model computes the same function; then a
per-group clipping search. Follows AutoAWQ's search (duo scaling, 20-point grids).

Shapes: x (T, K) calibration inputs of a group of Linears that share them; W (N, K).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from dsq.quant.intq import group_params, quantize_codes

N_GRID = 20


def fake_quant(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Asymmetric group-wise round-to-nearest, dequantized (AWQ's quantizer)."""
    N, K = w.shape
    g = K if group == -1 else group
    wg = w.float().reshape(-1, g)
    scale, zero = group_params(wg, bits, sym=False)
    q = quantize_codes(wg, scale[:, None], zero[:, None], bits)
    return (scale[:, None] * (q - zero[:, None])).reshape(N, K).to(w.dtype)


@dataclass
class ScaleGroup:
    """Linears that read the same input, the op whose output they read, and how to score a scale."""

    name: str
    prev: nn.Module  # an RMSNorm (weight, offset) or an nn.Linear whose output rows feed the group
    linears: list[nn.Linear]
    inspect: Callable[[torch.Tensor], torch.Tensor]  # x -> the output whose error is minimized


def search_scale(group: ScaleGroup, x: torch.Tensor, bits: int, gsize: int) -> torch.Tensor:
    """The best per-channel scale (K,) for one group, by output MSE over the grid."""
    x = x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        ref = group.inspect(x)
        x_mean = x.abs().float().mean(0)
        w = torch.cat([lin.weight.float() for lin in group.linears])
        g = w.shape[1] if gsize == -1 else gsize
        w_scaled = (w.abs().reshape(-1, g) / w.abs().reshape(-1, g).amax(1, keepdim=True).clamp(min=1e-10))
        w_mean = w_scaled.reshape(w.shape).mean(0)
        originals = [lin.weight.data.clone() for lin in group.linears]
        best, best_err = None, float("inf")
        for i in range(N_GRID):
            a = i / N_GRID
            s = (x_mean.pow(a) / (w_mean.pow(1 - a) + 1e-4)).clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            for lin, w0 in zip(group.linears, originals):
                lin.weight.data = (fake_quant(w0.float() * s, bits, gsize) / s).to(w0.dtype)
            err = (group.inspect(x) - ref).float().pow(2).mean().item()
            if err < best_err:
                best_err, best = err, s.clone()
        for lin, w0 in zip(group.linears, originals):
            lin.weight.data = w0
    return best


def apply_scale(group: ScaleGroup, s: torch.Tensor) -> None:
    """W <- W * s for the group; the previous op's output <- output / s (same function)."""
    with torch.no_grad():
        for lin in group.linears:
            lin.weight.mul_(s.to(lin.weight.dtype))
        prev = group.prev
        if isinstance(prev, nn.Linear):
            prev.weight.div_(s.to(prev.weight.dtype)[:, None])
            if prev.bias is not None:
                prev.bias.div_(s.to(prev.bias.dtype))
        else:  # RMSNorm computing x_hat * (offset + w)
            off = getattr(prev, "offset", 0.0)
            prev.weight.copy_(((off + prev.weight.float()) / s - off).to(prev.weight.dtype))


def search_clip(lin: nn.Linear, x: torch.Tensor, bits: int, gsize: int, n_tokens: int = 512,
                max_shrink: float = 0.5, oc_batch: int = 256) -> torch.Tensor:
    """Per (output row, group) clipping of |W| that minimizes the group's partial-output error."""
    w = lin.weight.float()
    N, K = w.shape
    g = K if gsize == -1 else gsize
    x = x.reshape(-1, K).float()
    x = x[torch.linspace(0, x.shape[0] - 1, min(n_tokens, x.shape[0])).long().to(x.device)]
    xg = x.reshape(x.shape[0], K // g, g)  # (T, G, g)
    best_all = []
    for b in range(0, N, oc_batch):
        wb = w[b:b + oc_batch].reshape(-1, K // g, g)  # (oc, G, g)
        org_max = wb.abs().amax(dim=-1, keepdim=True)  # (oc, G, 1)
        best = org_max.clone()
        min_err = torch.full_like(org_max, float("inf"))
        org_out = torch.einsum("tgk,ogk->otg", xg, wb)  # each group's share of each output
        for i in range(int(max_shrink * N_GRID)):
            mx = org_max * (1 - i / N_GRID)
            q = fake_quant(torch.clamp(wb, -mx, mx).reshape(-1, K), bits, gsize).reshape(wb.shape)
            err = (torch.einsum("tgk,ogk->otg", xg, q) - org_out).pow(2).mean(1)[..., None]  # (oc, G, 1)
            better = err < min_err
            min_err = torch.where(better, err, min_err)
            best = torch.where(better, mx, best)
        best_all.append(best)
    return torch.cat(best_all)  # (N, G, 1)


def apply_clip(lin: nn.Linear, max_val: torch.Tensor, gsize: int) -> None:
    with torch.no_grad():
        N, K = lin.weight.shape
        g = K if gsize == -1 else gsize
        w = lin.weight.float().reshape(N, K // g, g)
        lin.weight.copy_(torch.clamp(w, -max_val, max_val).reshape(N, K).to(lin.weight.dtype))
