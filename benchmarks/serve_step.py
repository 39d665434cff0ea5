"""Where dsq serve's step time goes: the engine's step at B running requests (each decoding at a
context of --ctx tokens), against the paged forward pass alone (PagedKV.forward) at the same B,
eager and (on a GPU) replayed as a CUDA graph (PagedKV.capture), then torch.profiler's top ops of
a few engine steps at one B (of the last kind).

    python -m benchmarks.serve_step MODEL.gguf --rows 1,8,32,64 --ctx 512 --profile 32 [--json out.json]
    python -m benchmarks.serve_step MODEL.gguf --rows 32 --prefill 512 --chunks 16,32,64,128,256,512
    python -m benchmarks.serve_step MODEL.gguf --rows 32 --ctx 512 --mixed 64,192,448

--mixed P,...: a mixed step (DSQ_SERVE_MIXED) of the largest --rows decode rows and P prompt tokens
of one more sequence (its first --ctx tokens cached), replayed with the prompt rows' attention by
tiles of rows (`triton_attn._attn_rows`) and row by row (DSQ_PAGED_ROWS=0), against the captured
decode step plus a captured chunk of the P tokens, as dsq serve runs them without mixed steps.

The engine's step is what a served token waits for (sampling, detokenizing and stop strings of
every row included); the forward pass is the model alone. Their difference is the engine's own
cost. The requests are greedy, as the load generator's are (--temperature T: sampled, top-k 40, top-p 0.95).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, dev, n: int) -> float:
    """Median ms of n calls, a device sync around each."""
    ms = []
    for _ in range(n):
        _sync(dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        ms.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ms)


def _engine(nm, rows: int, ctx: int, gen: int, temperature: float):
    """An engine with `rows` requests admitted and prefilled, each about to decode."""
    from dsq.runtime.sampling import SamplingParams
    from dsq.serve.engine import Engine, Request

    eng = Engine(nm, kv_tokens=rows * (ctx + gen + 64), max_seqs=rows, prefix_cache=False, prefill_chunk=ctx + 1)
    V = nm.model.args.vocab_size
    for i in range(rows):
        prompt = [(i * 7919 + j * 104729 + 1) % V for j in range(ctx)]
        eng.submit(Request(prompt, SamplingParams(temperature=temperature, seed=i), gen, lambda e: None, ignore_eos=True))
    eng.waiting.extend(eng.inbox)
    eng.inbox.clear()
    while any(r.computed < r.target for r in eng.running) or eng.waiting:
        eng.step()
    return eng


def _mixed(nm, R: int, ctx: int, prompts: list[int], dev) -> list[dict]:
    """ms of a mixed step (R decode rows at position ctx, P prompt rows of one more sequence from
    position ctx), its prompt rows' attention by tiles and by rows, against the decode step plus
    a chunk of P; all captured. The caches hold zeros: the kernels' work does not depend on them."""
    import torch

    from dsq.kernels import triton_attn
    from dsq.serve.paged import PagedKV

    bs, top = 16, max(prompts)
    per, pp = -(-(ctx + 1) // bs), -(-(ctx + top) // bs)
    kv = PagedKV(nm.model, R * per + pp + 2, bs, ctx + top + bs)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(R)] + [list(range(R * per, R * per + pp))]
    recs, rows_kernel = [], triton_attn.ROWS
    print(f"\n| prompt rows (+{R} decode) | mixed, tiles ms | mixed, row by row ms | decode + chunk ms | "
          "tiles / separate |\n|---|---|---|---|---|")
    for P in prompts:
        ids, starts = [1] * (R + P), [ctx] * R + list(range(ctx, ctx + P))
        seq, keep = list(range(R)) + [R] * P, list(range(R)) + [R + P - 1]
        rec = {"decode_rows": R, "prompt_rows": P}
        for name, tiles in (("tiles_ms", True), ("rows_ms", False)):
            triton_attn.ROWS = tiles  # read when the step is captured
            kv.graphs.clear()
            kv.capture([R + P], seqs=R + 1)
            rec[name] = round(_timed(lambda: kv.forward_rows(ids, starts, seq, tables, keep), dev, 5), 2)
        triton_attn.ROWS = rows_kernel
        kv.graphs.clear()
        kv.chunk_graphs.clear()
        kv.capture([R])
        kv.capture_chunks([P])

        def separate():
            kv.forward([[1]] * R, [ctx] * R, tables[:R])
            kv.forward([[1] * P], [ctx], [tables[R]])
        rec["separate_ms"] = round(_timed(separate, dev, 5), 2)
        kv.chunk_graphs.clear()
        recs.append(rec)
        print(f"| {P} | {rec['tiles_ms']} | {rec['rows_ms']} | {rec['separate_ms']} | "
              f"{rec['tiles_ms'] / rec['separate_ms']:.2f} |")
        torch.cuda.empty_cache()
    return recs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--ctx", type=int, default=512, help="prompt tokens each request holds when timing starts")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--profile", type=int, default=0, help="B to profile (0: none)")
    ap.add_argument("--prefill", type=int, default=0, help="also time and profile a prompt chunk this long")
    ap.add_argument("--chunks", default="", help="captured prompt chunk lengths to time (PagedKV.time_chunks), "
                    "as dsq serve's warm-up does, e.g. 16,32,64,128,256,512 (needs --prefill, the longest)")
    ap.add_argument("--mixed", default="", help="prompt tokens of mixed steps to time, e.g. 64,192,448 (GPU)")
    ap.add_argument("--gpu-layers", default="all")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import torch

    from dsq.runtime.engine import load

    torch.set_grad_enabled(False)
    nm = load(a.model, backend="native", ctx=4096, gpu_layers=a.gpu_layers, threads=a.threads, cuda_graph=False)
    nm.cache = None
    dev = nm.head_device
    out = {"model": a.model, "ctx": a.ctx, "rows": []}
    graphs = dev.type == "cuda"
    print("| rows | step | engine step ms | forward ms | engine's own ms | tok/s (engine) |")
    print("|---|---|---|---|---|---|")
    for b in [int(x) for x in a.rows.split(",") if x]:
        # the first rows decode while the last prefill: enough tokens for both kinds of step
        eng = _engine(nm, b, a.ctx, gen=b + 8 * a.steps + 32, temperature=a.temperature)
        for kind in ("eager", "graph") if graphs else ("eager",):
            if kind == "graph":
                eng.kv.capture([b])  # PagedKV.capture, as dsq serve's warm-up does for each bucket
            for _ in range(3):
                eng.step()
            step_ms = _timed(eng.step, dev, a.steps)
            rs = eng.running
            fwd = lambda eng=eng, rs=rs: eng.kv.forward([[r.tokens[-1]] for r in rs], [r.computed for r in rs],  # noqa: E731
                                         [r.blocks for r in rs])  # rewrites the last token's slot: same shapes
            fwd()
            fwd_ms = _timed(fwd, dev, a.steps)
            rec = {"rows": b, "step": kind, "step_ms": round(step_ms, 2), "forward_ms": round(fwd_ms, 2),
                   "tok_s": round(b / step_ms * 1e3, 1)}
            out["rows"].append(rec)
            print(f"| {b} | {kind} | {step_ms:.2f} | {fwd_ms:.2f} | {step_ms - fwd_ms:.2f} | {rec['tok_s']} |")
        if b == a.profile:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            with profile(activities=acts) as prof:
                for _ in range(4):
                    eng.step()
                _sync(dev)
            ka = prof.key_averages()
            for key in ("self_cuda_time_total", "self_cpu_time_total") if dev.type == "cuda" else ("self_cpu_time_total",):
                print(f"\n-- 4 engine steps at {b} rows, by {key}")
                print(ka.table(sort_by=key, row_limit=22, max_name_column_width=60))
        eng.kv = eng.pool = None
        del eng
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if a.prefill:  # one prompt chunk of --prefill tokens (B = 1, as the engine prefills), timed and profiled
        print()
        from dsq.serve.paged import PagedKV

        kv = PagedKV(nm.model, -(-a.prefill // 16) + 2, 16, a.prefill + 16)
        V = nm.model.args.vocab_size
        ids = [[(j * 104729 + 1) % V for j in range(a.prefill)]]
        run = lambda: kv.forward(ids, [0], [list(range(-(-a.prefill // 16)))])  # noqa: E731
        run()
        out["prefill"] = []
        for kind in ("eager", "graph") if graphs else ("eager",):
            if kind == "graph":
                kv.scratch = kv.pool.num_blocks - 1  # a block the chunk's table does not hold
                kv.capture_chunks([a.prefill])
                run()
            ms = _timed(run, dev, 3)
            out["prefill"].append({"step": kind, "tokens": a.prefill, "ms": round(ms, 1),
                                   "tok_s": round(a.prefill / ms * 1e3)})
            print(f"prefill of {a.prefill} tokens (B = 1), {kind}: {ms:.1f} ms, {a.prefill / ms * 1e3:.0f} tok/s")
        if graphs and a.chunks:  # each length's replay as the warm-up times it, and the pieces planned from them
            kv.capture_chunks([int(x) for x in a.chunks.split(",") if x])
            cost = kv.time_chunks()
            out["chunk_ms"] = {t: round(c * 1e3, 3) for t, c in cost.items()}
            print("| chunk tokens | replay ms | tok/s |\n|---|---|---|")
            for t, c in sorted(cost.items()):
                print(f"| {t} | {c * 1e3:.2f} | {t / c:.0f} |")
            print("first pieces:", {L: kv.first_piece[L] for L in (20, 40, 70, 100, 150, 200, 300, 400, 500)
                                    if L < len(kv.first_piece)})
        if dev.type == "cuda":
            kv.chunk_graphs.clear()  # the profile is of the eager pass
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run()
                _sync(dev)
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=50))
    if graphs and a.mixed:
        out["mixed"] = _mixed(nm, max(int(x) for x in a.rows.split(",") if x), a.ctx,
                              [int(x) for x in a.mixed.split(",") if x], dev)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
