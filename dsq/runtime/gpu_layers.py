"""--gpu-layers as one value: how much of a model sits on the GPU, counted as llama.cpp counts it.

A number N puts the last N layers on the GPU, and N > n_layer the output head too; "all" is every
layer and the head; "auto" fits the GPU's free memory (the placement plan) once `resolve` knows the
model. `str()` gives the value as the user typed it; `n_gpu_layers` is llama.cpp's number (-1: all).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from dsq.errors import DsqError


@dataclass(frozen=True)
class GpuLayers:
    n: int = 0  # the last n layers on the GPU (n > n_layer: the output head too); -1: all of it
    auto: bool = False  # to be fitted to the GPU's free memory by resolve()
    text: str = field(default="", compare=False, repr=False)  # as the user typed it

    NONE: ClassVar[GpuLayers]
    ALL: ClassVar[GpuLayers]

    @classmethod
    def parse(cls, value: GpuLayers | str | int | None) -> GpuLayers:
        """A number, 'all' or 'auto' (text), or an int from a program (negative: all)."""
        if isinstance(value, GpuLayers):
            return value
        if value is None:
            return cls.NONE
        if isinstance(value, int):
            return cls(max(value, -1), text=str(value))
        return cls._parse_text(str(value))

    @classmethod
    def _parse_text(cls, value: str) -> GpuLayers:
        text = value.strip()
        word = text.lower()
        if word in ("all", "auto"):
            return cls(-1 if word == "all" else 0, auto=word == "auto", text=text)
        try:
            n = int(word)
        except ValueError:
            raise DsqError(f"--gpu-layers takes a number, 'all' or 'auto', got {value!r}") from None
        if n < 0:
            raise DsqError(f"--gpu-layers must be >= 0, got {n}", "use 'all' for every layer")
        return cls(n, text=text)

    def __str__(self) -> str:
        return self.text or ("auto" if self.auto else "all" if self.n < 0 else str(self.n))

    @property
    def n_gpu_layers(self) -> int:
        """llama.cpp's n_gpu_layers: N, or -1 for all."""
        if self.auto:
            raise ValueError("--gpu-layers auto is not resolved yet (GpuLayers.resolve)")
        return self.n

    def resolve(self, gguf: Path | None, ctx: int) -> GpuLayers:
        """'auto' as a layer count: the placement plan of the GGUF `gguf` for the GPU's free memory
        (0 without a GPU or without llama.cpp's GPU offload); every layer where there is no GGUF to
        plan (HF weights on the native backend). Any other value stays as it is."""
        if not self.auto:
            return self
        if gguf is None:
            return GpuLayers(-1, text=self.text)
        return GpuLayers(_planned_layers(gguf, ctx), text=self.text)

    def on(self, gpu: object | None) -> GpuLayers:
        """What this becomes on a machine whose GPU is `gpu`: without one, nothing is placed on it
        (0 layers, silently: the native backend then runs on the CPU)."""
        return self if gpu is not None else GpuLayers(0, text=self.text)

    def count(self, n_layer: int) -> int:
        """How many of the n_layer + 1 parts (the layers, then the output head) sit on the GPU."""
        return n_layer + 1 if self.n_gpu_layers < 0 else min(self.n_gpu_layers, n_layer + 1)

    def split(self, n_layer: int) -> tuple[list[bool], bool]:
        """(on the GPU? per layer, is the output head?): the last count(n_layer) layers, and the head
        when the count passes n_layer."""
        k = self.count(n_layer)
        return [i >= n_layer - min(k, n_layer) for i in range(n_layer)], k > n_layer

    def devices(self, n_layer: int, gpu):
        """(torch device per layer, of the output head) by split(); gpu None (no GPU): the CPU's."""
        import torch

        cpu = torch.device("cpu")
        on, head = self.split(n_layer) if gpu is not None else ([False] * n_layer, False)
        return [gpu if g else cpu for g in on], (gpu if head else cpu)


GpuLayers.NONE = GpuLayers(0, text="0")
GpuLayers.ALL = GpuLayers(-1, text="all")


def _planned_layers(gguf: Path, ctx: int) -> int:
    from dsq.runtime.llama_cpp_backend import supports_gpu_offload
    from dsq.runtime.placement import detect_gpu, plan_placement

    gpu = detect_gpu()
    if gpu is None or not supports_gpu_offload():
        return 0
    return plan_placement(gguf, vram=gpu.free_bytes, ctx=ctx).gpu_layers
