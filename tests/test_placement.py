"""Placement plan: sizes, budgets, and the bandwidth model against measured llama.cpp speeds."""

from __future__ import annotations

import pytest

from dsq.errors import DsqError
from dsq.runtime.placement import HEAD_SHARES, GiB, MiB, ModelShape, parse_size, plan_placement


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
    from dsq.runtime.machine import Bandwidths

    plan = plan_placement(builtin_gguf, vram=0, ctx=512, gpu_bw=1e12, cpu_bw=20e9)
    assert plan.bytes_per_token_gpu == 0
    assert plan.roofline_tok_s == pytest.approx(20e9 / plan.bytes_per_token_cpu)
    # a calibration's kernel read above the figure the efficiencies were fit on: the roofline rises,
    # the prediction does not
    peak = plan_placement(builtin_gguf, vram=0, ctx=512,
                          bandwidths=Bandwidths(cpu=20e9, gpu=1e12, split_overhead_s=0.0, source="t", cpu_peak=30e9))
    assert peak.roofline_tok_s == pytest.approx(30e9 / plan.bytes_per_token_cpu)
    assert peak.predicted_tok_s == pytest.approx(plan.predicted_tok_s)
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


# -- the plan per backend ----------------------------------------------------------------------------
def h200():
    """The H200 machine's figures (docs/benchmarks.md#offload-model), fixed so no test measures."""
    from dsq.runtime.machine import Bandwidths

    return Bandwidths(cpu=93e9, gpu=4.2e12, split_overhead_s=50e-6, source="test")


def test_native_zero_layers_keep_the_head_on_the_gpu():
    """native --gpu-layers 0 on a machine with VRAM: the output head's rows on the GPU, by default
    the share that fits the room llama.cpp's CUDA build reserves for a micro-batch's logits at -ngl 0
    (split_head: four tenths of an 8B's head): a token then reads those rows from VRAM and the
    rest from RAM, predicted faster than --head cpu, the whole head faster still. With no VRAM, or
    with --head cpu, nothing is on the GPU."""
    shape = llama3_8b_q4_k_m()
    rows = plan_placement(shape, vram=8 * GiB, ctx=4096, backend="native", gpu_layers=0, bandwidths=h200())
    assert rows.gpu_layers == 0 and rows.output_device == "GPU+CPU" and rows.head == "0.4"
    assert rows.gpu_layers_arg == "0" and rows.split_overhead_s > 0
    on = plan_placement(shape, vram=8 * GiB, ctx=4096, backend="native", gpu_layers=0, head="gpu", bandwidths=h200())
    assert on.output_device == "GPU" and on.bytes_per_token_gpu == shape.output_bytes
    off = plan_placement(shape, vram=8 * GiB, ctx=4096, backend="native", gpu_layers=0, head="cpu", bandwidths=h200())
    assert off.output_device == "CPU" and off.gpu_total_bytes == 0 and off.bytes_per_token_gpu == 0
    assert on.predicted_tok_s > rows.predicted_tok_s > off.predicted_tok_s
    assert off.gpu_total_bytes < rows.gpu_total_bytes < on.gpu_total_bytes
    none = plan_placement(shape, vram=0, ctx=4096, backend="native", gpu_layers=0, bandwidths=h200())
    assert none.output_device == "CPU" and none.gpu_total_bytes == 0


