"""Chunked prefill in dsq serve's engine: the running requests' time per output token while a long
prompt arrives, with the prompt in one step against in chunks between decode steps.

    python -m benchmarks.serve_chunked_prefill [MODEL] --long 1500 --chunks 2048,128 --plot chunked.png

Per --chunks value: --decoding greedy requests start and decode; after --warm tokens each, the
long prompt (held-out text) is submitted. Every token's arrival time is recorded; printed are the
decoding requests' TPOT P50 / P99 / max over the whole run and the long prompt's TTFT, side by
side; --plot draws each run's inter-token gaps against time.
"""

from __future__ import annotations

import argparse
import threading
import time


def run(nm, chunk: int, n_dec: int, long_tokens: int, gen: int, warm: int) -> dict:
    from dsq.eval.corpus import held_out_text
    from dsq.runtime.engine import encode_prompt
    from dsq.runtime.sampling import SamplingParams
    from dsq.serve.engine import Engine, Request

    eng = Engine(nm, kv_tokens=4 * nm.n_ctx, prefill_chunk=chunk)
    times: dict[int, list[float]] = {i: [] for i in range(n_dec)}
    long_first: list[float] = []
    done = threading.Event()
    finished = [0]

    def emit_for(i):
        def emit(ev):
            if ev.kind == "text":
                (times[i] if i >= 0 else long_first).append(time.perf_counter())
            elif ev.kind in ("done", "error"):
                finished[0] += 1
                if finished[0] == n_dec + 1:
                    done.set()
        return emit

    prompts = ["The history of the Roman Empire", "Why is the sky blue?", "def fibonacci(n):",
               "Once upon a time, in a land far away"]
    long_ids = encode_prompt(nm, held_out_text())[:long_tokens]
    eng.start()
    t0 = time.perf_counter()
    for i in range(n_dec):
        eng.submit(Request(encode_prompt(nm, prompts[i % len(prompts)]), SamplingParams(temperature=0), gen,
                           emit_for(i), ignore_eos=True))
    while min(len(t) for t in times.values()) < warm:
        time.sleep(0.005)
    t_long = time.perf_counter()
    eng.submit(Request(long_ids, SamplingParams(temperature=0), 4, emit_for(-1), ignore_eos=True))
    done.wait(600)
    eng.stop()
    gaps = [(b - t0, (b - a) * 1000) for t in times.values() for a, b in zip(t, t[1:])]
    return {"chunk": chunk, "gaps": gaps, "long_ttft_ms": (long_first[0] - t_long) * 1000 if long_first else None,
            "t_long": t_long - t0}


def pct(v: list[float], q: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, int(round((len(v) - 1) * q / 100)))] if v else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?")
    ap.add_argument("--long", type=int, default=1500, help="tokens of the long prompt")
    ap.add_argument("--chunks", default="2048,128", help="--prefill-chunk values to compare")
    ap.add_argument("--decoding", type=int, default=4, help="requests decoding when it arrives")
    ap.add_argument("--gen", type=int, default=64, help="tokens each decoding request generates")
    ap.add_argument("--warm", type=int, default=8, help="tokens each has before the long prompt arrives")
    ap.add_argument("--gpu-layers", default="0")
    ap.add_argument("--plot")
    a = ap.parse_args()

    from dsq.runtime.engine import load

    nm = load(a.model, backend="native", ctx=max(2048, a.long + 64), gpu_layers=a.gpu_layers, cuda_graph=False)
    runs = [run(nm, int(c), a.decoding, a.long, a.gen, a.warm) for c in a.chunks.split(",")]
    print(f"{a.decoding} requests decoding, a {a.long}-token prompt arriving")
    print("| --prefill-chunk | TPOT P50 ms | TPOT P99 ms | TPOT max ms | long prompt TTFT ms |")
    print("|---|---|---|---|---|")
    for r in runs:
        g = [x for _, x in r["gaps"]]
        print(f"| {r['chunk']} | {pct(g, 50):.1f} | {pct(g, 99):.1f} | {max(g):.1f} | {r['long_ttft_ms']:.0f} |")
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        for r in runs:
            xs, ys = zip(*sorted(r["gaps"]))
            ax.plot(xs, ys, ".", label=f"--prefill-chunk {r['chunk']}", alpha=0.7)
            ax.axvline(r["t_long"], ls=":", color="gray")
        ax.set(xlabel="seconds", ylabel="time between tokens, ms", yscale="log",
               title=f"decoding requests while a {a.long}-token prompt arrives")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot)


if __name__ == "__main__":
    main()
