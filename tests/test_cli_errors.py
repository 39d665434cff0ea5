"""Bad inputs through the CLI: one line on stderr, exit code 1, nothing left behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dsq.cli import app


def one_line_error(result, *needles: str) -> str:
    assert result.exit_code == 1, (result.exit_code, result.output)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.output
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


@pytest.fixture
def truncated_gguf(tiny_gguf, tmp_path):
    src = tiny_gguf("qwen2", "F16")
    data = src.read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[: len(data) // 2])
    return bad


@pytest.fixture
def unsupported_dir(tiny_dir, tmp_path):
    d = tmp_path / "mamba"
    shutil.copytree(tiny_dir("qwen2"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("cmd", [["run", "-p", "hi"], ["bench"], ["offload", "--vram", "1G"], ["convert"],
                                 ["quantize", "--out", "x.gguf"], ["chat"], ["serve", "--port", "0"]])
def test_missing_path(cmd, runner, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = cmd[:1] + [str(tmp_path / "nope.gguf")] + cmd[1:]
    if cmd[0] == "convert":
        args = ["convert", str(tmp_path / "nope.gguf"), str(tmp_path / "out")]
    one_line_error(runner.invoke(app, args), "does not exist")
    assert listing(tmp_path) == []


@pytest.mark.parametrize("cmd", [["run", "-p", "hi"], ["quantize"], ["offload", "--vram", "1G"]])
def test_dir_without_config(cmd, runner, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    args = cmd[:1] + [str(tmp_path / "empty")] + cmd[1:]
    one_line_error(runner.invoke(app, args), "no config.json")
    assert listing(tmp_path) == ["empty"]


@pytest.mark.parametrize("cmd", [["run", "-p", "hi"], ["bench"], ["offload", "--vram", "1G"],
                                 ["quantize", "--type", "Q8_0"]])
def test_truncated_gguf(cmd, runner, truncated_gguf, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = listing(tmp_path)
    args = cmd[:1] + [str(truncated_gguf)] + cmd[1:]
    one_line_error(runner.invoke(app, args), "truncated")
    assert listing(tmp_path) == before


def test_truncated_gguf_convert(runner, truncated_gguf, tmp_path):
    one_line_error(runner.invoke(app, ["convert", str(truncated_gguf), str(tmp_path / "hf")]), "truncated")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("cmd", [["quantize", "--type", "Q4_K_M"], ["run", "-p", "hi"]])
def test_unsupported_architecture(cmd, runner, unsupported_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = listing(tmp_path)
    line = one_line_error(runner.invoke(app, cmd[:1] + [str(unsupported_dir)] + cmd[1:]), "mamba")
    assert "llama" in line and "qwen2" in line and "gemma3" in line  # lists what is supported
    assert listing(tmp_path) == before


def test_unsupported_architecture_convert(runner, unsupported_dir, tmp_path):
    out = tmp_path / "m.gguf"
    one_line_error(runner.invoke(app, ["convert", str(unsupported_dir), str(out)]), "mamba")
    assert not out.exists()


def test_unknown_quant_type(runner, tiny_dir, tmp_path):
    out = tmp_path / "q.gguf"
    line = one_line_error(runner.invoke(app, ["quantize", str(tiny_dir("qwen2")), "--type", "Q9_Z", "--out", str(out)]),
                          "Q9_Z")
    assert "Q4_K_M" in line
    assert listing(tmp_path) == []


def test_existing_output_refused_and_kept(runner, tiny_dir, tiny_gguf, tmp_path):
    out = tmp_path / "q.gguf"
    out.write_bytes(b"precious")
    one_line_error(runner.invoke(app, ["quantize", str(tiny_dir("qwen2")), "--type", "Q8_0", "--out", str(out)]),
                   "already exists", "--force")
    assert out.read_bytes() == b"precious"
    assert listing(tmp_path) == ["q.gguf"]
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "keep").write_text("x")
    one_line_error(runner.invoke(app, ["convert", str(tiny_gguf("qwen2", "F16")), str(hf)]), "already exists")
    assert listing(hf) == ["keep"]


def test_damaged_safetensors_leaves_nothing(runner, tiny_dir, tmp_path):
    d = tmp_path / "broken"
    shutil.copytree(tiny_dir("llama"), d)
    st = d / "model.safetensors"
    st.write_bytes(st.read_bytes()[:4096])
    out = tmp_path / "out.gguf"
    one_line_error(runner.invoke(app, ["quantize", str(d), "--type", "Q8_0", "--out", str(out)]))
    assert listing(tmp_path) == ["broken"]


def test_force_overwrites(runner, tiny_dir, tmp_path):
    out = tmp_path / "q.gguf"
    out.write_bytes(b"old")
    r = runner.invoke(app, ["quantize", str(tiny_dir("qwen2")), "--type", "Q8_0", "--out", str(out), "--force"])
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:4] == b"GGUF"
    assert listing(tmp_path) == ["q.gguf"]


@pytest.mark.parametrize("args,needle", [
    (["run", "-p", "hi", "--temperature", "-1"], "--temperature"),
    (["run", "-p", "hi", "--gpu-layers", "many"], "--gpu-layers"),
    (["run", "-p", "hi", "--max-tokens", "0"], "--max-tokens"),
    (["offload", "--vram", "lots"], "size"),
])
def test_bad_values(args, needle, runner, tiny_gguf):
    one_line_error(runner.invoke(app, args[:1] + [str(tiny_gguf("qwen2", "F16"))] + args[1:]), needle)


def test_prompt_longer_than_context(runner, tiny_gguf):
    r = runner.invoke(app, ["run", str(tiny_gguf("qwen2", "F16")), "--ctx", "32", "-p", "word " * 200])
    one_line_error(r, "context")


def test_usage_error_exits_2(runner):
    r = runner.invoke(app, ["run", "--no-such-flag"])
    assert r.exit_code == 2


def test_debug_shows_traceback(runner, tmp_path, monkeypatch):
    monkeypatch.setenv("DSQ_DEBUG", "1")
    r = runner.invoke(app, ["run", str(tmp_path / "nope.gguf"), "-p", "x"])
    assert r.exit_code != 0
    from dsq.errors import ModelNotFound

    assert isinstance(r.exception, ModelNotFound)


# -- --gpu-layers and --vram that cannot be met ---------------------------------------------------------
@pytest.mark.parametrize("cmd", [["run", "-p", "hi"], ["bench"], ["offload", "--measure"], ["offload", "--vram", "8G"]])
def test_negative_gpu_layers_without_a_gpu(cmd, runner, tiny_gguf, monkeypatch):
    import dsq.runtime.placement as placement

    monkeypatch.setattr(placement, "detect_gpu", lambda: None)
    r = runner.invoke(app, cmd[:1] + [str(tiny_gguf("llama", "Q8_0"))] + cmd[1:] + ["--gpu-layers", "-3"])
    one_line_error(r, "--gpu-layers must be >= 0, got -3", "Use 'all' or 'auto'", "no GPU here")


def test_negative_gpu_layers_says_what_fits_the_gpu(runner, monkeypatch):
    """With a GPU: how many of the model's layers its free memory holds (the backend's plan)."""
    import re

    import dsq.runtime.placement as placement

    monkeypatch.setattr(placement, "detect_gpu", lambda: placement.GpuInfo("NVIDIA H200", 140 << 30, 760 << 20))
    line = one_line_error(runner.invoke(app, ["run", "-b", "native", "-p", "hi", "-g", "-3"]), "(760 MiB)")
    assert re.search(r"about \d+ of 18 layers fit", line), line


@pytest.mark.parametrize("backend", ["llama.cpp", "native"])
def test_vram_below_one_layer(backend, runner):
    r = runner.invoke(app, ["offload", "--vram", "100M", "-b", backend, "--gpu-bw", "1000", "--cpu-bw", "20"])
    one_line_error(r, "--vram 100M holds no layer of built-in Gemma 3 270M", "one layer needs ~",
                   "its weights", "nothing goes on the GPU", "--vram 0")
    r = runner.invoke(app, ["offload", "--vram", "0", "-b", backend, "--gpu-bw", "1000", "--cpu-bw", "20"])
    assert r.exit_code == 0, r.output  # the CPU alone is a plan


def test_gpu_layers_past_the_last_layer_means_all(runner, tiny_gguf, tmp_path):
    """--gpu-layers 99 on a smaller model: run, bench and offload all read it as every layer and
    the output head, and llama.cpp is handed -1."""
    path = str(tiny_gguf("llama", "Q8_0"))
    r = runner.invoke(app, ["run", path, "-p", "hi", "-n", "2", "-g", "99", "--json"])
    assert r.exit_code == 0, r.output
    from dsq.runtime.gpu_layers import gpu_usable

    assert json.loads(r.stdout)["gpu_layers"] == (-1 if gpu_usable("llama.cpp") else 0)  # 0: no GPU to hold them
    for backend in ("llama.cpp", "native"):
        r = runner.invoke(app, ["offload", path, "-b", backend, "-g", "99", "--vram", "8G", "--json",
                                "--gpu-bw", "1000", "--cpu-bw", "20"])
        plan = json.loads(r.stdout)
        assert plan["gpu_layers_arg"] == "all" and plan["output_device"] == "GPU"
        assert plan["gpu_layers"] == plan["n_layer"]  # the layers, not the backend's count with the head
        assert {layer["device"] for layer in plan["layers"]} == {"GPU"}
    jp = tmp_path / "b.json"
    r = runner.invoke(app, ["bench", path, "-g", "99", "--prompt-tokens", "8", "--max-tokens", "2", "--repeat", "1",
                            "--out", str(jp)])
    assert r.exit_code == 0, r.output
    assert [x["gpu_layers_effective"] for x in json.loads(jp.read_text())["runs"]] == [-1 if gpu_usable("llama.cpp")
                                                                                       else 0]


@pytest.mark.parametrize("args, needle", [
    (["--head", "vram"], "--head takes gpu, cpu or a share"),
    (["--head", "1.5"], "--head takes gpu, cpu or a share"),
    (["--head", "0"], "--head takes gpu, cpu or a share"),
    (["--head", "cpu", "-b", "llama.cpp"], "apply to the native backend"),
])
def test_bad_head_placement(runner, tiny_gguf, args, needle):
    """--head: gpu, cpu or a share of its rows between 0 and 1, and only the native backend places its head by it."""
    path = tiny_gguf("llama", "Q8_0")
    one_line_error(runner.invoke(app, ["run", str(path), "-p", "hi", "-n", "2"] + args), needle)
