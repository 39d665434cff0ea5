"""--gpu-layers as one value: how much of a model sits on the GPU, counted as llama.cpp counts it.

A number N puts the last N layers on the GPU, and N > n_layer the output head too (the native
backend puts the head there with any layer, and at 0 where it fits: head_alone); "all" is every
layer and the head; "auto" fits the GPU's free memory (the backend's placement plan) once `resolve` knows the model and the backend.
`str()` gives the value as the user typed it; `n_gpu_layers` is llama.cpp's number (-1: all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from dsq.errors import DsqError


class NegativeGpuLayers(DsqError):
    """--gpu-layers below 0 (parse_for adds what fits to the hint)."""


@dataclass(frozen=True)
class GpuLayers:
    n: int = 0  # the last n layers on the GPU (n > n_layer: the output head too); -1: all of it
    auto: bool = False  # to be fitted to the GPU's free memory by resolve()
    head: str | None = field(default=None, compare=False)  # the plan's --head (auto, resolved): gpu, cpu or a share
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
            raise NegativeGpuLayers(f"--gpu-layers must be >= 0, got {n}", "use 'all' for every layer")
        return cls(n, text=text)

    def __str__(self) -> str:
        return self.text or ("auto" if self.auto else "all" if self.n < 0 else str(self.n))

    @property
    def n_gpu_layers(self) -> int:
        """llama.cpp's n_gpu_layers: N, or -1 for all."""
        if self.auto:
            raise ValueError("--gpu-layers auto is not resolved yet (GpuLayers.resolve)")
        return self.n

    def resolve(self, model: Path | None, ctx: int, backend: str = "native", experts: str = "gpu",
                tensor_split: list[float] | None = None) -> GpuLayers:
        """This value for the model file `model` (a GGUF, or an HF directory) on `backend`: 'auto' as
        the layer count that backend's placement plan picks for the GPU's free memory (0 without a
        GPU or without llama.cpp's GPU offload; every layer where no file is named; `experts`: where
        a MoE model's routed experts sit, runtime/experts.py), and a count past the model's layers
        and output head as all of it. Other values stay as they are."""
        if self.auto:
            if model is None:
                return GpuLayers(-1, text=self.text)
            plan = _plan_for(model, ctx, backend, experts)
            if plan is None:
                return GpuLayers(0, text=self.text)
            return GpuLayers(_layers_of(plan), text=self.text, head=plan.head)
        if model is not None and self.n > 0 and self.n > _n_layer(model):
            return GpuLayers(-1, text=self.text)
        return self

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

    def devices(self, n_layer: int, gpus, shares: list[float] | None = None):
        """(torch device per layer, of the output head) by split(): the GPU layers over `gpus` (one
        device, or a list of them) in contiguous ranges (divide_layers, by `shares`: a --tensor-split
        or each GPU's free memory; equal without), the head on the last GPU; gpus None or empty (no
        GPU): the CPU's."""
        import torch

        cpu = torch.device("cpu")
        gpus = [] if gpus is None else list(gpus) if isinstance(gpus, (list, tuple)) else [gpus]
        if not gpus:
            return [cpu] * n_layer, cpu
        on, head = self.split(n_layer)
        per_gpu = divide_layers(sum(on), shares or [1.0] * len(gpus))
        owner = [g for g, n in zip(gpus, per_gpu) for _ in range(n)]
        first = on.index(True) if any(on) else n_layer
        return [owner[i - first] if g else cpu for i, g in enumerate(on)], (last_gpu(gpus, shares) if head else cpu)


def divide_layers(k: int, shares: list[float]) -> list[int]:
    """How many of k contiguous GPU layers each GPU holds, in proportion to `shares`, as llama.cpp
    divides them: layer j (0..k-1) goes to the first GPU whose cumulative share passes j/k, so a
    layer that falls on a boundary goes to the earlier GPU."""
    total = float(sum(shares))
    if k <= 0 or total <= 0:
        return [0] * len(shares)
    ends, acc = [], 0.0
    for s in shares:
        acc += s
        ends.append(acc / total)
    counts = [0] * len(shares)
    for j in range(k):
        counts[next((d for d, e in enumerate(ends) if e > j / k), len(shares) - 1)] += 1
    return counts


