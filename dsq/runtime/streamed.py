"""Prefill of a model's CPU layers on the GPU, with their weights streamed over (a split model's,
or a CPU model's on a machine with a GPU, as llama.cpp does with --gpu-layers 0).

A prompt chunk of many tokens makes the CPU layers compute-bound: the GPU multiplies faster than
the CPU even counting the copy of each layer's weights to it. So from `STREAM_MIN_ROWS` tokens,
each CPU layer's weights are copied to the GPU (from pinned memory, the next layer's while this
one computes), turned into the GPU kernels' layout, run over the chunk and dropped; the layer's
new keys and values go back to its cache on the CPU, where decode reads them. llama.cpp offloads
large batches the same way. Below the threshold the CPU's own M > 1 kernels run the chunk.
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

# From this many tokens a chunk streams the CPU layers' weights to the GPU
# (docs/benchmarks.md#prefill); DSQ_STREAM_ROWS=N moves it, 0 turns streaming off.
_ENV = os.environ.get("DSQ_STREAM_ROWS", "").strip()
STREAM_MIN_ROWS = int(_ENV) if _ENV.isdigit() else 16
# Quantized modules staged on the GPU ahead of the one computing: the copy stream always has the
# next module queued while VRAM holds three modules, not two layers (docs/benchmarks.md#split-between-gpu-and-cpu)
STREAM_AHEAD = 2


def _tensors(m: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor, bool]]:
    """(owner module, name, tensor, is a parameter) for every parameter and buffer under m."""
    out = []
    for mod in m.modules():
        out += [(mod, n, t, True) for n, t in mod._parameters.items() if t is not None]
        out += [(mod, n, t, False) for n, t in mod._buffers.items() if t is not None]
    return out


def pin_layers(layers: list[nn.Module]) -> bool:
    """Move the layers' tensors into pinned (page-locked) host memory, which the GPU copies from
    at full speed; returns False (tensors left as they were) where pinning fails."""
    try:
        for mod, name, t, is_param in [x for layer in layers for x in _tensors(layer)]:
            if t.is_pinned():
                continue
            p = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            p.copy_(t)
            if is_param:
                mod._parameters[name] = nn.Parameter(p, requires_grad=False)
            else:
                mod._buffers[name] = p
    except RuntimeError:  # no room to pin: the copies run from pageable memory, slower
        return False
    return True


class _LayerCache:
    """One layer's keys and values on the GPU for a streamed chunk: the cached prefix, then the
    chunk's (what Attention.forward writes through `update`)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
        self.k.index_copy_(2, slots, k.to(self.k.dtype))
        self.v.index_copy_(2, slots, v.to(self.v.dtype))
        return self.k, self.v


