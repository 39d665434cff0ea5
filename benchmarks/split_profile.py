"""Where a decode step's time goes when a model is split between the GPU and the CPU.

    python -m benchmarks.split_profile MODEL.gguf --gpu-layers 0,8,16,24,all [--threads N] [--head cpu] [--json out.json]

For each split: tok/s over a short greedy decode, then one profiled step of the same decode
(torch profiler, CPU and CUDA activities): the top ops by self CPU time, and wall time per decoder
layer and for the head, measured with a device sync around each (so the per-layer figures add the
syncs' cost; the tok/s figure has none); the same for the prompt's prefill, beside its whole wall
time. The per-layer and per-kernel figures are of the op-by-op step (hooks and kernel wrappers do
not see inside the one C call a covered CPU layer otherwise makes: dsq/runtime/fused_layer.py;
`python -m benchmarks.layer_decode` times that call); tok/s is the default step's.
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


def timing_hooks(mods: list) -> tuple[dict[str, list[float]], list]:
    """Forward hooks on each (name, module) that record its wall ms per call into marks[name], a
    device sync before and after; returns (marks, the hook handles to remove)."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    marks: dict[str, list[float]] = {}
    t0: dict[str, float] = {}

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

    hooks = [h for name, mod in mods for h in (mod.register_forward_pre_hook(pre(name)),
                                                mod.register_forward_hook(post(name)))]
    return marks, hooks


def _layer_times(m, prompt: list[int], steps: int = 3) -> dict:
    """Median wall ms per decoder layer (and head) over a few eager decode steps."""
    model = m.model
    mods = [(f"layer {i} ({next(layer.parameters(), next(layer.buffers())).device.type})", layer)
            for i, layer in enumerate(model.model.layers)] + [("head", model.lm_head), ("norm", model.model.norm)]
    marks, hooks = timing_hooks(mods)
    graph, m._graph = m._graph, None  # eager steps: hooks see each layer
    fused, m.model._fused_decode = m.model._fused_decode, None  # op by op: hooks see each CPU layer
    try:
        from dsq.runtime.generate import GenStats
        from dsq.runtime.sampling import SamplingParams

        m.reset()
        for _ in m.stream(prompt, SamplingParams(temperature=0), steps + 1, GenStats(), ignore_eos=True):
            pass
    finally:
        m._graph = graph
        m.model._fused_decode = fused
        for h in hooks:
            h.remove()
    # the first entry of each is the prefill's: kept apart as "prefill <name>"
    out = {k: statistics.median(v[1:]) for k, v in marks.items() if len(v) > 1}
    return out | {f"prefill {k}": v[0] for k, v in marks.items() if v}


def _prefill_ms(m, prompt: list[int]) -> float:
    """Median wall ms of the prompt's prefill (the default path, synced), over three runs."""
    import torch

    from dsq.runtime.generate import GenStats
    from dsq.runtime.sampling import SamplingParams

    times = []
    for _ in range(3):
        m.reset()
        st = GenStats()
        for _ in m.stream(prompt, SamplingParams(temperature=0), 1, st, ignore_eos=True):
            pass
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(1e3 * len(prompt) / st.prefill_tok_s)
    return statistics.median(times)


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


def _kernel_times(m, prompt: list[int], steps: int = 4) -> dict:
    """Over a few decode steps: wall time inside each C kernel call (by kernel and weight shape,
    with the GB/s of the weight bytes for the GEMVs), and the step's time outside them."""
    from contextlib import ExitStack
    from unittest import mock

    from dsq.kernels import cpu
    from dsq.runtime.generate import GenStats
    from dsq.runtime.sampling import SamplingParams

    acc: dict[str, list[float]] = {}

    def wrap(name, fn):
        def timed(*args, **kw):
            t = time.perf_counter()
            out = fn(*args, **kw)
            dt = time.perf_counter() - t
            key = name
            if name == "gguf_linear":
                raw = args[1]
                key = f"gguf {args[2]} {raw.shape[0]}x{args[3]} ({raw.numel() / 1e6:.1f} MB)"
            acc.setdefault(key, []).append(dt)
            return out
        return timed

    names = ["gguf_linear", "int_linear", "fp8_linear", "rms_norm", "attn_step", "attn_decode"]
    fused, m.model._fused_decode = m.model._fused_decode, None  # op by op: each kernel call seen
    m.reset()
    for _ in m.stream(prompt, SamplingParams(temperature=0), 2, GenStats(), ignore_eos=True):
        pass
    with ExitStack() as stack:
        for n in names:
            stack.enter_context(mock.patch.object(cpu, n, wrap(n, getattr(cpu, n))))
        m.reset()
        st = GenStats()
        for _ in m.stream(prompt, SamplingParams(temperature=0), steps + 1, st, ignore_eos=True):
            pass
    m.model._fused_decode = fused
    per_step = {k: 1e3 * sum(v) / (steps + 1) for k, v in acc.items()}  # prefill included once: small
    out = {k: round(v, 3) for k, v in sorted(per_step.items(), key=lambda kv: -kv[1])}
    gb = {k: round(float(k.split("(")[1].split(" MB")[0]) / 1e3 / (statistics.median(acc[k])), 1)
          for k in acc if k.startswith("gguf")}
    return {"ms_per_step": out, "gemv_gb_s": gb, "step_ms": round(1e3 / st.decode_tok_s, 2)}


