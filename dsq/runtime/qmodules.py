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


def set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)