class StreamedLayers:
    """Runs the first `n` (CPU) layers of `model` on `gpu` for prompt chunks (see the module).

    A layer's quantized modules are staged one at a time, in the order the layers call them, up to
    STREAM_AHEAD ahead of the one computing: the GPU holds a few modules' kernel layouts, not two
    whole layers', and the CPU waits for a module's compute to end before staging past that
    window. Everything else of a layer (norms, biases) is copied with the layer's GPU twin."""

    def __init__(self, model, n: int, gpu: torch.device, dtype: torch.dtype):
        self.model, self.n, self.gpu, self.dtype = model, n, gpu, dtype
        self.layers = list(model.model.layers[:n])
        self.pinned = pin_layers(self.layers)
        self.copies = torch.cuda.Stream(gpu)
        # the quantized modules of every layer, in staging order: (layer, name); by name until the
        # first layer has run, then in the order that layer called them (fusing renames and reorders)
        self.order = [(i, name) for i, layer in enumerate(self.layers) for name, m in layer.named_modules()
                      if name and hasattr(m, "kernel_module") and not _under_streamed(layer, name)]
        self._calls: list[str] | None = []  # the names the first layer called, in order (None: learned)
        self._ready: dict[tuple[int, str], tuple[nn.Module, object]] = {}  # staged: (module, its event)
        self._staged: set[tuple[int, str]] = set()  # staged this chunk
        self._used: list = []  # compute-stream events of modules taken and not yet known finished, oldest first

    def _stage(self, i: int) -> tuple[nn.Module, object]:
        """Layer i's GPU twin, built on the copy stream: a structural copy of the CPU layer whose
        tensors are copied over (float ones in the GPU's dtype) and whose quantized modules are
        _Staged stand-ins, each fetching its module from the pipeline when called; the event marks
        the twin ready."""
        from dsq.runtime.qmodules import set_module

        layer = self.layers[i]
        twin = copy.deepcopy(layer, memo={id(t): t for _, _, t, _ in _tensors(layer)})  # shares the CPU tensors
        for key in [k for k in self.order if k[0] == i]:
            set_module(twin, key[1], _Staged(self, key, layer.get_submodule(key[1])))
        with torch.cuda.stream(self.copies):
            twin = self._to_gpu(twin)
            done = self._event()
        return twin, done

    def _to_gpu(self, twin: nn.Module) -> nn.Module:
        """twin (a structural copy sharing the CPU's tensors) with its tensors copied to the GPU and
        each quantized module turned into the GPU kernels' layout as soon as its blocks land, on the
        current (copy) stream. In stream order a module's blocks are freed before the next module's
        are copied, so a file's layout never fills the GPU beside its kernel layout."""
        from dsq.runtime.qmodules import set_module

        moved: dict[int, torch.Tensor] = {}
        for name in [n for n, _ in twin.named_modules()][::-1]:  # children before their parents
            mod = twin.get_submodule(name)  # by name: no list of the modules keeps a converted one alive
            if isinstance(mod, _Staged):
                continue
            for tensors, is_param in ((mod._parameters, True), (mod._buffers, False)):
                for n, t in list(tensors.items()):
                    if t is not None:
                        tensors[n] = moved[id(t)] if id(t) in moved else self._copy(t, is_param)
                        moved[id(t)] = tensors[n]
            if hasattr(mod, "_scaled"):
                mod._scaled = None  # a norm's cached float32 weight belongs to the CPU layer
            if hasattr(mod, "kernel_module"):
                new = mod.kernel_module()
                if not name:
                    return new
                if new is not mod:
                    set_module(twin, name, new)
                    moved.clear()  # what this module held goes with it
            del mod
        return twin

    def _stage_module(self, key: tuple[int, str]) -> None:
        """One quantized module of a CPU layer converted onto the GPU on the copy stream, once the
        CPU has waited for the oldest modules' compute until, with this one, at most STREAM_AHEAD
        are staged or still computing beside the one being taken."""
        while self._used and self._used[0].query():
            self._used.pop(0)
        while self._used and len(self._ready) + len(self._used) > STREAM_AHEAD - 1:
            self._used.pop(0).synchronize()
        src = self.layers[key[0]].get_submodule(key[1])
        with torch.cuda.stream(self.copies):
            mod = self._to_gpu(copy.deepcopy(src, memo={id(t): t for _, _, t, _ in _tensors(src)}))
            self._ready[key] = (mod, self._event())
        self._staged.add(key)

    def take(self, key: tuple[int, str]) -> nn.Module:
        """The staged GPU module for `key`, ready on the compute stream (staged now if it was not),
        with the STREAM_AHEAD modules after it staged."""
        if key not in self._ready:
            self._stage_module(key)
        mod, ev = self._ready.pop(key)
        if self._calls is not None and key[0] == 0:
            self._calls.append(key[1])
        self._on_compute(mod, ev)
        pos = self.order.index(key) if key in self.order else len(self.order)
        for k in self.order[pos + 1:pos + 1 + STREAM_AHEAD]:
            if self._calls is not None and k[0] != key[0]:
                break  # the next layer's order is known once this first one has run
            if k not in self._staged:
                self._stage_module(k)
        return mod

    def _learn_order(self) -> None:
        """After the first layer: stage every layer's modules in the order that layer called them."""
        rank = {name: j for j, name in enumerate(self._calls or [])}
        self.order.sort(key=lambda k: (k[0], rank.get(k[1], len(rank))))
        self._calls = None

    @staticmethod
    def _on_compute(mod: nn.Module, ready) -> None:
        """The compute stream waits for `ready`; mod's tensors, made on the copy stream, are not
        reused there until the compute stream is done with them."""
        compute = torch.cuda.current_stream()
        compute.wait_event(ready)
        for t in _tensors(mod):
            t[2].record_stream(compute)

    def used(self) -> None:
        """The module just run from take() is done with once the compute stream passes here."""
        self._used.append(self._event())

    def _event(self):
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def _copy(self, t: torch.Tensor, is_param: bool) -> torch.Tensor:
        g = t.to(self.gpu, non_blocking=True)
        if is_param and g.is_floating_point() and g.dtype != self.dtype:  # norms, biases, float weights
            g = g.to(self.dtype)
        return nn.Parameter(g, requires_grad=False) if is_param else g

    def run(self, x: torch.Tensor, slots: torch.Tensor, cache, pad: torch.Tensor, kv_len: int) -> torch.Tensor:
        """x (B, T, H) through layers 0..n-1 on the GPU; returns x there. Their new keys and values
        (slots) land in `cache` (on the CPU)."""
        x = x.to(self.gpu, self.dtype)
        slots_g, pad_g = slots.to(self.gpu), pad.to(self.gpu)
        memo: dict = {}
        self._ready.clear()
        self._staged.clear()
        self._used.clear()
        nxt = self._stage(0)
        for k in self.order[:STREAM_AHEAD]:  # the first layer's first modules start copying now
            self._stage_module(k)
        for i in range(self.n):
            twin, done = nxt
            if i + 1 < self.n:
                nxt = self._stage(i + 1)  # the next layer's copy overlaps this one's compute
            self._on_compute(twin, done)
            cos, sin, mask, sl = self.model.layer_context(i, self.gpu, slots_g, pad_g, kv_len, cache, memo)
            lc = self._layer_cache(cache, i, int(slots[0]), kv_len)
            x = twin(x, cos, sin, mask, lc, sl, kv_len)
            self._keep(cache, i, lc, int(slots[0]), kv_len)
            del twin
            if i == 0 and self._calls is not None:
                self._learn_order()
        self._used.clear()
        self._ready.clear()  # (modules staged and never called)
        return x

    def _layer_cache(self, cache, i: int, start: int, kv_len: int) -> _LayerCache:
        return _LayerCache(self._on_gpu(cache.k[i], start, kv_len), self._on_gpu(cache.v[i], start, kv_len))

    def _on_gpu(self, c: torch.Tensor, start: int, kv_len: int) -> torch.Tensor:
        """kv_len slots of a layer's keys or values (B, heads, S, width) on the GPU, the first
        `start` copied from the cache (widths differ: MLA's latent keys, its empty values)."""
        B, H, _, D = c.shape
        t = torch.empty(B, H, kv_len, D, dtype=self.dtype, device=self.gpu)
        if start:
            t[:, :, :start] = c[:, :, :start].to(self.gpu, non_blocking=True)
        return t

    @staticmethod
    def _keep(cache, i: int, lc: _LayerCache, start: int, kv_len: int) -> None:
        cache.k[i][:, :, start:kv_len] = lc.k[:, :, start:kv_len].to("cpu", cache.k[i].dtype)
        cache.v[i][:, :, start:kv_len] = lc.v[:, :, start:kv_len].to("cpu", cache.v[i].dtype)


def _under_streamed(layer: nn.Module, name: str) -> bool:
    """Whether `name` sits inside another quantized module of the layer (which is staged whole)."""
    parts = name.split(".")
    return any(hasattr(layer.get_submodule(".".join(parts[:k])), "kernel_module") for k in range(1, len(parts)))


class _Staged(nn.Module):
    """Stands in a streamed layer's GPU twin for one of its quantized modules: called, it takes the
    module's GPU kernel layout from the StreamedLayers pipeline, runs it and lets it go. Other
    attributes are the CPU module's (its shape, its type's flags)."""

    def __init__(self, pipe: StreamedLayers, key: tuple[int, str], cpu: nn.Module):
        super().__init__()
        object.__setattr__(self, "_pipe", pipe)
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_cpu", cpu)

    def forward(self, *args, **kwargs):
        mod = self._pipe.take(self._key)
        out = mod(*args, **kwargs)
        del mod
        self._pipe.used()
        return out

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_cpu"), name)