def last_gpu(gpus: list, shares: list[float] | None = None):
    """The GPU the output head goes on: the last one with a share."""
    if shares:
        return [g for g, s in zip(gpus, shares) if s > 0][-1]
    return gpus[-1]


def parse_tensor_split(value: str | None, n_gpus: int | None = None) -> list[float] | None:
    """--tensor-split "3,1" (llama.cpp's spelling: each GPU's share of the GPU layers, in proportion)
    as numbers, checked (check_tensor_split); None for none."""
    if value is None or not str(value).strip():
        return None
    try:
        shares = [float(p) for p in str(value).split(",")]
    except ValueError:
        raise DsqError(f"--tensor-split takes numbers separated by commas, one per GPU, got {value!r}",
                       "e.g. --tensor-split 3,1") from None
    return check_tensor_split(shares, n_gpus, value)


def check_tensor_split(shares: list[float], n_gpus: int | None = None, text: str | None = None) -> list[float]:
    """Shares of a split over GPUs: finite, none below 0, one above 0, and (given `n_gpus`, the GPUs
    it is for) one per GPU."""
    shown = text if text is not None else ",".join(f"{s:g}" for s in shares)
    if any(not math.isfinite(s) or s < 0 for s in shares):
        raise DsqError(f"--tensor-split shares must be numbers of 0 or more, got {shown!r}", "e.g. --tensor-split 3,1")
    if not any(shares):
        raise DsqError(f"--tensor-split needs a share above 0, got {shown!r}", "e.g. --tensor-split 1,1")
    if n_gpus is not None and len(shares) != n_gpus:
        raise DsqError(f"--tensor-split has {len(shares)} share{'' if len(shares) == 1 else 's'}, for "
                       f"{n_gpus} GPU{'' if n_gpus == 1 else 's'} here",
                       f"give one share per GPU, e.g. --tensor-split {','.join(['1'] * n_gpus)}")
    return list(shares)


def visible_gpus() -> list:
    """The torch devices of the GPUs this process sees (CUDA_VISIBLE_DEVICES applies), in order:
    the devices the native runtime places layers on."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


def free_shares(gpus: list) -> list[float]:
    """Each GPU's free memory, the default proportions of a split over several GPUs."""
    import torch

    if len(gpus) < 2:
        return [1.0] * len(gpus)
    return [float(torch.cuda.mem_get_info(g)[0]) for g in gpus]


HEAD_PLACES = ("gpu", "cpu")


def parse_head(value: str | None) -> str:
    """--head: where a split model's output head runs: "gpu" (the default), "cpu", or the share of
    its rows on the GPU, a number between 0 and 1 (the rest in RAM), returned as written ("0.6")."""
    head = (value or "gpu").strip().lower()
    if head in HEAD_PLACES:
        return head
    try:
        share = float(head.rstrip("%")) / (100 if head.endswith("%") else 1)
    except ValueError:
        share = -1.0
    if not 0 < share < 1:
        raise DsqError(f"--head takes gpu, cpu or a share of its rows for the GPU between 0 and 1, got {value!r}",
                       "gpu reads it from VRAM; cpu leaves that VRAM free; 0.6 puts 60% of its rows in VRAM")
    return head_arg(share)


def head_share(head: str) -> float:
    """The share of the output head's rows a parsed --head puts on the GPU of a split."""
    return 1.0 if head == "gpu" else 0.0 if head == "cpu" else float(head)


