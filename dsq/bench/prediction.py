"""The offload model beside measured runs: the placement plan's decode tok/s at the split each bench
row ran (`dsq offload --measure`, and the dashed lines of `dsq bench --plot`)."""

from __future__ import annotations

from pathlib import Path

from dsq.runtime.gpu_layers import GpuLayers
from dsq.runtime.machine import Bandwidths, machine_bandwidths
from dsq.runtime.placement import Plan, detect_gpu, plan_placement


def predicted_plans(model: str | Path, rows: list[dict], *, ctx: int, kv_tokens: int,
                    bandwidths: Bandwidths | None = None, experts: str = "gpu") -> dict[tuple[str, str], Plan]:
    """(backend, --gpu-layers as asked) -> the plan at the split that bench summary row ran, for
    its rows of one sequence (the model predicts batch-1 decode); `experts`: where the native
    runs had a MoE model's routed experts ("gpu" or "cpu"), for rows that do not say (a summary row's
    own `experts`, where the run was, wins)."""
    from dsq.runtime.model_shape import load_shape

    shape = load_shape(model)
    gpu = detect_gpu()
    bw = bandwidths or machine_bandwidths(gpu)
    plans = {}
    for r in rows:
        if r.get("batch", 1) != 1:
            continue
        split = _split_ran(r, gpu is not None)
        plans[(r["backend"], str(r["gpu_layers"]))] = plan_placement(
            shape, vram=0, ctx=ctx, backend=r["backend"], gpu_layers=split, kv_tokens=kv_tokens, bandwidths=bw,
            experts=r.get("experts", experts) if r["backend"] == "native" else "gpu", head=r.get("head"))
    return plans


def _split_ran(row: dict, has_gpu: bool) -> GpuLayers:
    """What a row's --gpu-layers put on the GPU here: nothing without a GPU (or, for llama.cpp,
    without a build that offloads)."""
    offloads = has_gpu
    if row["backend"] == "llama.cpp" and has_gpu:
        from dsq.runtime.llama_cpp_backend import supports_gpu_offload

        offloads = supports_gpu_offload()
    return GpuLayers.parse(int(row["gpu_layers_effective"])).on(True if offloads else None)
