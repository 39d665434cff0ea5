"""Placement plan: sizes, budgets, and the bandwidth model against measured llama.cpp speeds."""

from __future__ import annotations

import pytest

from dsq.errors import DsqError
from dsq.runtime.placement import GiB, MiB, ModelShape, parse_size, plan_placement


def test_parse_size():
    assert parse_size("24G") == parse_size("24GiB") == parse_size("24gb") == 24 * GiB
    assert parse_size("512M") == 512 * MiB
    assert parse_size("1.5T") == int(1.5 * (1 << 40))
    assert parse_size("8") == 8 * GiB
    with pytest.raises(DsqError):
        parse_size("lots")


def llama3_8b_q4_k_m() -> ModelShape:
    """Llama-3-8B in Q4_K_M: 4.92 GB file (the anchor model measured on the H200)."""
    n = 32
    per_layer = int((4.92e9 - 2 * 0.27e9) / n)  # embedding Q4_K and output Q6_K ~0.27-0.4 GB each
    return ModelShape("llama3-8b", "llama", n, 8192, 4096, 32, 8, 128, 128, 128256, 14336,
                      [{"Q4_K": per_layer}] * n, 282_000_000, 420_000_000, "Q6_K", 270_000, [False] * n)


@pytest.mark.parametrize("ngl,measured", [(8, 17.6), (16, 24.9), (33, 293.5)])
def test_bandwidth_model_reproduces_measured_offload(ngl, measured):
    """docs/anchors: llama.cpp on the H200 host (4.25 TB/s GPU, 92 GB/s CPU)."""
    shape = llama3_8b_q4_k_m()
    # find the budget that yields exactly `ngl` layers, then compare the prediction
    lo = plan_placement(shape, vram=0, ctx=512, gpu_bw=4.25e12, cpu_bw=92e9)
    assert lo.gpu_layers == 0
    for vram_gib in [x / 4 for x in range(1, 400)]:
        plan = plan_placement(shape, vram=int(vram_gib * GiB), ctx=512, gpu_bw=4.25e12, cpu_bw=92e9)
        if plan.gpu_layers >= ngl:
            break
    assert plan.gpu_layers == ngl
    err = abs(plan.predicted_tok_s - measured) / measured
    print(f"--gpu-layers {ngl}: predicted {plan.predicted_tok_s:.1f} tok/s, measured {measured} ({err:.0%})")
    assert err < 0.15


def test_gpu_layers_devices_follow_llama_cpp():
    """The last N layers on the GPU; N > n_layer (or all) moves the output head too."""
    from dsq.runtime.gpu_layers import GpuLayers

    gpu, n_layer = "cuda:0", 4

    def where(g):
        per, head = GpuLayers.parse(g).devices(n_layer, gpu)
        return ["G" if d == gpu else "C" for d in per], "G" if head == gpu else "C"

    assert where("0") == (["C"] * 4, "C")
    assert where("1") == (["C", "C", "C", "G"], "C")
    assert where("4") == (["G"] * 4, "C")
    assert where("5") == where("50") == where("all") == (["G"] * 4, "G")
    assert [GpuLayers.parse(g).count(n_layer) for g in ("0", "3", "9", "all")] == [0, 3, 5, 5]
    per, head = GpuLayers.ALL.devices(n_layer, None)  # no GPU: all on the CPU
    assert {str(d) for d in per} == {str(head)} == {"cpu"}


def test_plan_places_layers_as_gpu_layers_does(builtin_gguf):
    """The plan's devices are what its --gpu-layers value puts on the GPU."""
    from dsq.runtime.gpu_layers import GpuLayers

    for mb in (300, 400, 2000):
        plan = plan_placement(builtin_gguf, vram=mb * MiB, ctx=2048, gpu_bw=1e12, cpu_bw=20e9)
        per, head = GpuLayers.parse(plan.gpu_layers).devices(plan.n_layer, "gpu")
        assert [lc.device == "GPU" for lc in plan.layers] == [d == "gpu" for d in per]
        assert (plan.output_device == "GPU") == (head == "gpu")


def test_plan_is_monotone_and_consistent(builtin_gguf):
    from dsq.formats.gguf_file import GGUFFile

    g = GGUFFile(builtin_gguf)
    prev = -1
    for mb in (0, 300, 350, 400, 600, 800, 2000):
        plan = plan_placement(builtin_gguf, vram=mb * MiB, ctx=2048, gpu_bw=1e12, cpu_bw=20e9)
        assert plan.gpu_layers >= prev
        prev = plan.gpu_layers
        assert plan.gpu_total_bytes <= plan.vram_budget
        on_gpu = [lc for lc in plan.layers if lc.device == "GPU"]
        assert len(on_gpu) == min(plan.gpu_layers, plan.n_layer)
        # llama.cpp offloads the *last* layers first
        assert all(lc.device == "GPU" for lc in plan.layers[plan.n_layer - len(on_gpu):])
    assert prev == g.n_layers + 1
    blk = sum(t.n_bytes for t in g.tensors if t.name.startswith("blk."))
    assert sum(lc.weight_bytes for lc in plan.layers) == blk


def test_prediction_follows_bytes(builtin_gguf):
    plan = plan_placement(builtin_gguf, vram=0, ctx=512, gpu_bw=1e12, cpu_bw=20e9)
    assert plan.bytes_per_token_gpu == 0
    assert plan.roofline_tok_s == pytest.approx(20e9 / plan.bytes_per_token_cpu)
    full = plan_placement(builtin_gguf, vram=8 * GiB, ctx=512, gpu_bw=1e12, cpu_bw=20e9)
    assert full.bytes_per_token_cpu < plan.bytes_per_token_cpu and full.predicted_tok_s > plan.predicted_tok_s


def test_kv_cache_grows_with_context(builtin_gguf):
    small = plan_placement(builtin_gguf, vram=0, ctx=1024, gpu_bw=1e12, cpu_bw=20e9)
    big = plan_placement(builtin_gguf, vram=0, ctx=8192, gpu_bw=1e12, cpu_bw=20e9)
    # Gemma 3 270M: 1 KV head x (256 + 256) dims x 2 bytes per token per layer
    assert big.layers[0].kv_bytes == 8192 * 512 * 2
    assert big.layers[0].kv_bytes == 8 * small.layers[0].kv_bytes
    window = plan_placement(builtin_gguf, vram=0, ctx=8192, gpu_bw=1e12, cpu_bw=20e9, swa_full=False)
    assert window.layers[0].kv_bytes < big.layers[0].kv_bytes  # sliding layer
    assert window.layers[5].kv_bytes == big.layers[5].kv_bytes  # global layer