def test_native_plan_weighs_the_head_against_layers():
    """native: `--gpu-layers N` puts the output head on the GPU with any layer, the embedding in RAM
    (host-mapped). Choosing, the plan weighs the head against the layers its VRAM would hold: a
    budget that holds the head and one layer but not more puts layers there and the head in RAM
    (--head cpu), as llama.cpp places it; a budget below one layer holds a share of the head's rows
    alone (a prompt's streamed layer beside them), and one below that leaves everything on the CPU."""
    shape = llama3_8b_q4_k_m()
    one = plan_placement(shape, vram=0, ctx=512, backend="native", gpu_layers=1, bandwidths=h200())
    assert one.output_device == "GPU" and one.embed_device == "CPU" and one.gpu_layers == 1
    head_only = one.gpu_total_bytes - one.layers[-1].weight_bytes - one.layers[-1].kv_bytes
    assert one.min_gpu_bytes == head_only + one.layers[-1].weight_bytes + one.layers[-1].kv_bytes - shape.output_bytes
    plan = plan_placement(shape, vram=head_only, ctx=512, backend="native", bandwidths=h200())
    assert plan.gpu_layers > 0 and plan.output_device == "CPU"  # the head's VRAM holds layers instead
    llama = plan_placement(shape, vram=head_only, ctx=512, backend="llama.cpp", bandwidths=h200())
    assert llama.gpu_layers > 0 and llama.output_device == "CPU"  # llama.cpp: layers first, the head last
    rows = plan_placement(shape, vram=one.min_gpu_bytes - 1, ctx=512, backend="native", bandwidths=h200())
    assert rows.gpu_layers == 0 and rows.output_device == "GPU+CPU" and 0 < float(rows.head) < 1
    assert rows.gpu_total_bytes <= one.min_gpu_bytes - 1 and "not even one layer fits" in rows.notes[0]
    assert rows.bytes_per_token_gpu == pytest.approx(float(rows.head) * shape.output_bytes, abs=1)
    fixed = rows.gpu_total_bytes - round(float(rows.head) * shape.output_bytes)  # what holds no head row
    none = plan_placement(shape, vram=fixed, ctx=512, backend="native", bandwidths=h200())
    assert none.gpu_layers == 0 and none.gpu_total_bytes == 0 and none.output_device == "CPU"
    assert "not even one layer fits" in none.notes[0]
    full = plan_placement(shape, vram=64 * GiB, ctx=512, backend="native", bandwidths=h200())
    roomy = plan_placement(shape, vram=full.gpu_total_bytes - one.layers[-1].weight_bytes // 2, ctx=512,
                           backend="native", bandwidths=h200())
    # short of everything by half a layer: 31 layers and most of the head's rows (the head is ~3 layers'
    # bytes, read every token) in VRAM, predicted faster than 30 layers and all of the head, which also fit
    assert roomy.gpu_layers == shape.n_layer - 1 and roomy.output_device == "GPU+CPU" and 0.5 <= float(roomy.head) < 1
    whole = plan_placement(shape, vram=0, ctx=512, backend="native", gpu_layers=30, bandwidths=h200())
    assert whole.gpu_total_bytes <= roomy.vram_budget and roomy.predicted_tok_s > whole.predicted_tok_s
    assert roomy.bytes_per_token_gpu > whole.bytes_per_token_gpu - shape.output_bytes + 0.5 * shape.output_bytes
    assert full.gpu_layers == shape.n_layer and full.gpu_layers_arg == "all"
    assert full.embed_device == "CPU" and full.output_device == "GPU" and full.bytes_per_token_cpu == shape.misc_bytes
    assert full.split_overhead_s == 0 and one.split_overhead_s == 50e-6


@pytest.mark.parametrize("backend", ["native", "llama.cpp"])
def test_plan_choice_against_every_split(backend):
    """Over a sweep of budgets: the plan fits; native's is the fastest predicted split that fits
    (its head on the GPU, in RAM, or split by rows), llama.cpp's the most layers that fit (its own
    rule, unchanged)."""
    shape = llama3_8b_q4_k_m()
    heads = ("gpu", "cpu", *(f"{h:g}" for h in HEAD_SHARES)) if backend == "native" else (None,)
    splits = [plan_placement(shape, vram=0, ctx=2048, backend=backend, gpu_layers=n, bandwidths=h200(), head=h)
              for n in range(shape.n_layer + 2) for h in heads]
    if backend == "native":  # (8 layers: --head cpu, then 0.1)
        assert splits[8 * len(heads) + 1].output_device == "CPU" and splits[8 * len(heads) + 2].head == "0.1"
        assert splits[8 * len(heads) + 2].output_device == "GPU+CPU"
    for vram_gib in [x / 2 for x in range(0, 16)]:
        vram = int(vram_gib * GiB)
        plan = plan_placement(shape, vram=vram, ctx=2048, backend=backend, bandwidths=h200())
        assert plan.gpu_total_bytes <= vram
        fits = [s for s in splits if s.gpu_total_bytes <= vram]
        if backend == "native":
            assert plan.predicted_tok_s == pytest.approx(max(s.predicted_tok_s for s in fits))
        else:
            assert plan.gpu_layers == max(s.gpu_layers for s in fits)


def test_llama_cpp_plan_keeps_its_placement():
    """llama.cpp's plan for a budget: the last N layers, the head only past n_layer, as before."""
    shape = llama3_8b_q4_k_m()
    got = [plan_placement(shape, vram=int(g * GiB), ctx=512, backend="llama.cpp", bandwidths=h200()).gpu_layers
           for g in (1, 1.5, 2, 3, 4, 5, 6)]
    assert got == [0, 4, 8, 16, 24, 31, 33]


