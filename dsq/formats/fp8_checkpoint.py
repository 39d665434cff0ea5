"""FP8 (e4m3) Linear weights on disk: compressed-tensors (vLLM / SGLang / llm-compressor) and
DeepSeek-V3's native layout (`weight_scale_inv`, 128x128 blocks).

W = q * scale, with `scale` per output channel (N, 1) or per 128x128 block (ceil(N/128), ceil(K/128)).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
BLOCK = 128


def expand_block_scale(scale: torch.Tensor, n: int, k: int, block: int = BLOCK) -> torch.Tensor:
    """(ceil(N/b), ceil(K/b)) -> (N, K)."""
    return scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]


def fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """weight float8_e4m3fn (N, K), scale (N, 1) | (1,) | (N/128, K/128) -> float32 (N, K)."""
    w = weight.float()
    n, k = w.shape
    s = scale.float()
    if s.numel() == 1:  # per tensor
        return w * s.reshape(())
    if s.numel() == n and (s.ndim == 1 or s.shape[-1] == 1):  # per output channel
        return w * s.reshape(n, 1)
    return w * expand_block_scale(s, n, k)  # per 128x128 block


def compressed_tensors_config(strategy: str, ignore: list[str]) -> dict:
    """quantization_config for FP8 weights with dynamic FP8 activations (validated in the tests
    by the compressed-tensors package's own pydantic models)."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
    if strategy == "block":
        weights["block_structure"] = [BLOCK, BLOCK]
        acts.update(strategy="group", group_size=BLOCK)
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ignore, "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                            "input_activations": acts}}}


def deepseek_config() -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