def _split_parts(m, prompt: list[int], steps: int = 12) -> dict:
    """Median ms per decode token of the split step's parts, as it runs (the one-call CPU layers
    included): the CPU layers (forward_layers), the GPU part (the graph's replay, synced), a head
    in RAM (--head cpu), the whole step (_decode, synced), and the token (GenStats) less the step:
    sampling, detokenizing, the generation loop."""
    import torch

    from dsq.runtime.generate import GenStats
    from dsq.runtime.sampling import SamplingParams

    s = m._split
    if s is None:
        return {}
    acc: dict[str, list[float]] = {"cpu_layers": [], "gpu_part": [], "step": []}

    def timed(name, fn, sync=False):
        def run(*args, **kw):
            t = time.perf_counter()
            out = fn(*args, **kw)
            if sync:
                torch.cuda.synchronize()
            acc[name].append(1e3 * (time.perf_counter() - t))
            return out
        return run

    class Replay:
        replay = staticmethod(timed("gpu_part", s.graph.replay, sync=True))

    graph, fl = s.graph, m.model.forward_layers
    s.graph, m.model.forward_layers = Replay(), timed("cpu_layers", fl)
    m._decode = timed("step", type(m)._decode.__get__(m), sync=True)
    if s.head_on_cpu:  # --head cpu: the head on the CPU after the replay (the final norm is in it)
        acc["cpu_head"] = []
        m.model.logits = timed("cpu_head", m.model.logits)
    try:
        m.reset()
        st = GenStats()
        for _ in m.stream(prompt, SamplingParams(temperature=0), steps + 1, st, ignore_eos=True):
            pass
    finally:
        s.graph = graph
        del m.model.forward_layers, m._decode
        m.model.__dict__.pop("logits", None)
    out = {k: round(statistics.median(v[1:] if k == "cpu_layers" else v), 3) for k, v in acc.items() if v}
    out["token"] = round(1e3 / st.decode_tok_s, 3)
    out["outside_step"] = round(out["token"] - out.get("step", 0.0), 3)
    return out


def _vram(m) -> dict:
    """GPU memory after loading, in GiB: weights and buffers on the GPU, the KV cache, what torch's
    allocator holds and reserves, and the device-wide figure (NVML, what dsq bench reports)."""
    import torch

    from dsq.bench.metrics import gpu_used_bytes

    if not torch.cuda.is_available():
        return {}
    gib = 2.0 ** 30
    on_gpu = lambda ts: sum(t.numel() * t.element_size() for t in ts if t.is_cuda)  # noqa: E731
    params = on_gpu(list(m.model.parameters()) + list(m.model.buffers()))
    kv = on_gpu(m.cache.k + m.cache.v)
    used = gpu_used_bytes()
    return {"weights_gib": round(params / gib, 3), "kv_gib": round(kv / gib, 3),
            "allocated_gib": round(torch.cuda.memory_allocated() / gib, 3),
            "reserved_gib": round(torch.cuda.memory_reserved() / gib, 3),
            "max_reserved_gib": round(torch.cuda.max_memory_reserved() / gib, 3),
            "device_used_gib": round(used / gib, 3) if used is not None else None}


