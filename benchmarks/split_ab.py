"""dsq's native engine and llama.cpp's own `llama-bench` in turn, round after round, on one GGUF at
each placement, so that a change in the host's load falls on both alike (on the H200's host a
placement's decode moved 2x between two runs minutes apart: docs/benchmarks.md#does-a-split-beat-llamacpp-and-at-what-vram).
dsq is loaded once per placement in this process; each round runs one llama-bench (a process of
its own, `-r 1`: its load is not timed) and one dsq generation, the order swapped every other round.
Prints, per placement, each engine's median prefill and decode tok/s and the median and range of the
per-round ratios, the decode roofline (dsq bench's: the plan's bytes a token over the
calibrated bandwidths), and dsq's peak VRAM (dsq bench's measure, over its load, warm-up and one
generation: before any llama-bench process shares the GPU).

    python -m benchmarks.split_ab /tmp/r8b.gguf --llama-bench $LL/build/bin/llama-bench \\
        --splits 0,8,16,24 --head cpu --rounds 5 --threads 16 --json out.json
    python -m benchmarks.split_ab ... --splits 8,16,24 --head 0.2,0.3,0.5   # a share of the head's rows
                                                                            # in VRAM, one per split
    python -m benchmarks.split_ab /tmp/v2l.gguf --llama-bench ... --splits all --experts cpu \\
        --llama-args "-ot exps=CPU"        # V2-Lite with the routed experts in RAM

llama-bench runs with `-ngl` the split (`all`: 99), the same threads, prompt and generated tokens,
and --llama-args (default `-fa 1`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import time
from pathlib import Path


def llama_bench(exe: str, gguf: str, ngl: str, threads: int, prompt: int, gen: int,
                extra: list[str]) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one llama-bench run (-r 1)."""
    cmd = [exe, "-m", gguf, "-ngl", ngl, "-p", str(prompt), "-n", str(gen), "-r", "1", "-t", str(threads),
           "-o", "json", *extra]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300).stdout
    rows = json.loads(out)
    pre = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0)
    dec = next(r["avg_ts"] for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0)
    return float(pre), float(dec)


def _roofline(model: str, m, split: str, head: str | None, a, ctx: int) -> float | None:
    """dsq bench's decode roofline for this placement: the offload plan's bytes a token over this
    machine's calibrated bandwidths (`dsq offload --calibrate`); None without a calibration."""
    from dsq.bench.prediction import predicted_plans
    from dsq.runtime.machine import machine_bandwidths
    from dsq.runtime.placement import detect_gpu

    bw = machine_bandwidths(detect_gpu(), threads=a.threads, measure=False)
    if not bw.source.startswith("calibrated"):
        return None
    row = {"backend": "native", "gpu_layers": split, "gpu_layers_effective": m.gpu_layers.n_gpu_layers,
           "head": head or "gpu", "batch": 1}
    plan = predicted_plans(model, [row], ctx=ctx, kv_tokens=a.prompt_tokens + a.gen_tokens, bandwidths=bw,
                           experts=a.experts or "gpu")[("native", split)]
    return round(plan.roofline_tok_s, 2) if plan.roofline_tok_s else None


