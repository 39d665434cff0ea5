"""Where a decode step's time goes when a model is split between the GPU and the CPU.

    python -m benchmarks.split_profile MODEL.gguf --gpu-layers 0,8,16,24,all [--threads N] [--json out.json]

For each split: tok/s over a short greedy decode, then one profiled step of the same decode
(torch profiler, CPU and CUDA activities): the top ops by self CPU time, and wall time per decoder
layer and for the head, measured with a device sync around each (so the per-layer figures add the
syncs' cost; the tok/s figure has none).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def _decode_rate(m, prompt: list[int], n: int) -> float:
    from dsq.runtime.generate import GenStats
    from dsq.runtime.sampling import SamplingParams

    rates = []
    for _ in range(2):
        m.reset()
        st = GenStats()
        for _ in m.stream(prompt, SamplingParams(temperature=0), n, st, ignore_eos=True):
            pass
        rates.append(st.decode_tok_s)
    return rates[-1]


def _layer_times(m, prompt: list[int], steps: int = 3) -> dict:
    """Median wall ms per decoder layer (and head) over a few eager decode steps."""
    import torch

    model = m.model
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    marks: dict[str, list[float]] = {}
    t0 = {}

    def pre(name):
        def hook(mod, args):
            sync()
            t0[name] = time.perf_counter()
        return hook

    def post(name):
        def hook(mod, args, out):
            sync()
            marks.setdefault(name, []).append(1e3 * (time.perf_counter() - t0[name]))
        return hook

    mods = [(f"layer {i} ({next(layer.parameters(), next(layer.buffers())).device.type})", layer)
            for i, layer in enumerate(model.model.layers)] + [("head", model.lm_head), ("norm", model.model.norm)]
    hooks = [h for name, mod in mods for h in (mod.register_forward_pre_hook(pre(name)),
                                                mod.register_forward_hook(post(name)))]
    graph, m._graph = m._graph, None  # eager steps: hooks see each layer
    try:
        from dsq.runtime.generate import GenStats
        from dsq.runtime.sampling import SamplingParams

        m.reset()
        for _ in m.stream(prompt, SamplingParams(temperature=0), steps + 1, GenStats(), ignore_eos=True):
            pass
    finally:
        m._graph = graph
        for h in hooks:
            h.remove()
    # the first entry of each is the prefill
    return {k: statistics.median(v[1:]) for k, v in marks.items() if len(v) > 1}


def _profile(m, prompt: list[int]) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from dsq.runtime.generate import GenStats
    from dsq.runtime.sampling import SamplingParams

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    m.reset()
    with profile(activities=acts) as prof:
        for _ in m.stream(prompt, SamplingParams(temperature=0), 4, GenStats(), ignore_eos=True):
            pass
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--gpu-layers", default="0,8,16,24,all")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=16)
    ap.add_argument("--profile", action="store_true", help="print the torch profiler's top ops per split")
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    import dsq
    from dsq.bench.runner import bench_prompt

    rows = []
    for g in [x.strip() for x in a.gpu_layers.split(",") if x.strip()]:
        t = time.perf_counter()
        m = dsq.load(a.model, backend="native", gpu_layers=g, threads=a.threads,
                     ctx=a.prompt_tokens + a.gen_tokens + 16)
        load_s = time.perf_counter() - t
        prompt = bench_prompt(m, a.prompt_tokens)
        rate = _decode_rate(m, prompt, a.gen_tokens)
        layers = _layer_times(m, prompt)
        cpu = sum(v for k, v in layers.items() if "(cpu)" in k)
        gpu = sum(v for k, v in layers.items() if "(cuda)" in k)
        row = {"gpu_layers": g, "decode_tok_s": round(rate, 2), "step_ms": round(1e3 / rate, 2), "load_s": round(load_s, 1),
               "threads": m.n_threads, "cpu_layers_ms": round(cpu, 2), "gpu_layers_ms": round(gpu, 2),
               "head_ms": round(layers.get("head", 0.0), 2), "layer_ms": {k: round(v, 3) for k, v in layers.items()}}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "layer_ms"}), flush=True)
        if a.profile:
            print(_profile(m, prompt), flush=True)
        del m
    print(f"\n{'gpu layers':>10} {'tok/s':>8} {'step ms':>8} {'CPU layers ms':>14} {'GPU layers ms':>14} {'head ms':>8}")
    for r in rows:
        print(f"{r['gpu_layers']:>10} {r['decode_tok_s']:8.2f} {r['step_ms']:8.2f} {r['cpu_layers_ms']:14.2f} "
              f"{r['gpu_layers_ms']:14.2f} {r['head_ms']:8.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
