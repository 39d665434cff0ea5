"""Group-wise integer quantization by round-to-nearest (RTN, the baseline), and what the integer
methods (RTN, GPTQ, AWQ) share: codes with their scales and zero points, group parameters, and
writing them in the GPTQ checkpoint format.

Shapes: W (N, K) torch layout; groups run along K; scales/zeros (G, N).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from dsq.errors import DsqError
from dsq.formats import awq_gptq
from dsq.quant.method import LayerMethod

if TYPE_CHECKING:
    from dsq.quant.blocks import Block
    from dsq.quant.spec import QuantSpec


@dataclass
class IntQuant:
    """Codes and parameters of one quantized weight."""

    q: torch.Tensor  # (N, K) integer codes, original column order
    scales: torch.Tensor  # (G, N) float32
    zeros: torch.Tensor  # (G, N) integer zero points
    g_idx: torch.Tensor  # (K,) group of every input column
    bits: int

    def split(self, rows: list[int]) -> list["IntQuant"]:
        """Per-Linear pieces of a quantization made over stacked rows."""
        out, start = [], 0
        for r in rows:
            sl = slice(start, start + r)
            out.append(IntQuant(self.q[sl], self.scales[:, sl], self.zeros[:, sl], self.g_idx, self.bits))
            start += r
        return out

    def cpu(self) -> "IntQuant":
        return IntQuant(self.q.cpu(), self.scales.cpu(), self.zeros.cpu(), self.g_idx.cpu(), self.bits)

    def dequantize(self) -> torch.Tensor:
        gi = self.g_idx.long()
        return (self.q.float() - self.zeros.float().t()[:, gi]) * self.scales.t()[:, gi]


def group_params(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and integer zero for the rows of w (R, g): asymmetric min/max, or symmetric |max|."""
    maxq = 2**bits - 1
    wmin = w.min(dim=1).values.clamp(max=0)
    wmax = w.max(dim=1).values.clamp(min=0)
    if sym:
        wmax = torch.maximum(wmin.abs(), wmax)
        scale = 2 * wmax / maxq
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        scale = (wmax - wmin) / maxq
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        zero = torch.round(-wmin / scale).clamp(0, maxq)
    # the checkpoint stores scales in fp16: quantize against exactly what will be stored
    scale = scale.clamp(6e-8, 65504).half().float()
    return scale, zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    return torch.clamp(torch.round(w / scale) + zero, 0, 2**bits - 1)


def rtn(w: torch.Tensor, bits: int, group: int, sym: bool) -> IntQuant:
    """Round-to-nearest, group-wise along the input dimension."""
    N, K = w.shape
    g = K if group == -1 else group
    wg = w.float().reshape(N, K // g, g).transpose(0, 1).reshape(-1, g)  # (G*N, g)
    scale, zero = group_params(wg, bits, sym)
    q = quantize_codes(wg, scale[:, None], zero[:, None], bits)
    q = q.reshape(K // g, N, g).transpose(0, 1).reshape(N, K)
    return IntQuant(q.to(torch.int32), scale.reshape(K // g, N), zero.reshape(K // g, N).to(torch.int32),
                    torch.arange(K) // g, bits)


class IntMethod(LayerMethod):
    """A method whose checkpoint holds group-wise integer codes (GPTQ format unless it says otherwise)."""

    def check(self, spec: "QuantSpec") -> None:
        self.check_bits(spec)
        if not (spec.group_size == -1 or spec.group_size in (32, 64, 128, 256)):
            raise DsqError(f"--group-size {spec.group_size} is not supported", "use 32, 64, 128, 256 or -1 (per channel)")

    def check_bits(self, spec: "QuantSpec") -> None:
        if spec.bits not in (4, 8):
            raise DsqError(f"--bits {spec.bits} is not supported", "use 4 or 8")

    def check_shape(self, name: str, n_out: int, n_in: int, spec: "QuantSpec") -> None:
        awq_gptq.check_shape(name, n_out, n_in, spec.bits, spec.group_size, self.name)

    def quantization_config(self, spec: "QuantSpec", kept=None) -> dict:
        """GPTQ's config; Linears kept 16-bit as negative `dynamic` rules (GPTQModel's and vLLM's
        per-module overrides: "-:" + a regex matched at the module name's start)."""
        sym = bool(spec.sym)
        qc = awq_gptq.gptq_config(spec.bits, spec.group_size, spec.act_order, sym, spec.damp, sym)
        if kept is not None and kept.modules:
            rules = [re.escape(p) for p in kept.layer_prefixes()] + [re.escape(m) + "$" for m in kept.outside_layers()]
            qc["dynamic"] = {f"-:{r}": {} for r in rules}
        return qc

    def settings(self, spec: "QuantSpec") -> dict:
        return {"group_size": spec.group_size, "symmetric": spec.sym}

    def tensors(self, iq: IntQuant, spec: "QuantSpec") -> dict[str, torch.Tensor]:
        """The checkpoint's tensors of one quantized weight, by suffix (qweight, scales, ...)."""
        return awq_gptq.gptq_tensors(iq.q, iq.scales, iq.zeros, iq.g_idx, spec.bits, v1=bool(spec.sym))

    def emit(self, out: dict, name: str, lin: nn.Linear, iq: IntQuant, spec: "QuantSpec") -> None:
        """Add Linear `name`'s tensors to `out`; its weight becomes what the codes dequantize to."""
        out.update({f"{name}.{k}": v for k, v in self.tensors(iq, spec).items()})
        lin.weight.data = iq.dequantize().to(device=lin.weight.device, dtype=lin.weight.dtype)


class RTN(IntMethod):
    name = "rtn"

    def quantize_block(self, block: "Block", spec: "QuantSpec") -> dict:
        out: dict[str, torch.Tensor] = {}
        for name, lin in block.linears.items():
            self.emit(out, name, lin, rtn(lin.weight.data.cpu(), spec.bits, spec.group_size, bool(spec.sym)), spec)
        return out
