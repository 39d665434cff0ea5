"""`dsq offload`: what goes on the GPU for a memory budget and the decode speed to expect; the
machine's calibration (--calibrate); predicted beside measured at each split (--measure)."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from dsq.cli.common import command
from dsq.cli.options import (Ctx, Experts, Head, JsonFlag, MaxTokens, ModelArg, PromptTokens, Repeat, Revision,
                             TensorSplit, Threads)

MIB = 2**20


@command("offload", renamed={"--gen-tokens": "--max-tokens"}, examples=[
    "dsq offload --vram 2G",
    "dsq offload DeepSeek-R1-Distill-Llama-8B-Q4_K_M.gguf --vram 6G --ram 32G --ctx 8192",
    "dsq offload model.gguf --backend native --vram 24G --json",
    "dsq offload model.gguf --vram 24G,24G --tensor-split 3,1",
    "dsq offload --calibrate",
    "dsq offload model.gguf --measure --gpu-layers 0,8,16,24,all",
    "dsq offload DeepSeek-V3-Q4_K_M.gguf --backend native --vram 24G --ram 512G --experts cpu",
])
def offload(
    model: ModelArg = None,
    vram: Annotated[Optional[str], typer.Option("--vram", help="GPU memory budget, e.g. 8G, or one per GPU, e.g. "
                                                               "24G,24G (default: each GPU's free VRAM).")] = None,
    ram: Annotated[Optional[str], typer.Option("--ram", help="CPU memory budget, e.g. 32G.")] = None,
    ctx: Ctx = 4096,
    backend: Annotated[Optional[str], typer.Option(
        "--backend", "-b", help="Plan for native or llama.cpp (default: llama.cpp, as dsq run; native with --measure).")] = None,
    gpu_layers: Annotated[Optional[str], typer.Option(
        "--gpu-layers", "-g", help="Plan this split instead of choosing one; with --measure, the splits to "
                                   "measure, e.g. 0,8,16,24,all (default: a few across the range).")] = None,
    calibrate: Annotated[bool, typer.Option("--calibrate", help="Measure this machine's CPU and GPU bandwidth and "
                                                                "transfer cost, and keep them for the predictions.")] = False,
    measure: Annotated[bool, typer.Option("--measure", help="Load the model at each split and print predicted "
                                                            "beside measured decode tok/s.")] = False,
    prompt_tokens: PromptTokens = 64,
    gen_tokens: MaxTokens = 32,
    repeat: Repeat = 3,
    threads: Threads = None,
    gpu_bw: Annotated[Optional[float], typer.Option("--gpu-bw", help="GPU bandwidth in GB/s (default: calibrated, else known card).")] = None,
    cpu_bw: Annotated[Optional[float], typer.Option("--cpu-bw", help="CPU bandwidth in GB/s (default: calibrated, else measured now).")] = None,
    as_json: JsonFlag = False,
    experts: Experts = "auto",
    head: Head = None,
    tensor_split: TensorSplit = None,
    revision: Revision = None,
) -> None:
    """Plan the GPU/CPU split for a memory budget and predict decode speed.

    Bytes per layer (weights at their quant type + KV cache + compute buffers), what fits on the
    GPU for the backend that runs it, and the decode tok/s a bandwidth model predicts.

    llama.cpp puts the last N layers on the GPU and the output head only with all of them; the
    native backend puts the head there with any layer, and with none where llama.cpp's CUDA build
    would reserve the VRAM for it (in RAM with --head cpu) and, choosing, picks the fastest split
    and head placement that fit.
    The bandwidths come from `dsq offload --calibrate` (kept in dsq's cache dir), else the CPU is
    measured for this call.
    """
    from dsq.errors import DsqError
    from dsq.runtime.model_ref import resolve_model
    from dsq.runtime.placement import BACKENDS
    from dsq.ui import console

    con = console()
    if backend is not None and backend not in BACKENDS:
        raise DsqError(f"unknown backend {backend!r}", f"choose one of: {', '.join(BACKENDS)}")
    if calibrate:
        _calibrate(threads, as_json and model is None and not measure)
        if model is None and not measure:
            return
    be = backend or ("native" if measure else "llama.cpp")
    ref = resolve_model(model, con, revision)
    bw_given = {"gpu_bw": gpu_bw * 1e9 if gpu_bw else None, "cpu_bw": cpu_bw * 1e9 if cpu_bw else None}
    from dsq.runtime.experts import check_backend, parse_experts

    experts = check_backend(parse_experts(experts), be)
    if experts == "auto" and be != "native":
        experts = "gpu"
    from dsq.cli.options import backend_options

    head = backend_options(be, None, None, head=head).get("head")  # (checked: the native backend's)
    if measure:
        return _measure(ref, be, gpu_layers, ctx, prompt_tokens, gen_tokens, repeat, threads, bw_given, as_json,
                        experts, head)
    _plan(ref, be, vram, ram, ctx, gpu_layers, bw_given, as_json, experts, head, tensor_split)


# -- --calibrate -------------------------------------------------------------------------------------
def _calibrate(threads: int | None, as_json: bool) -> None:
    from dsq.bench.metrics import cuda_context_bytes
    from dsq.runtime.machine import calibrate, save_calibration
    from dsq.runtime.placement import detect_gpu
    from dsq.ui import console, status

    con = console()
    cuda_context_bytes()  # the context made (and sized) before the probes, for a --measure after them
    with status("measuring this machine's bandwidths", con):
        cal = calibrate(threads, detect_gpu())
    path = save_calibration(cal)
    if as_json:
        typer.echo(json.dumps(cal.as_dict(), indent=2))
        return
    gpu = "no GPU" if cal.gpu_copy_bw is None else (
        f"GPU copy {cal.gpu_copy_bw / 1e9:.0f} GB/s, host->GPU {cal.h2d_bw / 1e9:.1f} GB/s (pinned), "
        f"split round trip {cal.split_overhead_s * 1e6:.0f} us")
    peak = "" if cal.cpu_peak_read_bw is None else f", {cal.cpu_peak_read_bw / 1e9:.1f} by dsq's kernels"
    con.print(f"CPU read {cal.cpu_read_bw / 1e9:.1f} GB/s{peak} ({cal.threads} threads), {gpu}; kept in {path}")


# -- the plan ----------------------------------------------------------------------------------------
def _plan(ref, backend: str, vram: str | None, ram: str | None, ctx: int, gpu_layers: str | None,
          bw_given: dict, as_json: bool, experts: str = "gpu", head: str | None = None,
          tensor_split: str | None = None) -> None:
    from dsq.runtime.gpu_layers import parse_for, parse_tensor_split
    from dsq.runtime.placement import parse_size, plan_placement

    budgets = _vram_budgets(vram, tensor_split)
    shares = parse_tensor_split(tensor_split, len(budgets)) if len(budgets) > 1 else None
    split = None if gpu_layers is None else parse_for(gpu_layers, ref.path, ctx, backend)
    plan = plan_placement(ref.path, vram=budgets if len(budgets) > 1 else budgets[0], ctx=ctx, ram=parse_size(ram),
                          backend=backend, gpu_layers=split, experts=experts, head=head, tensor_split=shares,
                          **bw_given)
    if vram is not None and (split is None or split.auto):
        _check_budget(plan, vram, ref.label)
    if as_json:
        typer.echo(json.dumps(plan.as_dict(), indent=2))
        return
    _print_plan(plan, ref.label)


def _vram_budgets(vram: str | None, tensor_split: str | None = None) -> list[int]:
    """The GPU budgets to plan for: --vram's, one per GPU (24G,24G), else each GPU's free memory;
    [0] without a GPU (said on stderr). A --tensor-split is checked against their count, and on a
    machine with no GPU and no --vram is ignored, with the note."""
    from dsq.runtime.gpu_layers import parse_tensor_split
    from dsq.runtime.placement import detect_gpus, parse_size

    if vram is not None:
        budgets = [parse_size(v) for v in vram.split(",")]
        parse_tensor_split(tensor_split, len(budgets))
        return budgets
    gpus = detect_gpus()
    if not gpus:
        from dsq.ui import console

        parse_tensor_split(tensor_split)
        console().print("[yellow]note:[/yellow] no GPU: planning for the CPU (pass --vram SIZE to plan for a GPU, "
                        "e.g. --vram 8G)")
        return [0]
    parse_tensor_split(tensor_split, len(gpus))
    return [g.free_bytes for g in gpus]


def _check_budget(plan, vram: str, label: str) -> None:
    """A --vram budget (above 0) that holds no layer is an error saying what one layer needs."""
    from dsq.errors import DsqError

    if plan.gpu_layers == 0 and plan.vram_budget > 0 and plan.min_gpu_bytes > plan.vram_budget:
        raise DsqError(
            f"--vram {vram} holds no layer of {label}: one layer needs ~{plan.min_gpu_bytes / MIB:.0f} MiB on "
            f"{plan.backend} (its weights, KV cache for --ctx {plan.ctx}, buffers and the CUDA context); "
            "nothing goes on the GPU", "pass --vram 0 to plan for the CPU alone")


def _print_plan(plan, label: str) -> None:
    from rich.table import Table

    from dsq.ui import out_console

    t = Table(title=f"{label}: placement on {plan.backend} for {plan.vram_budget / 2**30:.1f} GiB VRAM, ctx {plan.ctx}",
              title_justify="left")
    for col in ("layer", "weights MiB", "types", "KV MiB", "device"):
        t.add_column(col, justify="right" if "MiB" in col else "left")
    t.add_row("token_embd", f"{plan.embed_bytes / MIB:.1f}", "", "", plan.embed_device, style=_style(plan.embed_device))
    several = len(plan.gpus) > 1
    for lc in plan.layers:
        types = ", ".join(f"{k}" for k, v in sorted(lc.types.items(), key=lambda kv: -kv[1]))
        where = f"GPU {lc.gpu}" if several and lc.gpu is not None else lc.device
        t.add_row(lc.name, f"{lc.weight_bytes / MIB:.1f}", types, f"{lc.kv_bytes / MIB:.1f}", where,
                  style=_style(lc.device))
    head_gpu = next((g["gpu"] for g in plan.gpus if g["output"]), None)
    out_where = plan.output_device.replace("GPU", f"GPU {head_gpu}") if several and head_gpu is not None \
        else plan.output_device
    t.add_row("output", f"{plan.output_bytes / MIB:.1f}", "", "", out_where, style=_style(plan.output_device))
    out = out_console()
    out.print(t)
    on_gpu = sum(lc.device == "GPU" for lc in plan.layers)
    moe = plan.expert_bytes_cpu or any(lc.expert_bytes for lc in plan.layers)
    head_placed = plan.backend == "native" and 0 <= on_gpu < plan.n_layer and plan.head != "gpu"
    ts = f" --tensor-split {','.join(f'{x:g}' for x in plan.tensor_split)}" if plan.tensor_split else ""
    run = f"dsq run -b {plan.backend} --gpu-layers {plan.gpu_layers_arg}{ts}" + (
        f" --experts {plan.experts}" if moe and plan.backend == "native" else "") + (
        f" --head {plan.head}" if head_placed else "")
    where = (f"{float(plan.head):.0%} of its rows on the GPU, the rest on the CPU" if plan.output_device == "GPU+CPU"
             else f"on the {plan.output_device}")
    out.print(f"GPU layers: [bold]{on_gpu}[/bold] of {plan.n_layer}, output head {where} ({run})")
    if moe:
        where = "in RAM (CPU)" if plan.experts == "cpu" else "with their layers"
        out.print(f"Routed experts: [bold]{where}[/bold]" + (
            f", {plan.expert_bytes_cpu / MIB:.0f} MiB" if plan.experts == "cpu" else ""))
    out.print(f"GPU memory: {plan.gpu_total_bytes / MIB:.0f} MiB of {plan.vram_budget / MIB:.0f} MiB "
              f"(compute buffers {plan.compute_gpu_bytes / MIB:.0f} MiB + reserve{' on each GPU' if several else ''})")
    for g in plan.gpus if several else []:
        held = f"{g['layers'][0]}..{g['layers'][1]}" if g["layers"] else "no layer"
        out.print(f"  GPU {g['gpu']}: {g['n_layers']} layers ({held}){', the output head' if g['output'] else ''}, "
                  f"{g['bytes'] / MIB:.0f} MiB of {g['budget_bytes'] / MIB:.0f} MiB")
    ram_note = "" if plan.ram_budget is None else (
        f" of {plan.ram_budget / MIB:.0f} MiB" + ("" if plan.fits_ram else " [red](does not fit)[/red]"))
    out.print(f"CPU memory: {plan.cpu_total_bytes / MIB:.0f} MiB{ram_note}")
    out.print(f"Per token: {plan.bytes_per_token_gpu / MIB:.0f} MiB read on the GPU ({plan.gpu_bw / 1e9:.0f} GB/s), "
              f"{plan.bytes_per_token_cpu / MIB:.0f} MiB on the CPU ({plan.cpu_bw / 1e9:.1f} GB/s); "
              f"bandwidths {plan.bandwidth_source}")
    out.print(f"Decode: predicted [bold]{plan.predicted_tok_s:.1f} tok/s[/bold] "
              f"(bandwidth roofline {plan.roofline_tok_s:.1f} tok/s)")
    for n in plan.notes:
        out.print(f"[yellow]note:[/yellow] {n}")


def _style(device: str) -> str | None:
    return "green" if device == "GPU" else None


# -- --measure ---------------------------------------------------------------------------------------
def _measure(ref, backend: str, gpu_layers: str | None, ctx: int, prompt_tokens: int, gen_tokens: int,
             repeat: int, threads: int | None, bw_given: dict, as_json: bool, experts: str = "gpu",
             head: str | None = None) -> None:
    """Predicted beside measured decode tok/s at each split, timed by dsq bench's runner (the
    native backend with its routed experts where `experts` says)."""
    from dsq.bench.metrics import cuda_context_bytes
    from dsq.bench.prediction import predicted_plans
    from dsq.bench.report import summarize
    from dsq.bench.runner import bench_ctx, machine_info, run_bench
    from dsq.runtime.machine import machine_bandwidths
    from dsq.runtime.placement import detect_gpu
    from dsq.ui import console, status

    con = console()
    gpu = detect_gpu()
    sweep = _sweep(ref.path, gpu_layers, ctx, backend, gpu is not None)
    bw = machine_bandwidths(gpu, threads=threads, **bw_given)
    with status("measuring", con) as st:
        records = run_bench(str(ref.path), backends=(backend,), gpu_layers=sweep, prompt_tokens=prompt_tokens,
                            gen_tokens=gen_tokens, repeat=repeat, threads=threads, ctx=ctx,
                            on_status=lambda s: st.update(s),
                            model_opts={"native": {"experts": experts, "head": head}} if backend == "native" else None)
    rows = summarize([r.as_dict() for r in records])
    plans = predicted_plans(ref.path, rows, ctx=bench_ctx(ctx, prompt_tokens, gen_tokens),
                            kv_tokens=prompt_tokens + gen_tokens // 2, bandwidths=bw,
                            experts=records[0].experts if records else "gpu")  # as the runs resolved it
    splits = [_compare(r, plans[(r["backend"], str(r["gpu_layers"]))]) for r in rows]
    report = {"model": str(ref.path), "label": ref.label, "backend": backend, "machine": machine_info(),
              "bandwidths": {"cpu": bw.cpu, "gpu": bw.gpu, "split_overhead_s": bw.split_overhead_s,
                             "source": bw.source},
              "settings": {"prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens, "repeat": repeat,
                           "threads": records[0].threads, "ctx": bench_ctx(ctx, prompt_tokens, gen_tokens),
                           "cuda_context_mb": _mib(cuda_context_bytes())},
              "splits": splits, "notes": bw.notes}
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    _print_measure(report)


def _sweep(model, gpu_layers: str | None, ctx: int, backend: str, has_gpu: bool) -> list:
    """The splits to measure: as given, else 0 and quarters of the layers up to all (only 0 without a GPU)."""
    from dsq.runtime.gpu_layers import GpuLayers, parse_for
    from dsq.runtime.model_shape import n_layer_of

    if gpu_layers:
        return [parse_for(g, model, ctx, backend) for g in gpu_layers.split(",") if g.strip()]
    if not has_gpu:
        return [GpuLayers.NONE]
    n = n_layer_of(model)
    counts = dict.fromkeys([0, n // 4, n // 2, 3 * n // 4])
    return [GpuLayers.parse(str(c)) for c in counts] + [GpuLayers.ALL]


def _compare(row: dict, plan) -> dict:
    measured, predicted = row["decode_tok_s_median"], plan.predicted_tok_s
    return {"gpu_layers": str(row["gpu_layers"]), "gpu_layers_effective": row["gpu_layers_effective"],
            "predicted_tok_s": round(predicted, 2), "measured_tok_s": measured,
            "error_pct": round(100 * (predicted - measured) / measured, 1) if measured else None,
            "planned_gpu_mb": _mib(plan.gpu_total_bytes), "peak_vram_mb": row["peak_vram_mb"],
            "gpu_bytes_per_token": plan.bytes_per_token_gpu, "cpu_bytes_per_token": plan.bytes_per_token_cpu}


def _mib(n: int | None) -> float | None:
    return None if n is None else round(n / MIB, 1)


def _print_measure(report: dict) -> None:
    from rich.table import Table

    from dsq.bench.report import vram_caption, vram_cell
    from dsq.ui import out_console

    s, bw = report["settings"], report["bandwidths"]
    context = None if s["cuda_context_mb"] is None else int(s["cuda_context_mb"] * MIB)
    t = Table(title=f"{report['label']} on {report['backend']}: predicted and measured decode, "
                    f"{s['prompt_tokens']} prompt + {s['gen_tokens']} generated tokens, {s['repeat']} runs",
              title_justify="left",
              caption=f"planned GPU memory includes {_reserve_mib()} MiB for the CUDA context and workspaces\n"
                      f"{vram_caption(context)}")
    for col in ("gpu layers", "predicted tok/s", "measured tok/s", "error", "planned GPU MiB", "peak VRAM MiB"):
        t.add_column(col, justify="right")
    for x in report["splits"]:
        err = "" if x["error_pct"] is None else f"{x['error_pct']:+.0f}%"
        t.add_row(x["gpu_layers"], f"{x['predicted_tok_s']:.1f}", f"{x['measured_tok_s']:.1f}", err,
                  f"{x['planned_gpu_mb']:.0f}", vram_cell(x["peak_vram_mb"]))
    out = out_console()
    out.print(t)
    out.print(f"Bandwidth: CPU {bw['cpu'] / 1e9:.1f} GB/s, GPU {bw['gpu'] / 1e9:.0f} GB/s, split exchange "
              f"{bw['split_overhead_s'] * 1e6:.0f} us a token, {s['threads']} threads; bandwidths {bw['source']}")
    errs = [abs(x["error_pct"]) for x in report["splits"] if x["error_pct"] is not None]
    if errs:
        out.print(f"Largest error: {max(errs):.0f}%")
    for n in report["notes"]:
        out.print(f"[yellow]note:[/yellow] {n}")


def _reserve_mib() -> int:
    from dsq.runtime.placement import GPU_RESERVE

    return GPU_RESERVE // MIB
