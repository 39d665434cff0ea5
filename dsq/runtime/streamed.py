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
    """Runs the first `n` (CPU) layers of `model` on `gpu` for prompt chunks (see the module)."""

    def __init__(self, model, n: int, gpu: torch.device, dtype: torch.dtype):
        self.model, self.n, self.gpu, self.dtype = model, n, gpu, dtype
        self.layers = list(model.model.layers[:n])
        self.pinned = pin_layers(self.layers)
        self.copies = torch.cuda.Stream(gpu)

    def _stage(self, i: int) -> tuple[nn.Module, torch.cuda.Event]:
        """Layer i on the GPU, built on the copy stream: a structural copy of the CPU layer whose
        tensors are copied over (float ones in the GPU's dtype), each quantized module turned into
        the GPU kernels' layout as soon as its blocks land. In stream order a module's blocks are
        freed before the next module's are copied, so the file's layout of a layer never fills
        the GPU beside its kernel layout; the event marks the layer ready."""
        from dsq.runtime.qmodules import set_module

        layer = self.layers[i]
        twin = copy.deepcopy(layer, memo={id(t): t for _, _, t, _ in _tensors(layer)})  # shares the CPU tensors
        moved: dict[int, torch.Tensor] = {}
        with torch.cuda.stream(self.copies):
            for name in [n for n, _ in twin.named_modules()][::-1]:  # children before their parents
                mod = twin.get_submodule(name)  # by name: no list of the modules keeps a converted one alive
                for tensors, is_param in ((mod._parameters, True), (mod._buffers, False)):
                    for n, t in list(tensors.items()):
                        if t is not None:
                            tensors[n] = moved[id(t)] if id(t) in moved else self._copy(t, is_param)
                            moved[id(t)] = tensors[n]
                if hasattr(mod, "_scaled"):
                    mod._scaled = None  # a norm's cached float32 weight belongs to the CPU layer
                if name and hasattr(mod, "kernel_module"):
                    new = mod.kernel_module()
                    if new is not mod:
                        set_module(twin, name, new)
                        moved.clear()  # what this module held goes with it
                del mod
            done = torch.cuda.Event()
            done.record()
        return twin, done

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
        nxt = self._stage(0)
        for i in range(self.n):
            twin, done = nxt
            if i + 1 < self.n:
                nxt = self._stage(i + 1)  # the next layer's copy overlaps this one's compute
            compute = torch.cuda.current_stream()
            compute.wait_event(done)
            for t in _tensors(twin):
                t[2].record_stream(compute)  # made on the copy stream: not reused there until compute is done
            cos, sin, mask, sl = self.model.layer_context(i, self.gpu, slots_g, pad_g, kv_len, cache, memo)
            lc = self._layer_cache(cache, i, int(slots[0]), kv_len)
            x = twin(x, cos, sin, mask, lc, sl, kv_len)
            self._keep(cache, i, lc, int(slots[0]), kv_len)
            del twin
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
