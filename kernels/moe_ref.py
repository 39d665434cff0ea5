"""The torch reference of the CPU routed-experts kernel (csrc/moe_cpu.inc, cpu.moe_experts): a MoE
layer's routed experts, GGUF blocks stacked per projection as llama.cpp stores `ffn_*_exps`."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dsq.kernels.gguf_ref import dequantize, round_x_q8


def _q8(x: torch.Tensor, on: bool) -> torch.Tensor:
    """x, or x rounded to int8 per 32 values (round_x_q8) as the integer-dot kernels round it."""
    if not on:
        return x
    xq, sx = round_x_q8(x)
    return (xq * sx).reshape(x.shape)


def moe_experts_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                    down: torch.Tensor, qtypes: tuple[str, str, str],
                    int8: Callable[[str, int], bool] | None = None) -> torch.Tensor:
    """x (M, H) float; ids, weights (M, k); gate, up (E, I, row bytes) and down (E, H, row bytes)
    GGUF blocks. Returns (M, H) float32: per row, the sum over its choices in ascending expert
    order of weight * down(silu(gate(x)) * up(x)). Where `int8(qtype, rows)` holds for a projection
    and an expert's row count, that projection's input is rounded to int8 per 32 values first, as a
    build whose integer dots do that computes it."""
    M, H = x.shape
    inter = gate.shape[1]
    xf = x.float()
    out = torch.zeros(M, H)
    for e in ids.unique().tolist():
        rows, slot = (ids == e).nonzero(as_tuple=True)
        wg = dequantize(gate[e], qtypes[0], H)
        wu = dequantize(up[e], qtypes[1], H)
        wd = dequantize(down[e], qtypes[2], inter)
        xe = xf[rows]
        on = [bool(int8 and int8(q, len(rows))) for q in qtypes]
        h = F.silu(F.linear(_q8(xe, on[0]), wg)) * F.linear(_q8(xe, on[1]), wu)
        y = F.linear(_q8(h, on[2]), wd)
        out.index_add_(0, rows, y * weights[rows, slot, None].float())
    return out