def test_native_kv_cache_sits_with_its_layer():
    """native: a GPU layer's cache in bf16, a CPU layer's in float32, each sized by --ctx; a
    longer context leaves room for fewer layers."""
    shape = llama3_8b_q4_k_m()
    plan = plan_placement(shape, vram=0, ctx=4096, backend="native", gpu_layers=8, bandwidths=h200())
    per_token = shape.n_head_kv * (shape.head_dim_k + shape.head_dim_v)
    assert [lc.kv_bytes for lc in plan.layers[:1] + plan.layers[-1:]] == [4096 * per_token * 4, 4096 * per_token * 2]
    short = plan_placement(shape, vram=3 * GiB, ctx=1024, backend="native", bandwidths=h200())
    long = plan_placement(shape, vram=3 * GiB, ctx=131072, backend="native", bandwidths=h200())
    assert long.gpu_layers < short.gpu_layers


def test_native_plan_of_a_tied_model_counts_the_embedding_once():
    """Tied head and embedding: a split copies the head to the GPU; all on the GPU shares one tensor."""
    import dataclasses

    shape = dataclasses.replace(llama3_8b_q4_k_m(), output_bytes=282_000_000, tied=True)
    split = plan_placement(shape, vram=0, ctx=512, backend="native", gpu_layers=31, bandwidths=h200())
    full = plan_placement(shape, vram=0, ctx=512, backend="native", gpu_layers="all", bandwidths=h200())
    layer = full.layers[0].weight_bytes + full.layers[0].kv_bytes
    assert full.gpu_total_bytes - split.gpu_total_bytes < layer + 64 * MiB  # no second embedding
    assert split.cpu_total_bytes > shape.embed_bytes  # the embedding itself stays on the CPU


def test_prediction_is_bytes_over_bandwidth_plus_the_split_exchange():
    from dsq.runtime.placement import EFFICIENCY

    shape, bw = llama3_8b_q4_k_m(), h200()
    for backend in ("native", "llama.cpp"):
        eff = EFFICIENCY[backend]
        p = plan_placement(shape, vram=0, ctx=512, backend=backend, gpu_layers=16, kv_tokens=100, bandwidths=bw)
        seconds = (p.bytes_per_token_gpu / (bw.gpu * eff.gpu) + p.bytes_per_token_cpu / (bw.cpu * eff.cpu)
                   + bw.split_overhead_s)
        assert p.predicted_tok_s == pytest.approx(1 / seconds)
    # the KV cache read per token follows the tokens in it, not the context it could hold
    a = plan_placement(shape, vram=0, ctx=8192, backend="native", gpu_layers=0, kv_tokens=100, bandwidths=bw)
    b = plan_placement(shape, vram=0, ctx=8192, backend="native", gpu_layers=0, bandwidths=bw)
    assert a.bytes_per_token_cpu < b.bytes_per_token_cpu


def test_native_cpu_layers_hold_float_weights_as_float32():
    import dataclasses

    shape = dataclasses.replace(llama3_8b_q4_k_m(), layers=[{"F16": 100 * MiB, "F32": MiB}] * 32)
    native = plan_placement(shape, vram=0, ctx=512, backend="native", gpu_layers=16, bandwidths=h200())
    assert native.layers[0].weight_bytes == 201 * MiB and native.layers[-1].weight_bytes == 101 * MiB
    llama = plan_placement(shape, vram=0, ctx=512, backend="llama.cpp", gpu_layers=16, bandwidths=h200())
    assert llama.layers[0].weight_bytes == 101 * MiB


# -- the calibration -----------------------------------------------------------------------------------
def _calibration(days_old: float = 0, **machine):
    import datetime

    from dsq.runtime.machine import Calibration, machine_identity

    taken = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=days_old)
    return Calibration(taken=taken.isoformat(timespec="seconds"), machine={**machine_identity(None), **machine},
                       threads=2, cpu_read_bw=12e9, gpu_copy_bw=None, h2d_bw=None, split_overhead_s=None)


