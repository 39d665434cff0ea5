"""Choose the implementation for a quantized op by device, format and shape.

CPU: the C kernels (kernels/csrc) when they were built; otherwise, and on other devices for now,
the torch reference. DSQ_KERNELS=reference forces the reference everywhere (tests, debugging).
"""

from __future__ import annotations

import os

import torch

from dsq.kernels import gguf_ref


def _use_cpu_kernels(x: torch.Tensor, qtype: str) -> bool:
    if x.device.type != "cpu" or os.environ.get("DSQ_KERNELS") == "reference":
        return False
    from dsq.kernels import cpu

    return qtype in cpu.GGML_TYPES and cpu.available()


def gguf_linear(x: torch.Tensor, raw: torch.Tensor, qtype: str, in_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    if _use_cpu_kernels(x, qtype):
        from dsq.kernels import cpu

        return cpu.gguf_linear(x, raw, qtype, in_features, bias)
    return gguf_ref.gguf_linear_ref(x, raw, qtype, in_features, bias)


def gguf_embedding(ids: torch.Tensor, raw: torch.Tensor, qtype: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    if _use_cpu_kernels(ids, qtype):
        from dsq.kernels import cpu

        return cpu.gguf_rows(ids, raw, qtype, dim).to(dtype)
    return gguf_ref.gguf_embedding_ref(ids, raw, qtype, dim, dtype)


def implementation(device: str = "cpu", qtype: str = "Q4_K") -> str:
    """Which implementation a call would use (for reports)."""
    x = torch.empty(0, device=device)
    if _use_cpu_kernels(x, qtype):
        from dsq.kernels import cpu

        return f"C ({cpu.library()[1]})"
    return "torch reference"