def head_alone(gpu_layers: GpuLayers, gpus, head: str) -> bool:
    """Whether the native runtime puts the output head's rows (a parsed --head) on a GPU with no
    layer there: --gpu-layers 0 on a machine with a GPU, unless --head cpu (placement.split_head
    picks the default)."""
    return bool(gpus) and gpu_layers.n_gpu_layers == 0 and head != "cpu"


def head_arg(share: float) -> str:
    """The --head that puts `share` of the head's rows on the GPU (head_share's inverse)."""
    return "gpu" if share == 1 else "cpu" if share == 0 else f"{share:g}"


GpuLayers.NONE = GpuLayers(0, text="0")
GpuLayers.ALL = GpuLayers(-1, text="all")


def _n_layer(model: Path) -> int:
    from dsq.runtime.model_shape import n_layer_of

    return n_layer_of(model)


def _plan_for(model: Path, ctx: int, backend: str, experts: str = "gpu", tensor_split: list[float] | None = None):
    """`backend`'s placement plan for the GPUs' free memory (each one's, over several; nominal
    bandwidths: the choice hardly depends on them, and nothing is measured at load); None without
    a GPU it can use."""
    from dsq.runtime.machine import machine_bandwidths
    from dsq.runtime.placement import detect_gpu, detect_gpus, plan_placement

    gpu = detect_gpu()
    if gpu is None or (backend == "llama.cpp" and not _llama_cpp_offloads()):
        return None
    gpus = detect_gpus()
    several = len(gpus) > 1
    return plan_placement(model, vram=[g.free_bytes for g in gpus] if several else gpu.free_bytes, ctx=ctx,
                          backend=backend, bandwidths=machine_bandwidths(gpu, measure=False), experts=experts,
                          tensor_split=tensor_split if several else None)


def _planned_layers(model: Path, ctx: int, backend: str, experts: str = "gpu") -> int:
    """The --gpu-layers count of `backend`'s placement plan for this GPU's free memory (0 without one)."""
    plan = _plan_for(model, ctx, backend, experts)
    return 0 if plan is None else _layers_of(plan)


def _layers_of(plan) -> int:
    """A plan's --gpu-layers count (-1: all of it)."""
    return -1 if plan.gpu_layers_arg == "all" else plan.gpu_layers


def _llama_cpp_offloads() -> bool:
    from dsq.runtime.llama_cpp_backend import supports_gpu_offload

    return supports_gpu_offload()


def gpu_usable(backend: str) -> bool:
    """Whether `backend` can put layers on a GPU here (there is one, and for llama.cpp a build with
    GPU offload)."""
    from dsq.runtime.placement import detect_gpu

    if detect_gpu() is None:
        return False
    return backend == "native" or _llama_cpp_offloads()


def parse_for(value: GpuLayers | str | int | None, model: Path | None, ctx: int, backend: str) -> GpuLayers:
    """GpuLayers.parse, where a negative count's error also says what fits this GPU for `model`."""
    try:
        return GpuLayers.parse(value)
    except NegativeGpuLayers as e:
        raise NegativeGpuLayers(e.message, f"use 'all' or 'auto'; {_what_fits(model, ctx, backend)}") from None


def _what_fits(model: Path | None, ctx: int, backend: str) -> str:
    """How many layers this machine's GPU holds for `model`, in words."""
    from dsq.runtime.placement import MiB, detect_gpu

    gpu = detect_gpu()
    if gpu is None:
        return "there is no GPU here, so every layer runs on the CPU"
    if backend == "llama.cpp" and not _llama_cpp_offloads():
        return "this llama.cpp build has no GPU support, so every layer runs on the CPU"
    free = f"with this GPU's free memory ({gpu.free_bytes / MiB:.0f} MiB)"
    if model is None:
        return f"{free} 'auto' picks the count"
    n = _planned_layers(model, ctx, backend)
    if n == 0:
        return f"{free} no layer fits, so 'auto' keeps them on the CPU"
    return f"{free} {'every layer fits' if n < 0 else f'about {n} of {_n_layer(model)} layers fit'}"