def test_calibration_fresh_stale_and_other_machine(tmp_path, monkeypatch):
    import dsq.runtime.machine as machine

    path = tmp_path / "calibration.json"
    monkeypatch.setattr(machine, "measure_cpu_read", lambda threads, *a, **k: 7e9)
    cal = _calibration()
    machine.save_calibration(cal, path)
    assert machine.load_calibration(path) == cal
    fresh = machine.machine_bandwidths(None, path=path)
    assert fresh.cpu == 12e9 and fresh.notes == [] and fresh.source.startswith("calibrated")
    assert fresh.split_overhead_s == machine.SPLIT_OVERHEAD_S  # no GPU was calibrated
    machine.save_calibration(_calibration(days_old=machine.CALIBRATION_MAX_AGE_DAYS + 5), path)
    stale = machine.machine_bandwidths(None, path=path)
    assert stale.cpu == 12e9 and "days old" in stale.notes[0]
    machine.save_calibration(_calibration(cores=999), path)
    other = machine.machine_bandwidths(None, path=path)
    assert other.cpu == 7e9 and "another machine" in other.notes[0]  # measured for this call instead
    assert fresh.cpu_peak is None and fresh.cpu_ceiling == 12e9  # a calibration from before the kernels' probe
    path.unlink()
    none = machine.machine_bandwidths(None, path=path)
    assert none.cpu == 7e9 and "not kept" in none.source and not path.exists()
    assert machine.machine_bandwidths(None, path=path, measure=False).cpu == machine.NOMINAL_CPU_BW


def test_calibrate_command_keeps_the_figures(runner, tmp_path, monkeypatch):
    import json

    import dsq.runtime.machine as machine
    import dsq.runtime.placement as placement
    from dsq.cli import app

    monkeypatch.setenv("DSQ_CACHE", str(tmp_path))
    monkeypatch.setattr(machine, "measure_cpu_read", lambda threads, *a, **k: 21e9)
    monkeypatch.setattr(machine, "measure_cpu_peak_read", lambda threads, *a, **k: 27e9)
    monkeypatch.setattr(machine, "_cuda_available", lambda: False)  # a machine without a GPU, on any machine
    monkeypatch.setattr(placement, "detect_gpu", lambda: None)
    r = runner.invoke(app, ["offload", "--calibrate", "--json"])
    assert r.exit_code == 0, r.output
    saved = json.loads((tmp_path / "calibration.json").read_text())
    assert saved == json.loads(r.stdout)
    assert saved["cpu_read_bw"] == 21e9 and saved["cpu_peak_read_bw"] == 27e9 and saved["gpu_copy_bw"] is None
    # the prediction keeps the figure its efficiencies were fit on; the roofline takes the ceiling
    bw = machine.machine_bandwidths(None)
    assert bw.cpu == 21e9 and bw.cpu_peak == 27e9 and bw.cpu_ceiling == 27e9
    assert set(saved["machine"]) == {"cpu", "cores", "gpu"} and saved["taken"].endswith("+00:00")
    r = runner.invoke(app, ["offload", "--vram", "8G", "-b", "native", "--gpu-bw", "1000"])
    assert r.exit_code == 0, r.output
    assert "calibrated" in r.stdout and "21.0 GB/s" in r.stdout


def test_offload_command_places_the_head(runner, tiny_gguf):
    """dsq offload -b native: a given split with --head cpu plans the head in RAM and says so in
    the command it suggests; --head 0.4 plans that share of its rows in VRAM, between the two;
    without either the head is on the GPU with the layers."""
    import json

    from dsq.cli import app

    path = str(tiny_gguf("llama", "Q8_0"))
    bw = ["--gpu-bw", "1000", "--cpu-bw", "20", "--vram", "1G"]
    plans = {}
    for head in ("gpu", "cpu", "0.4"):
        r = runner.invoke(app, ["offload", path, "-b", "native", "-g", "1", "--json", *bw, "--head", head])
        assert r.exit_code == 0, r.output
        plans[head] = json.loads(r.stdout)
    assert [plans[h]["output_device"] for h in ("gpu", "cpu", "0.4")] == ["GPU", "CPU", "GPU+CPU"]
    assert plans["cpu"]["gpu_total_bytes"] < plans["0.4"]["gpu_total_bytes"] < plans["gpu"]["gpu_total_bytes"]
    on_gpu = plans["0.4"]["gpu_total_bytes"] - plans["cpu"]["gpu_total_bytes"]
    assert on_gpu == pytest.approx(0.4 * plans["cpu"]["output_bytes"], abs=1)
    assert plans["cpu"]["bytes_per_token_cpu"] > plans["0.4"]["bytes_per_token_cpu"] > plans["gpu"]["bytes_per_token_cpu"]
    for head, said in (("cpu", "--head cpu"), ("0.4", "--head 0.4")):
        r = runner.invoke(app, ["offload", path, "-b", "native", "-g", "1", "--head", head, *bw])
        assert r.exit_code == 0 and f"--gpu-layers 1 {said}" in r.stdout.replace("\n", " "), r.output
    assert "40% of its rows on the GPU" in r.stdout.replace("\n", " ")


