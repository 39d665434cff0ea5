"""The torch reference of the CPU routed-experts kernel (csrc/moe_cpu.inc, cpu.moe_experts): a MoE
layer's routed experts, GGUF blocks stacked per projection as llama.cpp stores `ffn_*_exps`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsq.kernels.gguf_ref import dequantize


def moe_experts_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                    down: torch.Tensor, qtypes: tuple[str, str, str]) -> torch.Tensor:
    """x (M, H) float; ids, weights (M, k); gate, up (E, I, row bytes) and down (E, H, row bytes)
    GGUF blocks. Returns (M, H) float32: per row, the sum over its choices in ascending expert
    order of weight * down(silu(gate(x)) * up(x))."""
    M, H = x.shape
    I = gate.shape[1]
    xf = x.float()
    out = torch.zeros(M, H)
    for e in ids.unique().tolist():
        rows, slot = (ids == e).nonzero(as_tuple=True)
        wg = dequantize(gate[e], qtypes[0], H)
        wu = dequantize(up[e], qtypes[1], H)
        wd = dequantize(down[e], qtypes[2], I)
        xe = xf[rows]
        y = F.linear(F.silu(F.linear(xe, wg)) * F.linear(xe, wu), wd)
        out.index_add_(0, rows, y * weights[rows, slot, None].float())
    return out
