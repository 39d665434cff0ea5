"""The GPU kernels a model's greedy decode spends its time in: torch.profiler over --steps decode
tokens (the captured step where the runtime captures one), after a warm-up generation, sorted by
GPU time; then the decode rate of a plain run for reference.

    python -m benchmarks.decode_profile MODEL.gguf [--gpu-layers all] [--experts gpu] [--steps 8] [--rows 24]
"""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--gpu-layers", default="all")
    ap.add_argument("--experts", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rows", type=int, default=24, help="kernels listed")
    a = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.split_profile import _decode_rate
    from dsq.runtime.engine import load
    from dsq.runtime.generate import GenStats
    from dsq.runtime.sampling import SamplingParams

    kw = {"experts": a.experts} if a.experts else {}
    m = load(a.model, backend="native", ctx=1024, gpu_layers=a.gpu_layers, threads=a.threads, **kw)
    V = m.model.args.vocab_size
    prompt = [(j * 104729 + 1) % V for j in range(a.prompt_tokens)]
    rate = _decode_rate(m, prompt, a.steps + 8)  # warms up (and captures) too
    m.reset()
    gen = m.stream(prompt, SamplingParams(temperature=0), a.steps + 2, GenStats(), ignore_eos=True)
    next(gen)  # the prefill's token: outside the profile
    next(gen)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for _ in gen:
            pass
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(f"{a.model}: decode {rate:.1f} tok/s; the profile's {a.steps} decode steps by {key}:")
    print(prof.key_averages().table(sort_by=key, row_limit=a.rows, max_name_column_width=90))


if __name__ == "__main__":
    main()
