"""`dsq bench`: tokens/s, TTFT, TPOT, peak RSS/VRAM; sweeps; a table, JSON and a plot."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from dsq.cli.common import command
from dsq.cli.options import (Compile, Dtype, Experts, Force, Head, JsonFlag, KvDtype, MaxTokens, ModelArg, OutFile,
                             PromptTokens, Repeat, Revision, TensorSplit, Threads, backend_options)


@command("bench", renamed={"--gen-tokens": "--max-tokens", "--json FILE": "--out"}, examples=[
    "dsq bench",
    "dsq bench model.gguf --gpu-layers 0,8,16,all --out sweep.json --plot sweep.png",
    "dsq bench --prompt-tokens 128 --max-tokens 64 --repeat 5 --json",
    "dsq bench --backend native,llama.cpp -n 64",
    "dsq bench model.gguf --backend native,llama.cpp --gpu-layers 0,8,16,24,all --plot race.png",
    "dsq bench model.gguf --backend native --gpu-layers all --batch 1,4,16 --plot batch.png",
    "dsq bench --serve http://127.0.0.1:8000 --concurrency 1,8,32 --requests 64 --gpu-cost-per-hour 3",
    "dsq bench --serve http://127.0.0.1:8000 --api-key KEY --concurrency 1,8",
])
def bench(
    model: ModelArg = None,
    backend: Annotated[str, typer.Option("--backend", "-b", help="Backends to compare, comma-separated: llama.cpp, "
                                                                  "native or auto (llama.cpp, and native for AWQ / "
                                                                  "GPTQ / FP8 directories).")] = "auto",
    prompt_tokens: PromptTokens = 512,
    gen_tokens: MaxTokens = 128,
    repeat: Repeat = 3,
    gpu_layers: Annotated[str, typer.Option("--gpu-layers", "-g",
                                            help="Comma-separated sweep, e.g. 0,8,all (or auto).")] = "0",
    batch: Annotated[str, typer.Option("--batch", help="Sequences decoded together, comma-separated sweep "
                                                        "(native backend; tok/s then count all of them).")] = "1",
    threads: Threads = None,
    ctx: Annotated[Optional[int], typer.Option("--ctx", "-c", min=1, help="Context length in tokens (default: "
                                                                         "prompt + generated).")] = None,
    as_json: JsonFlag = False,
    json_path: OutFile = None,
    plot_path: Annotated[Optional[Path], typer.Option(
        "--plot", help="Plot tok/s (PNG) where it says something: against a --gpu-layers sweep (the offload "
        "model's prediction dashed) or a --batch sweep, or backends side by side as bars.")] = None,
    force: Force = False,
    warmup: Annotated[bool, typer.Option("--warmup/--no-warmup", help="One untimed run of the prompt first (autotuning, compiling).")] = True,
    dtype: Dtype = None,
    kv_dtype: KvDtype = None,
    compile: Compile = False,
    experts: Experts = "auto",
    head: Head = None,
    tensor_split: TensorSplit = None,
    chat_turns: Annotated[int, typer.Option("--chat-turns", help="Instead: a chat of N turns, TTFT per turn "
                                                                  "(the prefix cache keeps it flat).")] = 0,
    serve: Annotated[Optional[str], typer.Option(
        "--serve", help="Instead: load-test the OpenAI-compatible server at this URL (dsq serve, llama-server, "
        "vLLM): streaming completions of held-out text, prompts of up to --prompt-tokens words, --max-tokens "
        "each.")] = None,
    concurrency: Annotated[str, typer.Option("--concurrency", help="With --serve: requests in flight, "
                                                                    "comma-separated sweep.")] = "1,8,32",
    requests: Annotated[int, typer.Option("--requests", help="With --serve: requests per concurrency level.")] = 64,
    gpu_cost_per_hour: Annotated[Optional[float], typer.Option(
        "--gpu-cost-per-hour", help="With --serve: price of the server's hardware an hour, for the cost of 1M "
        "output tokens.")] = None,
    serve_model: Annotated[Optional[str], typer.Option(
        "--serve-model", help="With --serve: the model name to send (default: the first of /v1/models).")] = None,
    same_prompts: Annotated[bool, typer.Option(
        "--same-prompts/--fresh-prompts", help="With --serve: send every level the same prompts (the server's "
        "prefix cache then finds the earlier levels'); by default each level draws its own.")] = False,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key", envvar="DSQ_API_KEY", show_default=False,
        help="With --serve: the server's API key, sent as 'Authorization: Bearer KEY'.")] = None,
    revision: Revision = None,
) -> None:
    """Benchmark speed and memory: tokens/s, TTFT, TPOT, peak RSS/VRAM, --gpu-layers sweeps.

    Prefill and decode tok/s, TTFT and TPOT are reported as the median and the worst of --repeat
    runs (the p99 from 100 runs); peak RSS and VRAM above what the process held before loading.
    The table goes to stdout (the JSON report instead with --json), the report to --out, a plot
    to --plot. Two backends are shown side by side at each --gpu-layers with the ratio of the
    first to the second. Without a GPU, a --gpu-layers sweep runs once, on the CPU.
    """
    from dsq.runtime.gpu_layers import GpuLayers
    from dsq.runtime.model_ref import resolve_model
    from dsq.ui import console, status

    con = console()
    batches = _batches(batch)
    for path in (json_path, plot_path):
        _check_output(path, force)
    if serve:
        return _serve_bench(serve, _batches(concurrency, "--concurrency"), requests, gen_tokens, prompt_tokens,
                            serve_model, gpu_cost_per_hour, (as_json, json_path), plot_path, con, same_prompts,
                            api_key)
    ref = resolve_model(model, con, revision)
    backends = _backends(ref, backend)
    sweep = _sweep(ref, gpu_layers, ctx, backends, con)
    opts = {b: backend_options(b, dtype if b == "native" else None, kv_dtype, compile and b == "native",
                               experts if b == "native" or experts == "cpu" else "auto",
                               head if b == "native" else None, tensor_split)
            for b in backends}
    if tensor_split and all(g == GpuLayers.NONE for g in sweep) and not _some_gpu(backends):
        con.print("[yellow]note:[/yellow] no GPU: running on the CPU")
    if chat_turns:
        return _chat_bench(ref, backends, chat_turns, gen_tokens, threads, ctx, opts, (as_json, json_path), con)
    settings = {"prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens, "repeat": repeat, "backends": backends,
                "gpu_layers": [str(g) for g in sweep], "batch": list(batches), "experts": experts,
                "head": head or "gpu", "tensor_split": next((o["tensor_split"] for o in opts.values()
                                                             if "tensor_split" in o), None)}
    with status("benchmarking", con) as st:
        from dsq.bench.runner import run_bench

        records = run_bench(str(ref.path), backends=backends, gpu_layers=sweep, prompt_tokens=prompt_tokens,
                            gen_tokens=gen_tokens, repeat=repeat, threads=threads, ctx=ctx, warmup=warmup,
                            on_status=lambda s: st.update(s), model_opts=opts, batch=batches)
    _report(ref, records, settings, (as_json, json_path), plot_path, ctx, threads)


def _batches(batch: str, flag: str = "--batch") -> tuple[int, ...]:
    from dsq.errors import DsqError

    try:
        out = tuple(int(b) for b in batch.split(",") if b.strip()) or (1,)
    except ValueError:
        out = ()
    if not out or min(out) < 1:
        raise DsqError(f"{flag} {batch!r} is not a list of whole numbers >= 1", f"e.g. {flag} 1,4,16")
    return out


def _serve_bench(url, levels, requests, gen_tokens, prompt_tokens, model, cost, outputs, plot_path, con,
                 same_prompts: bool = False, api_key: str | None = None) -> None:
    """--serve: the load generator's levels as a table, JSON and a plot."""
    from rich.table import Table

    from dsq.bench.serve_load import plot, run_load
    from dsq.ui import out_console, status

    with status("load test", con) as st:
        result = run_load(url, list(levels), requests, max_tokens=gen_tokens,
                          prompt_words=(min(16, prompt_tokens), prompt_tokens), model=model, cost_per_hour=cost,
                          on_status=lambda s: st.update(s), same_prompts=same_prompts, api_key=api_key)
    t = Table(title=f"{result['model']} at {url}: {requests} requests a level, {gen_tokens} tokens each")
    cols = ["concurrency", "QPS", "output tok/s", "TTFT P50 ms", "TTFT P99 ms", "TPOT P50 ms", "TPOT P99 ms",
            "failures"] + (["$ / 1M output"] if cost is not None else [])
    for c in cols:
        t.add_column(c, justify="right")
    for lv in result["levels"]:
        row = [lv["concurrency"], lv["qps"], lv["output_tok_s"], lv["ttft_p50_ms"], lv["ttft_p99_ms"],
               lv["tpot_p50_ms"], lv["tpot_p99_ms"], lv["failures"]]
        if cost is not None:
            row.append("n/a" if lv["cost_per_1m_output"] is None else f"{lv['cost_per_1m_output']:.3f}")
        t.add_row(*[str(x) for x in row])
    (con if outputs[0] else out_console()).print(t)
    for lv in result["levels"]:
        s = lv.get("server")
        if s:
            con.print(f"[dim]concurrency {lv['concurrency']}: server steps {s.get('steps', 0)}, "
                      f"{s.get('tokens_per_step', 0)} tokens a step, prefix-cache hits "
                      f"{s.get('prefix_cache_hit_rate', 0):.0%}, preempted {s.get('preempted', 0)}"
                      + (f", speculative acceptance {s['spec_acceptance_rate']:.0%}" if 'spec_acceptance_rate' in s
                         else "") + "[/dim]")
            ms = s.get("step_ms")
            if ms:
                con.print(f"[dim]  ms a step: {ms['step']:.2f} (prompt chunks {ms.get('prefill', 0):.2f}, decode "
                          f"{ms.get('decode', 0):.2f}, of which sampling and the wait for the GPU "
                          f"{ms.get('sync', 0):.2f} and handing tokens on {ms.get('emit', 0):.2f}); the loop was "
                          f"in steps {s.get('busy', 0):.0%} of the time[/dim]")
            g = s.get("gpu_step_ms")
            if g:
                con.print(f"[dim]  GPU ms a step: prompt chunks {g.get('prefill', 0):.2f} "
                          f"({s.get('chunk_tokens_per_step', 0)} prompt tokens a step, "
                          f"{s.get('chunk_padded_tokens_per_step', 0)} computed), decode {g.get('decode', 0):.2f}"
                          "[/dim]")
    for e in result["errors"][:3]:
        con.print(f"[red]failed: {e}[/red]")
    _emit(result, outputs, con)
    if plot_path:
        plot(result, plot_path)


