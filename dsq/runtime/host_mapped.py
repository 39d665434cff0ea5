"""Tensors a GPU reads straight from pinned host memory.

On a machine with unified virtual addressing (every 64-bit CUDA system), page-locked host memory
made by cudaHostAlloc (torch's pinned memory) is addressable by kernels at its host address. A
CUDA tensor over that address costs no VRAM; each read crosses PCIe. That suits the token
embedding: a token reads one row (a few KB) of a table of hundreds of MB, so llama.cpp keeps it
on the CPU. Here it stays on the GPU's side of the step (the captured decode step looks it up
from the sampled token without a trip to the host) while its table stays in RAM.
DSQ_HOST_EMBED=0 keeps the table in VRAM instead.
"""

from __future__ import annotations

import os

import torch
from torch import nn


class _Interface:
    """What torch.as_tensor reads (__cuda_array_interface__); holds the pinned tensor alive."""

    def __init__(self, pinned: torch.Tensor):
        self.pinned = pinned
        self.__cuda_array_interface__ = {"shape": (pinned.numel() * pinned.element_size(),), "typestr": "|u1",
                                         "data": (pinned.data_ptr(), False), "version": 3, "strides": None}


def host_mapped(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t's values in pinned host memory, as a tensor on CUDA `device` that reads them there.
    Raises RuntimeError where the memory cannot be pinned or mapped."""
    pinned = t.detach().to("cpu").contiguous().pin_memory()
    with torch.cuda.device(device):
        flat = torch.as_tensor(_Interface(pinned), device=device)
    if flat.data_ptr() != pinned.data_ptr() or flat.device.type != "cuda":
        raise RuntimeError("pinned memory is not mapped at its host address")
    return flat.view(t.dtype).reshape(t.shape)


def map_embedding(embed: nn.Module, device: torch.device) -> bool:
    """Each tensor of the embedding module (GGUF blocks, or a float weight) replaced by its
    host-mapped twin on `device`; False (the module left as it was) where mapping fails or
    DSQ_HOST_EMBED=0."""
    if os.environ.get("DSQ_HOST_EMBED", "").strip() == "0":
        return False
    try:
        mapped = {n: host_mapped(t, device) for n, t in list(embed.named_parameters(recurse=False))
                  + list(embed.named_buffers(recurse=False))}
    except (RuntimeError, TypeError, ValueError):  # no room to pin, or no mapping at the host address
        return False
    for n, t in mapped.items():
        if n in embed._parameters:
            embed._parameters[n] = nn.Parameter(t, requires_grad=False)
        else:
            embed._buffers[n] = t
    return True