def _median_range(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a .gguf")
    ap.add_argument("--llama-bench", required=True, help="llama.cpp's llama-bench executable")
    ap.add_argument("--splits", default="0,8,16,24", help="--gpu-layers values (comma-separated; all = 99 layers)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--head", default=None, help="dsq's output head: gpu, cpu or a share of its rows in VRAM, one "
                    "for every split or one per split (llama.cpp keeps it in RAM below all layers: --head cpu is "
                    "its placement)")
    ap.add_argument("--experts", choices=["gpu", "cpu"], default=None, help="a MoE model's routed experts (dsq)")
    ap.add_argument("--llama-args", default="-fa 1", help="more llama-bench arguments (default: flash attention, "
                    "as the 8B race runs it; V2-Lite's: \"-ot exps=CPU\" or \"\")")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)

    from dsq.bench.metrics import PeakMemory, cuda_context_bytes, gpu_used_bytes, release_memory
    from dsq.bench.runner import _generate, _head_place, bench_ctx, bench_prompt
    from dsq.runtime.engine import load
    from dsq.runtime.generate import GenStats
    from dsq.runtime.gpu_layers import GpuLayers, parse_head
    from dsq.runtime.sampling import SamplingParams

    extra = shlex.split(a.llama_args)
    splits = a.splits.split(",")
    heads = [parse_head(h) for h in a.head.split(",")] if a.head else [None]
    if len(heads) not in (1, len(splits)):
        ap.error(f"--head: one value, or one per split ({len(splits)})")
    heads = heads * len(splits) if len(heads) == 1 else heads
    greedy = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
    results = []
    cuda_context_bytes()  # the CUDA context made before the first baseline, as dsq bench does: no split counts it
    for split, head in zip(splits, heads):
        ngl = "99" if split == "all" else split
        opts = {k: v for k, v in (("head", head), ("experts", a.experts)) if v}
        ctx = bench_ctx(None, a.prompt_tokens, a.gen_tokens)
        release_memory()
        base = gpu_used_bytes()
        with PeakMemory(baseline_gpu=base) as mem:  # dsq alone on the GPU: before any llama-bench
            m = load(a.model, backend="native", ctx=ctx, threads=a.threads, gpu_layers=GpuLayers.parse(split), **opts)
            prompt = [bench_prompt(m, a.prompt_tokens)]
            m.reset()
            _generate(m, prompt, greedy, 4)  # warm-up: autotuning, the captured step
            m.reset()
            _generate(m, prompt, greedy, a.gen_tokens)
        vram = None if mem.peak_gpu is None else round(mem.peak_gpu / 2**20)
        head = _head_place(m)  # as placed: without --head, dsq's default for this split
        roofline = _roofline(a.model, m, split, head, a, ctx)
        runs = {"dsq": [], "llama-bench": []}
        for r in range(a.rounds):
            for engine in (("dsq", "llama-bench") if r % 2 == 0 else ("llama-bench", "dsq")):
                if engine == "dsq":
                    st = GenStats()
                    m.reset()
                    _generate(m, prompt, greedy, a.gen_tokens, st)
                    runs["dsq"].append((st.prefill_tok_s, st.decode_tok_s))
                else:
                    runs["llama-bench"].append(llama_bench(a.llama_bench, a.model, ngl, a.threads, a.prompt_tokens,
                                                           a.gen_tokens, extra))
            print(f"-g {split} round {r + 1}/{a.rounds}: dsq {runs['dsq'][-1][1]:.2f}, llama-bench "
                  f"{runs['llama-bench'][-1][1]:.2f} tok/s decode", flush=True)
        del m
        row = {"split": split, "head": head, "runs": runs, "roofline_tok_s": roofline, "dsq_vram_mib": vram}
        for i, metric in enumerate(("prefill", "decode")):
            d = [x[i] for x in runs["dsq"]]
            ll = [x[i] for x in runs["llama-bench"]]
            row[metric] = {"dsq": statistics.median(d), "llama-bench": statistics.median(ll),
                           "ratio": _median_range([x / y for x, y in zip(d, ll)])}
        results.append(row)
        if a.json:  # after every placement: a run cut by its time limit keeps the placements it finished
            tmp = a.json.with_name(a.json.name + ".tmp")  # whole or not at all, even if killed mid-write
            tmp.write_text(json.dumps({"model": a.model, "args": vars(a) | {"json": str(a.json)},
                                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                       "results": results}, indent=1))
            tmp.replace(a.json)
    print(f"\n{a.model}: {a.prompt_tokens} prompt + {a.gen_tokens} generated tokens, {a.rounds} rounds, "
          f"{a.threads} threads, dsq experts {a.experts or 'default'}, llama-bench {a.llama_args}")
    print("| -g | dsq --head | llama-bench decode | dsq decode | ratio (median, range) | dsq % roofline | "
          "llama-bench prefill | dsq prefill | ratio (median, range) | dsq VRAM MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in results:
        d, p, roof = row["decode"], row["prefill"], row["roofline_tok_s"]
        pct = f"{100 * d['dsq'] / roof:.0f}% of {roof:.1f}" if roof else "(no calibration)"
        print(f"| {row['split']} | {row['head']} | {d['llama-bench']:.2f} | {d['dsq']:.2f} | {d['ratio'][0]:.2f}x "
              f"({d['ratio'][1]:.2f}-{d['ratio'][2]:.2f}) | {pct} | {p['llama-bench']:.1f} | {p['dsq']:.1f} | "
              f"{p['ratio'][0]:.2f}x ({p['ratio'][1]:.2f}-{p['ratio'][2]:.2f}) | {row['dsq_vram_mib']} |")


if __name__ == "__main__":
    main()