def _check_output(path: Path | None, force: bool) -> None:
    """Refuse an existing --json / --plot file (unless --force), or one that cannot be written, before any run."""
    from dsq.cli.options import check_output_path
    from dsq.errors import OutputExists

    if path is not None:
        check_output_path(path, "path")
    if path is not None and (path.exists() or path.is_symlink()) and not force:
        raise OutputExists(f"{path} already exists", "pass --force to overwrite it or choose another path")


def _backends(ref, backend: str) -> list[str]:
    from dsq.runtime.engine import pick_backend

    return list(dict.fromkeys(pick_backend(ref, b.strip()) for b in backend.split(",") if b.strip()))


def _sweep(ref, gpu_layers: str, ctx: int | None, backends: list[str], con) -> list:
    """The --gpu-layers values to run. Where no backend can use a GPU (none here, or a llama.cpp
    build without GPU support), every value runs on the CPU: once, as 0 (as the records say)."""
    from dsq.runtime.gpu_layers import GpuLayers, parse_for

    sweep = [parse_for(g, ref.path, ctx or 4096, backends[0]) for g in gpu_layers.split(",") if g.strip()]
    if all(g == GpuLayers.NONE for g in sweep) or _some_gpu(backends):
        return sweep
    con.print(f"[yellow]note:[/yellow] no GPU: running on the CPU (--gpu-layers {gpu_layers} "
              + ("runs as 0)" if len(sweep) == 1 else "would all run there, so it runs once, as 0)"))
    return [GpuLayers.NONE]


