"""FP8 e4m3 weight quantization, per output channel or per 128x128 block: scale = amax / 448.

Needs no calibration (activations are quantized dynamically by the serving engine)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

from dsq.errors import DsqError
from dsq.formats.fp8_checkpoint import BLOCK, FP8_MAX, compressed_tensors_config, deepseek_config, expand_block_scale
from dsq.quant.method import LayerMethod

if TYPE_CHECKING:
    from dsq.quant.blocks import Block
    from dsq.quant.spec import QuantSpec


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


class FP8(LayerMethod):
    name = "fp8"

    def check(self, spec: "QuantSpec") -> None:
        if spec.fp8_scheme not in ("channel", "block"):
            raise DsqError(f"unknown FP8 scheme {spec.fp8_scheme!r}", "use channel or block")
        if spec.fp8_format not in ("compressed-tensors", "deepseek"):
            raise DsqError(f"unknown FP8 format {spec.fp8_format!r}", "use compressed-tensors or deepseek")
        if spec.fp8_format == "deepseek" and spec.fp8_scheme != "block":
            raise DsqError("DeepSeek's native FP8 format is 128x128 blocks", "add --fp8-scheme block")

    def weight_bits(self, spec: "QuantSpec") -> int:
        return 8

    def label(self, spec: "QuantSpec") -> str:
        return f"{super().label(spec)}-{spec.fp8_scheme}"

    def quantization_config(self, spec: "QuantSpec", kept=None) -> dict:
        """DeepSeek's config, its kept Linears by name (modules_to_not_convert: vLLM's and
        transformers' FP8 loaders match names exactly); or compressed-tensors', whose `ignore`
        takes whole layers as "re:" patterns."""
        if spec.fp8_format == "deepseek":
            qc = deepseek_config()
            if kept is not None and kept.modules:
                qc["modules_to_not_convert"] = list(kept.modules)
            return qc
        ignore = self.kept(spec) if kept is None else \
            ["lm_head"] + [f"re:{re.escape(p)}.*" for p in kept.layer_prefixes()] + kept.outside_layers()
        return compressed_tensors_config(spec.fp8_scheme, ignore)

    def settings(self, spec: "QuantSpec") -> dict:
        return {"scheme": spec.fp8_scheme, "format": spec.fp8_format}

    def quantize_block(self, block: "Block", spec: "QuantSpec") -> dict:
        """Weights stay as they are: nothing downstream is calibrated on them."""
        key = "weight_scale_inv" if spec.fp8_format == "deepseek" else "weight_scale"
        out: dict[str, torch.Tensor] = {}
        for name, lin in block.linears.items():
            out[f"{name}.weight"], out[f"{name}.{key}"] = fp8_quantize(lin.weight.data.cpu(), spec.fp8_scheme)
        return out