@pytest.mark.parametrize("n, head", [(0, "0.4"), (1, "gpu"), (8, "gpu"), (16, "gpu"), (24, "gpu"), (32, "gpu")])
def test_a_split_takes_the_head_rows_its_vram_margin_holds(n, head):
    """--gpu-layers N without --head: the share of the head's rows that fits in what llama.cpp's CUDA
    split reserves for its copy of the head and a micro-batch's logits, plus 10% of the N layers'
    bytes less what dsq's split takes beyond llama.cpp's: the whole head of an 8B at every split. At
    0 layers the logits' room alone: four tenths of it (its VRAM measured 1.05x llama.cpp's there)."""
    from dsq.runtime.gpu_layers import head_share
    from dsq.runtime.placement import (SPLIT_BASE_EXTRA, SPLIT_VRAM_MARGIN, head_gpu_bytes, llama_split_reserve,
                                       split_head)

    shape = llama3_8b_q4_k_m()
    assert split_head(shape, n, 4096) == head
    if 0 < n < shape.n_layer:
        layers = n * sum(shape.layers[0].values())
        room = SPLIT_VRAM_MARGIN * layers - SPLIT_BASE_EXTRA + llama_split_reserve(shape)
        assert llama_split_reserve(shape) == shape.output_bytes + 512 * 4 * 128256  # the head's copy, the logits
        assert head_gpu_bytes(shape.output_bytes, head_share(head)) <= room
    if n == 0:
        room = llama_split_reserve(shape, 0) - SPLIT_BASE_EXTRA
        assert llama_split_reserve(shape, 0) == 512 * 4 * 128256  # at -ngl 0: the logits alone
        assert head_gpu_bytes(shape.output_bytes, 0.4) <= room < head_gpu_bytes(shape.output_bytes, 0.5)


def test_a_split_head_without_llama_cpps_reserve_takes_the_margins_share(monkeypatch):
    """Where the head is larger than what llama.cpp's split reserves (a huge vocabulary over few
    bytes of layers), the share that fits the margin, in tenths; none where no tenth fits."""
    from dsq.runtime import placement

    shape = llama3_8b_q4_k_m()
    monkeypatch.setattr(placement, "llama_split_reserve", lambda s, n=1: 0)
    assert [placement.split_head(shape, n, 4096) for n in (1, 8, 16, 24)] == ["cpu", "0.1", "0.3", "0.6"]


def test_a_split_head_fits_the_free_vram():
    from dsq.runtime.placement import split_head

    shape = llama3_8b_q4_k_m()
    assert split_head(shape, 24, 4096, free_vram=64 * GiB) == "gpu"
    assert split_head(shape, 24, 4096, free_vram=1 * GiB) == "cpu"  # not even the layers fit: no rows either
    # free memory for the layers and part of the head: the largest tenth of its rows that fits
    from dsq.runtime.placement import GPU_RESERVE, _Costs, _option, _Option

    on = _option(shape, "native", 24).on_gpu
    costs = _Costs(shape, 4096, "native", 512, True, None, GPU_RESERVE)
    free = (costs.gpu_bytes(_Option(24, on, 0.4)) + costs.gpu_bytes(_Option(24, on, 0.5))) // 2
    assert split_head(shape, 24, 4096, free_vram=free) == "0.4"


def test_the_native_default_head_at_a_split_is_the_planners(monkeypatch, tiny_gguf):
    """NativeModel without --head: at a split on a GPU, 0 layers too, the planner's share, with the GPU's
    free memory; with every layer on the GPU, or without a GPU, the head whole (where its layers are);
    at 0 layers of a model whose shape cannot be read, in RAM."""
    import torch

    from dsq.runtime import native
    from dsq.runtime.gpu_layers import GpuLayers

    path = tiny_gguf("llama", "Q8_0")
    seen = {}

    def free(dev):
        seen["dev"] = dev
        return 10 * GiB, 80 * GiB

    monkeypatch.setattr(torch.cuda, "mem_get_info", free)
    monkeypatch.setattr("dsq.runtime.placement.split_head", lambda m, n, ctx, free_vram: f"{n}:{ctx}:{free_vram}")
    gpu = torch.device("cuda")
    assert native._split_head(path, GpuLayers(1), 256, gpu) == f"1:256:{10 * GiB}" and seen["dev"] == gpu
    assert native._split_head(path, GpuLayers(1), 256, None) == "gpu"
    assert native._split_head(path, GpuLayers.ALL, 256, gpu) == "gpu"
    assert native._split_head(path, GpuLayers(0), 256, gpu) == f"0:256:{10 * GiB}"
    assert native._split_head(None, GpuLayers(0), 256, gpu) == "cpu"
    assert native._split_head(None, GpuLayers(1), 256, gpu) == "gpu"