def _some_gpu(backends: list[str]) -> bool:
    """Whether one of the backends can put layers on a GPU here."""
    from dsq.runtime.gpu_layers import gpu_usable

    return any(gpu_usable(b) for b in backends)


def _emit(report: dict, outputs: tuple, con) -> None:
    """The report as JSON: on stdout with --json, into the --out file."""
    import json

    from dsq.bench.report import write_json

    as_json, path = outputs
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    if path:
        write_json(path, report)
        con.print(f"wrote {path}")


def _report(ref, records, settings: dict, outputs, plot_path, ctx, threads) -> None:
    """The table on stdout, what computed on the CPU on stderr, the records and the plot."""
    import datetime

    from dsq.bench.metrics import cuda_context_bytes
    from dsq.bench.report import plot, plot_kind, ratios, summarize, table
    from dsq.bench.runner import cpu_builds, machine_info
    from dsq.ui import console, out_console

    con = console()
    recs = [r.as_dict() for r in records]
    rows = summarize(recs)
    s = settings
    plans, s["bandwidths"] = _rooflines(ref.path, rows, ctx, s["prompt_tokens"], s["gen_tokens"], threads)
    title = f"{ref.label}: {s['prompt_tokens']} prompt + {s['gen_tokens']} generated tokens, {s['repeat']} runs"
    context = cuda_context_bytes()
    (con if outputs[0] else out_console()).print(table(rows, title, context))
    builds = cpu_builds()
    con.print(f"CPU code: native kernels {builds['native_cpu_kernels']}; llama.cpp {builds['llama_cpp_cpu']} "
              f"({builds['llama_cpp_lib']})")
    if any(outputs):
        backends = s["backends"]
        report = {"model": str(ref.path), "label": ref.label, "date": datetime.datetime.now().isoformat(timespec="seconds"),
                  "machine": machine_info(),
                  "settings": {**s, "threads": records[0].threads,
                               "cuda_context_mb": None if context is None else round(context / 2**20, 1)},
                  "runs": recs, "summary": rows, "ratios": ratios(rows, *backends[:2]) if len(backends) > 1 else []}
        _emit(report, outputs, con)
    if plot_path and plot_kind(rows) is None:
        con.print(f"[yellow]note:[/yellow] one backend at one configuration: nothing to plot, {plot_path} not "
                  "written (a --gpu-layers or --batch sweep, or two backends, make a plot)")
    elif plot_path:
        sweep = plot_kind(rows) == "gpu_layers"
        predicted = plans or (_predicted(ref.path, rows, ctx, s["prompt_tokens"], s["gen_tokens"], threads)
                              if sweep else {})
        plot(rows, plot_path, title, {k: p.predicted_tok_s for k, p in predicted.items()})
        con.print(f"wrote {plot_path}")


