"""`dsq offload`: show which layers fit on the GPU for a memory budget and the decode speed to expect."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from dsq.cli.common import ModelArg, command


@command("offload", examples=[
    "dsq offload --vram 1G",
    "dsq offload DeepSeek-R1-Distill-Llama-8B-Q4_K_M.gguf --vram 6G --ram 32G --ctx 8192",
    "dsq offload model.gguf --vram 24G --json",
])
def offload(
    model: ModelArg = None,
    vram: Annotated[Optional[str], typer.Option("--vram", help="GPU memory budget, e.g. 8G (default: free VRAM).")] = None,
    ram: Annotated[Optional[str], typer.Option("--ram", help="CPU memory budget, e.g. 32G.")] = None,
    ctx: Annotated[int, typer.Option("--ctx", "-c", help="Context length the KV cache must hold.")] = 4096,
    gpu_bw: Annotated[Optional[float], typer.Option("--gpu-bw", help="GPU bandwidth in GB/s (default: known card).")] = None,
    cpu_bw: Annotated[Optional[float], typer.Option("--cpu-bw", help="CPU bandwidth in GB/s (default: measured).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Plan the GPU/CPU split for a memory budget and predict decode speed.

    Bytes per layer (weights at their quant type + KV cache + compute buffers), how many layers
    fit on the GPU, and the decode tok/s a bandwidth model predicts.

    For GGUF models the plan is llama.cpp's --gpu-layers value (use it with `dsq run -g N`).
    """
    from dsq.errors import DsqError
    from dsq.runtime.model_ref import resolve_model
    from dsq.runtime.placement import detect_gpu, parse_size, plan_placement
    from dsq.ui import console, out_console

    con = console()
    if vram is None:
        gpu = detect_gpu()
        if gpu is None:
            raise DsqError("no GPU found here", "pass --vram SIZE to plan for a GPU, e.g. --vram 8G")
        vram_b = gpu.free_bytes
    else:
        vram_b = parse_size(vram)
    ref = resolve_model(model, con)
    plan = plan_placement(ref.path, vram=vram_b, ctx=ctx, ram=parse_size(ram),
                          gpu_bw=gpu_bw * 1e9 if gpu_bw else None, cpu_bw=cpu_bw * 1e9 if cpu_bw else None)
    if as_json:
        typer.echo(json.dumps(plan.as_dict(), indent=2))
        return
    from rich.table import Table

    mib = 2**20
    t = Table(title=f"{ref.label}: placement for {vram_b / 2**30:.1f} GiB VRAM, ctx {ctx}", title_justify="left")
    for col in ("layer", "weights MiB", "types", "KV MiB", "device"):
        t.add_column(col, justify="right" if "MiB" in col else "left")
    t.add_row("token_embd", f"{plan.embed_bytes / mib:.1f}", "", "", "CPU")
    for lc in plan.layers:
        types = ", ".join(f"{k}" for k, v in sorted(lc.types.items(), key=lambda kv: -kv[1]))
        style = "green" if lc.device == "GPU" else None
        t.add_row(lc.name, f"{lc.weight_bytes / mib:.1f}", types, f"{lc.kv_bytes / mib:.1f}", lc.device, style=style)
    t.add_row("output", f"{plan.output_bytes / mib:.1f}", "", "", plan.output_device,
              style="green" if plan.output_device == "GPU" else None)
    out = out_console()
    out.print(t)
    out.print(f"GPU layers: [bold]{plan.gpu_layers}[/bold] of {plan.n_layer + 1} (llama.cpp --gpu-layers {plan.gpu_layers})")
    out.print(f"GPU memory: {plan.gpu_total_bytes / mib:.0f} MiB of {plan.vram_budget / mib:.0f} MiB "
              f"(compute buffers {plan.compute_gpu_bytes / mib:.0f} MiB + reserve)")
    ram_note = "" if plan.ram_budget is None else (
        f" of {plan.ram_budget / mib:.0f} MiB" + ("" if plan.fits_ram else " [red](does not fit)[/red]"))
    out.print(f"CPU memory: {plan.cpu_total_bytes / mib:.0f} MiB{ram_note}")
    out.print(f"Per token: {plan.bytes_per_token_gpu / mib:.0f} MiB read on the GPU ({plan.gpu_bw / 1e9:.0f} GB/s), "
              f"{plan.bytes_per_token_cpu / mib:.0f} MiB on the CPU ({plan.cpu_bw / 1e9:.0f} GB/s)")
    out.print(f"Decode: predicted [bold]{plan.predicted_tok_s:.1f} tok/s[/bold] "
              f"(bandwidth roofline {plan.roofline_tok_s:.1f} tok/s)")
    for n in plan.notes:
        out.print(f"[yellow]note:[/yellow] {n}")
