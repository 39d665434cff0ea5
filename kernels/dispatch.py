"""Choose the implementation for a quantized op by device, format and shape.

- CUDA: the Triton kernels over the packed layout (kernels/triton_qlinear.py) when Triton imports.
- CPU: the C kernels (kernels/csrc) when they were built.
- Anything else, or DSQ_KERNELS=reference: the torch reference with the same signature.
Shape is decided inside each kernel family (GEMV at M=1, tiles and tl.dot / blocked rows above).
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
from dsq.kernels import cpu, fp8_ref, gguf_ref, intq_ref, packed


def _reference() -> bool:
    return os.environ.get("DSQ_KERNELS") == "reference"


@lru_cache(maxsize=1)
def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401
        from dsq.kernels import triton_qlinear  # noqa: F401
    except Exception:  # noqa: BLE001 - no Triton, or one that cannot build here: keep the reference
        return False
    return True


def use_triton(device: torch.device | str) -> bool:
    """Whether weights on `device` should be packed for the Triton kernels."""
    return torch.device(device).type == "cuda" and not _reference() and _triton_ok()


def _cpu_kernels() -> bool:
    """Whether CPU tensors go to the C kernels (DSQ_KERNELS is read at every call)."""
    return not _reference() and cpu.available()


def _cpu(x: torch.Tensor, fn: str):
    """The C kernel `fn` when x is on the CPU and the kernels were built, else None. Under
    torch.compile: the same kernel as an operator it can trace (kernels/ops.py)."""
    if x.device.type != "cpu":
        return None
    if torch.compiler.is_compiling():
        from dsq.kernels import ops

        return getattr(ops, fn) if ops.available() else None
    return getattr(cpu, fn) if _cpu_kernels() else None


def gguf_linear(x: torch.Tensor, raw: torch.Tensor, qtype: str, in_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    k = _cpu(x, "gguf_linear")
    if k is not None and qtype in cpu.GGML_TYPES:
        return k(x, raw, qtype, in_features, bias)
    return gguf_ref.gguf_linear_ref(x, raw, qtype, in_features, bias)


def gguf_embedding(ids: torch.Tensor, raw: torch.Tensor, qtype: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    k = _cpu(ids, "gguf_rows")
    if k is not None and qtype in cpu.GGML_TYPES:
        return k(ids, raw, qtype, dim).to(dtype)
    return gguf_ref.gguf_embedding_ref(ids, raw, qtype, dim, dtype)


def int_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
               perm: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """dsq's internal int4/int8 layout (kernels/intq_ref.py)."""
    k = _cpu(x, "int_linear")
    if k is not None:
        return k(x, qweight, scales, zeros, bits, perm, bias)
    return intq_ref.int_linear_ref(x, qweight, scales, zeros, bits, perm, bias)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    k = _cpu(x, "fp8_linear")
    if k is not None:
        return k(x, weight, scale, bias)
    return fp8_ref.fp8_linear_ref(x, weight, scale, bias)


def packed_linear(x: torch.Tensor, p: packed.Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The GPU layout (kernels/packed.py)."""
    if x.device.type == "cuda" and not _reference() and _triton_ok():
        from dsq.kernels import triton_qlinear

        if triton_qlinear.supported(p, x):
            return triton_qlinear.packed_linear(x, p, bias)
    return packed.linear_ref(x, p, bias)


def implementation(device: str = "cpu", qtype: str = "Q4_K") -> str:
    """Which implementation a call would use (for reports)."""
    if use_triton(device):
        return "Triton"
    x = torch.empty(0, device=device)
    if _cpu(x, "gguf_linear") is not None:
        return f"C ({cpu.library()[1]})"
    return "torch reference"
