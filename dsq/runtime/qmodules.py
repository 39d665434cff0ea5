"""Quantized modules the runtime swaps into a model before loading: weights stay in their on-disk
format in memory and every op goes through `dsq.kernels.dispatch` (one line to a faster kernel)."""

from __future__ import annotations

import torch
from torch import nn

from dsq.kernels import dispatch
from dsq.kernels.gguf_ref import row_bytes


class GGUFLinear(nn.Module):
    """y = x W^T + b with W kept as GGUF blocks: raw uint8 (out_features, row_bytes)."""

    def __init__(self, qtype: str, in_features: int, out_features: int, bias: bool = False,
                 device=None, dtype=torch.float32):
        super().__init__()
        self.qtype, self.in_features, self.out_features = qtype, in_features, out_features
        self.register_buffer("raw", torch.empty(out_features, row_bytes(qtype, in_features), dtype=torch.uint8,
                                                device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.gguf_linear(x, self.raw, self.qtype, self.in_features, self.bias)

    def extra_repr(self) -> str:
        return f"{self.qtype}, in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class GGUFEmbedding(nn.Module):
    """Embedding rows kept as GGUF blocks; looked-up rows are dequantized."""

    def __init__(self, qtype: str, num_embeddings: int, dim: int, device=None, dtype=torch.float32):
        super().__init__()
        self.qtype, self.num_embeddings, self.dim, self.out_dtype = qtype, num_embeddings, dim, dtype
        self.register_buffer("raw", torch.empty(num_embeddings, row_bytes(qtype, dim), dtype=torch.uint8,
                                                device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dispatch.gguf_embedding(ids, self.raw, self.qtype, self.dim, self.out_dtype)

    def extra_repr(self) -> str:
        return f"{self.qtype}, {self.num_embeddings}x{self.dim}"


class _DequantLinear(nn.Module):
    """A Linear stored in a checkpoint's quantized format, dequantized by the reference path.
    Subclasses define `weight_float()`: the (N, K) float32 weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight_float().to(x.dtype), self.bias)


class AWQLinear(_DequantLinear):
    """AutoAWQ GEMM: qweight (K, N/8), qzeros (K/g, N/8), scales (K/g, N)."""

    def __init__(self, in_features, out_features, bias, group: int, dtype=torch.float32):
        super().__init__(in_features, out_features, bias, dtype)
        g = in_features if group == -1 else group
        self.group = group
        self.register_buffer("qweight", torch.empty(in_features, out_features // 8, dtype=torch.int32))
        self.register_buffer("qzeros", torch.empty(in_features // g, out_features // 8, dtype=torch.int32))
        self.register_buffer("scales", torch.empty(in_features // g, out_features, dtype=torch.float16))

    def weight_float(self):
        from dsq.formats.intq import awq_dequantize

        return awq_dequantize(self.qweight, self.qzeros, self.scales, self.group)


class GPTQLinear(_DequantLinear):
    """GPTQ: qweight (K*b/32, N), qzeros (G, N*b/32), scales (G, N), g_idx (K,)."""

    def __init__(self, in_features, out_features, bias, bits: int, group: int, v1: bool, dtype=torch.float32):
        super().__init__(in_features, out_features, bias, dtype)
        g = in_features if group == -1 else group
        G = -(-in_features // g)
        self.bits, self.v1 = bits, v1
        self.register_buffer("qweight", torch.empty(in_features * bits // 32, out_features, dtype=torch.int32))
        self.register_buffer("qzeros", torch.empty(G, out_features * bits // 32, dtype=torch.int32))
        self.register_buffer("scales", torch.empty(G, out_features, dtype=torch.float16))
        self.register_buffer("g_idx", torch.empty(in_features, dtype=torch.int32))

    def weight_float(self):
        from dsq.formats.intq import gptq_dequantize

        return gptq_dequantize(self.qweight, self.qzeros, self.scales, self.g_idx, self.bits, self.v1)


class FP8Linear(_DequantLinear):
    """FP8 e4m3 weight (N, K) with a channel, tensor or 128x128-block scale."""

    def __init__(self, in_features, out_features, bias, scale_shape: tuple, scale_name: str, dtype=torch.float32):
        super().__init__(in_features, out_features, bias, dtype)
        self.scale_name = scale_name
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer(scale_name, torch.empty(scale_shape, dtype=torch.float32))

    def weight_float(self):
        from dsq.formats.fp8 import fp8_dequantize

        return fp8_dequantize(self.weight, getattr(self, self.scale_name))


def set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)
