"""Where a model's VRAM goes at load: what torch's allocator holds (allocated, and reserved: its
cache of freed blocks counted in), against the device's used memory, at the peak and after load,
for one placement. A reserved peak well above the allocated one is fragmentation (blocks freed but
held in segments that live tensors still share); run it again with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to see what that changes.

    python -m benchmarks.load_vram MODEL.gguf [--gpu-layers all] [--experts gpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--gpu-layers", default="all")
    ap.add_argument("--experts", default=None)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import torch

    from dsq.bench.metrics import PeakMemory, gpu_used_bytes
    from dsq.runtime.engine import load

    mib = lambda b: round(b / 2**20)  # noqa: E731
    torch.zeros(1, device="cuda")  # the context first: the figures below are above it
    base = gpu_used_bytes()
    kw = {"experts": a.experts} if a.experts else {}
    with PeakMemory(baseline_gpu=base) as mem:
        nm = load(a.model, backend="native", ctx=a.ctx, gpu_layers=a.gpu_layers, **kw)
    torch.cuda.synchronize()
    rec = {"model": a.model, "gpu_layers": a.gpu_layers, "experts": a.experts,
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
           "file_mib": mib(os.path.getsize(a.model)),
           "peak_allocated_mib": mib(torch.cuda.max_memory_allocated()),
           "peak_reserved_mib": mib(torch.cuda.max_memory_reserved()),
           "peak_device_mib": mib(mem.peak_gpu or 0),
           "allocated_mib": mib(torch.cuda.memory_allocated()),
           "reserved_mib": mib(torch.cuda.memory_reserved()),
           "device_mib": mib((gpu_used_bytes() or 0) - (base or 0))}
    for k, v in rec.items():
        print(f"{k:>20}: {v}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rec, f, indent=1)
    del nm


if __name__ == "__main__":
    main()
