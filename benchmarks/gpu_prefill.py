"""Where a GPU prefill's time goes: one prompt chunk through the native model, timed and profiled.

    python -m benchmarks.gpu_prefill MODEL.gguf [--gpu-layers all] [--tokens 64] [--compile] [--no-profile]

Prints the wall ms of each of a few prefills of the same prompt (the first carries any autotuning),
then the top CUDA kernels and CPU ops of one profiled prefill.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    import torch

    import dsq

    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--gpu-layers", default="all")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-profile", action="store_true", help="only the wall times (e.g. to compare DSQ_* settings)")
    a = ap.parse_args()
    m = dsq.load(a.model, backend="native", gpu_layers=a.gpu_layers, threads=a.threads, compile=a.compile)
    ids = list(range(10, 10 + a.tokens))
    times = []
    for _ in range(5):
        m.reset()
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            m._prefill(ids, 0, m.cache, None)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    print(f"prefill {a.tokens} tokens, gpu layers {a.gpu_layers}: " + " ".join(f"{t:.1f}" for t in times)
          + f" ms -> {a.tokens / min(times) * 1e3:.0f} tok/s at best")
    if a.no_profile:
        return
    from torch.profiler import ProfilerActivity, profile

    m.reset()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, torch.inference_mode():
        m._prefill(ids, 0, m.cache, None)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
