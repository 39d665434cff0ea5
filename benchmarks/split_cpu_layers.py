"""Do a split model's CPU layers decode slower than an all-CPU model's, and why?

    python -m benchmarks.split_cpu_layers MODEL.gguf [--gpu-layers 0,8] [--threads N] [--repeat 20]

For the GGUF loaded at each --gpu-layers, times the CPU layers of one decode step by themselves
(forward_layers over layers 0..n_cpu-1, one token at a fixed cache slot, nothing else of the step):
the one-call C layers back to back and after 3 ms idle (as the split step's GPU part leaves the
CPU), and op by op, each with the weights as loaded (pinned for the streamed prefill where a GPU
is present) and copied into ordinary pageable memory. Prints ms per layer and the GB/s of the
layers' weight bytes, so the variants compare across splits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _weight_bytes(layers) -> int:
    return sum(t.numel() * t.element_size() for layer in layers for t in list(layer.parameters()) + list(layer.buffers()))


def _time(m, n: int, repeat: int, gap: float = 0.0) -> float:
    """Median seconds of forward_layers over the first n layers, one token at slot 40, each call
    `gap` seconds after the last (the split step's GPU part leaves the CPU idle that long)."""
    model = m.model
    x = model.embed(torch.tensor([[1]]))
    slots, pad = torch.tensor([40]), torch.zeros(1, dtype=torch.long)
    ts = []
    for i in range(repeat + 3):
        if gap:
            time.sleep(gap)
        t = time.perf_counter()
        model.forward_layers(x, 0, n, slots, m.cache, pad, 41)
        if i >= 3:
            ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _unpin(layers) -> int:
    """Copy the layers' pinned tensors into pageable memory; returns how many were pinned."""
    from torch import nn

    from dsq.runtime.streamed import _tensors

    moved = 0
    for layer in layers:
        for mod, name, t, is_param in _tensors(layer):
            if not t.is_pinned():
                continue
            c = torch.empty(t.shape, dtype=t.dtype)
            c.copy_(t)
            if is_param:
                mod._parameters[name] = nn.Parameter(c, requires_grad=False)
            else:
                mod._buffers[name] = c
            moved += 1
    return moved


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--gpu-layers", default="0,8")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    import dsq
    from dsq.runtime import fused_layer

    rows = []
    for g in [x.strip() for x in a.gpu_layers.split(",") if x.strip()]:
        m = dsq.load(a.model, backend="native", gpu_layers=g, threads=a.threads, ctx=128)
        devs = [str(d) for d in m.model.layer_devices()]
        n = devs.count("cpu")
        layers = list(m.model.model.layers[:n])
        gb = _weight_bytes(layers) / 1e9
        with torch.inference_mode():
            for memory in ("as loaded", "pageable"):
                if memory == "pageable":
                    pinned = _unpin(layers)
                    fused_layer.attach(m.model)  # the descriptors point at the new copies
                for variant in ("one call", "one call, 3 ms idle before", "op by op"):
                    fused = m.model._fused_decode
                    if variant == "op by op":
                        m.model._fused_decode = None
                    s = _time(m, n, a.repeat, 0.003 if "idle" in variant else 0.0)
                    m.model._fused_decode = fused
                    row = {"gpu_layers": g, "cpu_layers": n, "memory": memory, "variant": variant,
                           "ms_per_layer": round(1e3 * s / n, 3), "gb_s": round(gb / s, 1),
                           "fused_layers": sum(f is not None for f in fused.layers) if fused else 0}
                    if memory == "pageable":
                        row["tensors_unpinned"] = pinned
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        del m, layers
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
