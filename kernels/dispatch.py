"""Choose the implementation for a quantized op by device, format and shape.

Today every path is the torch reference; the fused GPU/CPU kernels register here.
"""

from __future__ import annotations

import torch

from dsq.kernels import gguf_ref


def gguf_linear(x: torch.Tensor, raw: torch.Tensor, qtype: str, in_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    return gguf_ref.gguf_linear_ref(x, raw, qtype, in_features, bias)


def gguf_embedding(ids: torch.Tensor, raw: torch.Tensor, qtype: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return gguf_ref.gguf_embedding_ref(ids, raw, qtype, dim, dtype)
