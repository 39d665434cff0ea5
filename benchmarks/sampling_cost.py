"""How much of a decode token is spent outside the model's step (sampling, detokenizing, the loop)?

    python -m benchmarks.sampling_cost [MODEL] [--temperatures 0,0.8] [--tokens 40] [--rounds 3]

Times each decode step (NativeModel._decode) inside dsq's own generation loop and prints, per
temperature (0: greedy; otherwise the default top-k 40 / top-p 0.95), the token's time, the
step's, and the rest. The built-in model (a 262k-token vocabulary) by default.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int)
    a = ap.parse_args(argv)

    import dsq
    from dsq.bench.runner import bench_prompt
    from dsq.runtime.generate import GenStats
    from dsq.runtime.sampling import SamplingParams

    m = dsq.load(a.model, backend="native", ctx=256, threads=a.threads)
    prompt = bench_prompt(m, 64)
    steps: list[float] = []
    decode = m._decode

    def timed(*args, **kw):
        t = time.perf_counter()
        out = decode(*args, **kw)
        steps.append(time.perf_counter() - t)
        return out

    m._decode = timed
    print(f"{'temperature':>11} {'token ms':>9} {'step ms':>8} {'outside ms':>11}")
    for temp in [float(x) for x in a.temperatures.split(",")]:
        rows = []
        for _ in range(a.rounds):
            steps.clear()
            m.reset()
            st = GenStats()
            for _ in m.stream(prompt, SamplingParams(temperature=temp), a.tokens, st, ignore_eos=True):
                pass
            rows.append((1e3 / st.decode_tok_s, 1e3 * statistics.median(steps)))
        tok, step = min(rows)  # the quietest round
        print(f"{temp:11.2f} {tok:9.2f} {step:8.2f} {tok - step:11.2f}")


if __name__ == "__main__":
    main()