def _rooflines(model, rows, ctx, prompt_tokens: int, gen_tokens: int, threads) -> tuple[dict, str | None]:
    """Each batch-1 row's decode roofline (`decode_roofline_tok_s`: the plan's bytes a token at its
    split over the bandwidths), where this machine has a calibration (`dsq offload --calibrate`);
    nothing is measured here. Returns the plans (for the plot's prediction; {} without a
    calibration) and where the bandwidths came from (None)."""
    from dsq.errors import DsqError
    from dsq.runtime.machine import machine_bandwidths
    from dsq.runtime.placement import detect_gpu

    bw = machine_bandwidths(detect_gpu(), threads=threads, measure=False)
    if not bw.source.startswith("calibrated"):
        return {}, None
    try:
        plans = _predicted(model, rows, ctx, prompt_tokens, gen_tokens, threads, bw)
    except (DsqError, OSError, ValueError, KeyError):  # a model the planner cannot read: no roofline column
        return {}, None
    for r in rows:
        plan = plans.get((r["backend"], str(r["gpu_layers"])))
        if plan is not None and r.get("batch", 1) == 1 and plan.roofline_tok_s:
            r["decode_roofline_tok_s"] = round(plan.roofline_tok_s, 2)
    return plans, f"{bw.source}: CPU {bw.cpu_ceiling / 1e9:.1f} GB/s, GPU {bw.gpu / 1e9:.0f} GB/s"


def _predicted(model, rows, ctx, prompt_tokens: int, gen_tokens: int, threads, bw=None) -> dict:
    """The offload model's plan at each row's split (dsq.bench.prediction), with `bw` or this
    machine's bandwidths (its calibration, else the CPU measured now)."""
    from dsq.bench.prediction import predicted_plans
    from dsq.bench.runner import bench_ctx
    from dsq.runtime.machine import machine_bandwidths
    from dsq.runtime.placement import detect_gpu

    bw = bw or machine_bandwidths(detect_gpu(), threads=threads)
    return predicted_plans(model, rows, ctx=bench_ctx(ctx, prompt_tokens, gen_tokens),
                           kv_tokens=prompt_tokens + gen_tokens // 2, bandwidths=bw)


def _chat_bench(ref, backends, turns, gen_tokens, threads, ctx, opts, outputs, con) -> None:
    from rich.table import Table

    from dsq.bench.runner import machine_info, run_chat_bench
    from dsq.ui import out_console, status

    with status("benchmarking a chat", con) as st:
        rows = run_chat_bench(str(ref.path), backends=backends, turns=turns, gen_tokens=gen_tokens, threads=threads,
                              ctx=ctx or 4096, on_status=lambda s: st.update(s), model_opts=opts)
    t = Table(title=f"{ref.label}: TTFT per chat turn (history kept in the KV cache)", title_justify="left")
    t.add_column("turn", justify="right")
    for b in backends:
        t.add_column(f"{b}: history tokens", justify="right")
        t.add_column(f"{b}: TTFT ms", justify="right")
    for turn in range(1, turns + 1):
        cells = [str(turn)]
        for b in backends:
            r = next(x for x in rows if x["backend"] == b and x["turn"] == turn)
            cells += [str(r["history_tokens"]), f"{r['ttft_ms']:.1f}"]
        t.add_row(*cells)
    (con if outputs[0] else out_console()).print(t)
    _emit({"model": str(ref.path), "label": ref.label, "machine": machine_info(), "scenario": "chat", "turns": rows},
          outputs, con)
