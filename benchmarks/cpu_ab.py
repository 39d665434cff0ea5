"""Engines side by side on a shared CPU, run by run: every variant loaded once in one process, then
one generation each in turn, round after round, so that a change in the machine's load falls on all
of them alike. Prints each variant's median prefill and decode tok/s and, per round, its ratio to
the last variant (the baseline, llama.cpp by default), with the median and range of those ratios,
and the load average before and after (docs/benchmarks.md#cpu-decode).

A variant is a backend, optionally with environment settings applied around its runs only (the
native kernels read DSQ_INT8_PREFILL and DSQ_NO_VNNI at every call):

    python -m benchmarks.cpu_ab /tmp/q15.gguf --rounds 6
    DSQ_CPU_ISA=avx2 LLAMA_CPP_LIB_PATH=$(.ci/llama_avx2.sh) python -m benchmarks.cpu_ab \\
        --variants native,native:DSQ_INT8_PREFILL=0,llama.cpp --rounds 8 --json ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    """"native:A=1:B=0" -> ("native", {"A": "1", "B": "0"})."""
    backend, *sets = spec.split(":")
    env = {}
    for s in sets:
        k, _, v = s.partition("=")
        env[k] = v
    return backend, env


class _Env:
    def __init__(self, env: dict[str, str]):
        self.env, self.old = env, {}

    def __enter__(self):
        for k, v in self.env.items():
            self.old[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc):
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="a .gguf (default: the built-in model)")
    ap.add_argument("--variants", default="native,llama.cpp",
                    help="comma-separated backend[:VAR=value...]; ratios are to the last one")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, help="every engine's threads (default: dsq's)")
    ap.add_argument("--json", type=Path, help="write every run here")
    args = ap.parse_args(argv)

    from dsq.bench.runner import _generate, bench_ctx, bench_prompt, cpu_builds
    from dsq.runtime.engine import load
    from dsq.runtime.generate import GenStats
    from dsq.runtime.sampling import SamplingParams

    variants = [(spec, *parse_variant(spec)) for spec in args.variants.split(",")]
    n_ctx = bench_ctx(None, args.prompt_tokens, args.gen_tokens)
    greedy = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
    loaded = {}
    for spec, backend, env in variants:
        if backend not in loaded:
            m = load(args.model, backend=backend, ctx=n_ctx, threads=args.threads)
            loaded[backend] = (m, [bench_prompt(m, args.prompt_tokens)])
        m, prompts = loaded[backend]
        with _Env(env):
            m.reset()
            _generate(m, prompts, greedy, 4)  # warm-up
    load0 = loadavg()
    runs: dict[str, list[tuple[float, float]]] = {spec: [] for spec, _, _ in variants}
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]  # each variant first and last in turn
        for spec, backend, env in order:
            m, prompts = loaded[backend]
            st = GenStats()
            with _Env(env):
                m.reset()
                _generate(m, prompts, greedy, args.gen_tokens, st)
            runs[spec].append((st.prefill_tok_s, st.decode_tok_s))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{s} {runs[s][-1][0]:.1f}/{runs[s][-1][1]:.1f}" for s, _, _ in variants) + f" (load {loadavg()})",
              flush=True)
    load1 = loadavg()
    base = variants[-1][0]
    print(f"\n{args.model or 'built-in model'}: {args.prompt_tokens} prompt + {args.gen_tokens} generated tokens, "
          f"{args.rounds} rounds; load average {load0} before, {load1} after")
    print(f"CPU code: {cpu_builds()}")
    print("| variant | prefill tok/s | decode tok/s | prefill ratio (median, range) | decode ratio (median, range) |")
    print("|---|---|---|---|---|")
    summary = {}
    for spec, _, _ in variants:
        p = [a for a, _ in runs[spec]]
        d = [b for _, b in runs[spec]]
        rp = [a / b[0] for a, b in zip(p, runs[base])]
        rd = [a / b[1] for a, b in zip(d, runs[base])]
        summary[spec] = {"prefill_tok_s": statistics.median(p), "decode_tok_s": statistics.median(d),
                         "prefill_ratio": statistics.median(rp), "decode_ratio": statistics.median(rd),
                         "prefill_ratio_range": [min(rp), max(rp)], "decode_ratio_range": [min(rd), max(rd)]}
        print(f"| {spec} | {statistics.median(p):.1f} | {statistics.median(d):.1f} | "
              f"{statistics.median(rp):.2f}x ({min(rp):.2f}-{max(rp):.2f}) | "
              f"{statistics.median(rd):.2f}x ({min(rd):.2f}-{max(rd):.2f}) |")
    if args.json:
        args.json.write_text(json.dumps({
            "model": args.model, "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
            "rounds": args.rounds, "load_before": load0, "load_after": load1, "cpu_code": cpu_builds(),
            "env": {k: os.environ.get(k) for k in ("DSQ_CPU_ISA", "LLAMA_CPP_LIB_PATH")},
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": runs, "summary": summary,
        }, indent=1))


if __name__ == "__main__":
    main()