def read_bandwidth(threads: int, gib: float = 4.0) -> float:
    """Bytes/s of a multi-threaded sum over a buffer far larger than the caches (the CPU's read
    bandwidth: decode reads each weight byte once per token)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    torch.set_num_threads(old)
    return x.numel() * 4 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--gpu-layers", default="0,8,16,24,all")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=16)
    ap.add_argument("--profile", action="store_true", help="print the torch profiler's top ops per split")
    ap.add_argument("--kernels", action="store_true", help="time each C kernel call of a few decode steps")
    ap.add_argument("--parts", action="store_true", help="time a split step's parts: CPU layers, GPU part, the rest")
    ap.add_argument("--head", choices=("gpu", "cpu"), default=None, help="where a split's output head runs")
    ap.add_argument("--bandwidth", default="", help="comma list of thread counts: CPU read bandwidth at each")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    for t in [int(x) for x in a.bandwidth.split(",") if x]:
        print(json.dumps({"threads": t, "cpu_read_gb_s": round(read_bandwidth(t) / 1e9, 1)}), flush=True)

    import dsq
    from dsq.bench.runner import bench_prompt

    rows = []
    for g in [x.strip() for x in a.gpu_layers.split(",") if x.strip()]:
        t = time.perf_counter()
        m = dsq.load(a.model, backend="native", gpu_layers=g, threads=a.threads,
                     ctx=a.prompt_tokens + a.gen_tokens + 16, head=a.head)
        load_s = time.perf_counter() - t
        prompt = bench_prompt(m, a.prompt_tokens)
        rate = _decode_rate(m, prompt, a.gen_tokens)
        fused, m.model._fused_decode = m.model._fused_decode, None
        rate_op = _decode_rate(m, prompt, a.gen_tokens) if fused is not None else rate
        m.model._fused_decode = fused
        layers = _layer_times(m, prompt)
        cpu = sum(v for k, v in layers.items() if "(cpu)" in k and not k.startswith("prefill"))
        gpu = sum(v for k, v in layers.items() if "(cuda)" in k and not k.startswith("prefill"))
        pre = {k: v for k, v in layers.items() if k.startswith("prefill")}
        prefill = {"cpu_layers_ms": sum(v for k, v in pre.items() if "(cpu)" in k),
                   "gpu_layers_ms": sum(v for k, v in pre.items() if "(cuda)" in k),
                   "head_ms": pre.get("prefill head", 0.0), "whole_ms": _prefill_ms(m, prompt)}
        row = {"gpu_layers": g, "decode_tok_s": round(rate, 2), "step_ms": round(1e3 / rate, 2), "load_s": round(load_s, 1),
               "fused_cpu_layers": getattr(m, "fused_layers", 0), "op_by_op_decode_tok_s": round(rate_op, 2),
               "threads": m.n_threads, "cpu_layers_ms": round(cpu, 2), "gpu_layers_ms": round(gpu, 2),
               "head_ms": round(layers.get("head", 0.0), 2),
               "prefill_ms": {k: round(v, 2) for k, v in prefill.items()}, **_vram(m),
               "layer_ms": {k: round(v, 3) for k, v in layers.items()}}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "layer_ms"}), flush=True)
        if a.profile:
            print(_profile(m, prompt), flush=True)
        if a.parts and m._split is not None:
            try:
                row["parts_ms"] = _split_parts(m, prompt)
            except Exception as e:  # noqa: BLE001 - a probe: the other figures still print
                row["parts_ms"] = {"error": f"{type(e).__name__}: {e}"}
            print(json.dumps({"gpu_layers": g, "parts_ms": row["parts_ms"]}), flush=True)
        if a.kernels:
            row["kernels"] = _kernel_times(m, prompt)
            print(json.dumps(row["kernels"], indent=1), flush=True)
        del m
    print(f"\n{'gpu layers':>10} {'tok/s':>8} {'step ms':>8} {'CPU layers ms':>14} {'GPU layers ms':>14} {'head ms':>8}"
          f" | prefill ms: {'whole':>7} {'CPU layers':>10} {'GPU layers':>10} {'head':>6}")
    for r in rows:
        p = r["prefill_ms"]
        print(f"{r['gpu_layers']:>10} {r['decode_tok_s']:8.2f} {r['step_ms']:8.2f} {r['cpu_layers_ms']:14.2f} "
              f"{r['gpu_layers_ms']:14.2f} {r['head_ms']:8.2f} | {'':11} {p['whole_ms']:7.1f} "
              f"{p['cpu_layers_ms']:10.1f} {p['gpu_layers_ms']:10.1f} {p['head_ms']:6.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
