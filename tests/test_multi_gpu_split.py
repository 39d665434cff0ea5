"""The layer split over several GPUs plus the CPU (issue 42), on the CPU.

Two stand-in GPUs: the devices cpu:0 and cpu:1, which the runtime takes from its one seam
(gpu_layers.visible_gpus). Tensors on them compute on the CPU, but the placement keeps them apart:
a layer on cpu:1 is another device than one on cpu:0 or on the CPU, and moving the hidden state to
a stand-in is a real copy, which the tests count.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dsq.runtime import gpu_layers
from dsq.runtime.gpu_layers import GpuLayers, divide_layers, parse_tensor_split
from dsq.runtime.generate import GenStats
from dsq.runtime.sampling import SamplingParams

CPU = torch.device("cpu")
G0, G1 = torch.device("cpu", 0), torch.device("cpu", 1)


# -- dividing the GPU layers ------------------------------------------------------------------------
@pytest.mark.parametrize("k, shares, counts", [
    (8, [1, 1], [4, 4]),
    (8, [3, 1], [6, 2]),
    (7, [1, 1], [4, 3]),  # the layer on the boundary goes to the earlier GPU, as llama.cpp's
    (3, [1, 1, 1], [1, 1, 1]),
    (5, [1, 0, 1], [3, 0, 2]),  # a GPU with no share gets nothing
    (1, [1, 1], [1, 0]),
    (0, [1, 1], [0, 0]),
    (10, [24, 8], [8, 2]),  # free memory in bytes or GiB: only the proportions count
])
def test_divide_layers(k, shares, counts):
    assert divide_layers(k, shares) == counts
    assert sum(divide_layers(k, shares)) == k


def test_devices_cpu_first_then_contiguous_ranges_head_on_last_gpu():
    per, head = GpuLayers.parse("5").devices(8, [G0, G1], [3, 2])
    assert per == [CPU] * 3 + [G0] * 3 + [G1] * 2
    assert head == CPU  # llama.cpp's count: the head only past n_layer (the native loader puts it on G1)
    per, head = GpuLayers.ALL.devices(8, [G0, G1], [1, 3])
    assert per == [G0] * 2 + [G1] * 6 and head == G1
    per, head = GpuLayers.ALL.devices(4, [G0, G1], [1, 0])
    assert per == [G0] * 4 and head == G0  # the last GPU with a share
    assert GpuLayers.ALL.devices(3, [], None) == ([CPU] * 3, CPU)
    assert GpuLayers.ALL.devices(3, G0) == ([G0] * 3, G0)  # one device, as before


@pytest.mark.parametrize("text, n, says", [
    ("1,2,3", 2, "3 shares, for 2 GPUs here"),
    ("1", 2, "1 share, for 2 GPUs here"),
    ("1,-1", 2, "0 or more"),
    ("0,0", 2, "a share above 0"),
    ("a,b", 2, "numbers separated by commas"),
    ("1,,2", 3, "numbers separated by commas"),
    ("1,nan", 2, "0 or more"),
])
def test_bad_tensor_split(text, n, says):
    from dsq.errors import DsqError

    with pytest.raises(DsqError, match=says):
        parse_tensor_split(text, n)


def test_tensor_split_parses():
    assert parse_tensor_split("3,1", 2) == [3.0, 1.0]
    assert parse_tensor_split(" 0.75 , 0.25 ") == [0.75, 0.25]
    assert parse_tensor_split(None) is None


# -- the native runtime over two stand-in GPUs -----------------------------------------------------
@pytest.fixture
def standins(monkeypatch):
    """Two stand-in GPUs for the runtime; returns the list of the hidden state's copies to a
    stand-in (the device each went to), however they were made, once `hidden` is set to the
    model's hidden size."""
    monkeypatch.setattr(gpu_layers, "visible_gpus", lambda: [G0, G1])
    copies = _Copies()
    real_to = torch.Tensor.to

    def to(t, *args, **kw):
        dev = next((a for a in (*args, kw.get("device")) if isinstance(a, torch.device)), None)
        if dev in (G0, G1) and copies.hidden and t.ndim == 3 and t.shape[-1] == copies.hidden:
            copies.append(dev)
        return real_to(t, *args, **kw)

    monkeypatch.setattr(torch.Tensor, "to", to)
    return copies


class _Copies(list):
    hidden: int | None = None


def _load(path, gpu_layers="0", split=None):
    from dsq.runtime.native import NativeModel

    return NativeModel(path, "hf", n_ctx=64, dtype="fp32", gpu_layers=gpu_layers, tensor_split=split, head="gpu")


def _deeper(src, dst, n_layer: int):
    """The tiny model `src` with its last layer repeated up to n_layer (a split over the CPU and two
    GPUs needs three layers at least; DeepSeek's dense first layer stays the only dense one)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    cfg = json.loads((src / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    sd = {}
    for f in src.glob("*.safetensors"):
        sd.update(load_file(f))
        (dst / f.name).unlink()
    out = {k: v for k, v in sd.items() if ".layers." not in k}
    for i in range(n_layer):
        for k, v in sd.items():
            if f".layers.{min(i, n - 1)}." in k:
                out[k.replace(f".layers.{min(i, n - 1)}.", f".layers.{i}.")] = v.clone()
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg["num_hidden_layers"] = n_layer
    for key, v in cfg.items():  # per-layer lists (layer_types)
        if isinstance(v, list) and len(v) == n and key != "architectures":
            cfg[key] = [v[min(i, n - 1)] for i in range(n_layer)]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _boundaries(model) -> int:
    p = model.placement
    parts = [p.embed, *p.layers, p.norm, p.head]
    return sum(a != b for a, b in zip(parts, parts[1:]))


CASES = [  # (model, n_layer, --gpu-layers, --tensor-split, layer devices)
    ("llama", 2, "all", [1, 1], [G0, G1]),
    ("qwen2", 2, "all", [1, 1], [G0, G1]),  # tied embeddings: the head its own copy on G1
    ("deepseek_v2", 2, "all", [1, 1], [G0, G1]),
    ("llama", 5, "4", [1, 1], [CPU, G0, G0, G1, G1]),
    ("qwen2", 5, "3", [2, 1], [CPU, CPU, G0, G0, G1]),
    ("deepseek_v2", 4, "3", [1, 2], [CPU, G0, G1, G1]),  # the dense layer on the CPU, MoE layers on both
]


@pytest.mark.parametrize("kind, n_layer, ngl, split, where", CASES)
def test_split_over_two_standin_gpus_gives_the_same_logits(kind, n_layer, ngl, split, where, tiny_dir, tmp_path,
                                                           standins):
    path = tiny_dir(kind)
    if n_layer != json.loads((path / "config.json").read_text())["num_hidden_layers"]:
        path = _deeper(path, tmp_path / kind, n_layer)
    one = _load(path)
    two = _load(path, ngl, split)
    m = two.model
    assert m.layer_devices() == where
    assert m.placement.head == G1 and m.placement.norm == G1
    assert m.placement.embed == (CPU if CPU in where else G0)
    standins.hidden = m.args.hidden_size
    crossings = _boundaries(m)
    assert crossings == len(set(where)) - 1  # contiguous ranges, the head with the last layers
    ids = one.tokenize("The history of the world, as told by a tiny random model,")[:24]

    want = one.logits(ids)
    standins.clear()
    got = two.logits(ids)
    assert standins == _crossing_devices(m)  # once per boundary, in order
    assert got.shape == want.shape
    torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(want), rtol=1e-5, atol=1e-5)

    # greedy decode through each layer's own KV cache: the same tokens, one copy per boundary a step
    n = 8
    ref = _greedy(one, ids, n)
    standins.clear()
    assert _greedy(two, ids, n) == ref
    assert len(standins) == crossings * n  # the prompt's chunk, then n - 1 steps


def _greedy(nm, ids: list[int], n: int) -> list[int]:
    stats = GenStats()
    for _ in nm.stream(ids, SamplingParams(temperature=0.0), n, stats, ignore_eos=True):
        pass
    assert len(stats.token_ids) == n
    return list(stats.token_ids)


def _crossing_devices(model) -> list[torch.device]:
    p = model.placement
    parts = [p.embed, *p.layers, p.norm, p.head]
    return [b for a, b in zip(parts, parts[1:]) if a != b]


# -- the planner over two GPUs -------------------------------------------------------------------------
def test_plan_over_two_budgets(builtin_gguf):
    from dsq.runtime.placement import MiB, plan_placement

    bw = {"cpu_bw": 20e9, "gpu_bw": 500e9}
    one = plan_placement(builtin_gguf, vram=600 * MiB, backend="native", **bw)
    two = plan_placement(builtin_gguf, vram=[600 * MiB, 600 * MiB], backend="native", **bw)
    assert two.vram_budget == 1200 * MiB
    assert len(two.gpus) == 2 and not one.gpus
    assert two.gpu_layers > one.gpu_layers  # two budgets hold more than one of them
    held = [lc for lc in two.layers if lc.device == "GPU"]
    assert [lc.gpu for lc in held] == sorted(lc.gpu for lc in held)  # contiguous, GPU 0 first
    assert all(lc.device == "GPU" for lc in two.layers[-len(held):])  # the last layers, after the CPU's
    assert [g["n_layers"] for g in two.gpus] == [sum(lc.gpu == d for lc in held) for d in (0, 1)]
    assert [g["output"] for g in two.gpus] == [False, two.head != "cpu"]  # a head in VRAM: on the last GPU
    assert all(g["bytes"] <= g["budget_bytes"] for g in two.gpus)
    assert two.gpu_total_bytes == sum(g["bytes"] for g in two.gpus)
    d = two.as_dict()
    assert [g["bytes"] for g in d["gpus"]] == [g["bytes"] for g in two.gpus] and d["tensor_split"] == [600 * MiB] * 2

    # a given split: the layers in proportion, each GPU's part of a whole placement over 3:1
    ts = plan_placement(builtin_gguf, vram=[2048 * MiB, 2048 * MiB], backend="native", gpu_layers="all",
                        tensor_split=[3, 1], **bw)
    n = ts.n_layer
    assert [g["n_layers"] for g in ts.gpus] == divide_layers(n, [3, 1])
    assert ts.gpus[1]["bytes"] > ts.gpus[1]["n_layers"] / n * ts.gpus[0]["bytes"]  # the head and a reserve each
    # llama.cpp counts the output head as one more part of its division
    lc = plan_placement(builtin_gguf, vram=[4096 * MiB, 4096 * MiB], backend="llama.cpp", gpu_layers="all",
                        tensor_split=[1, 1], **bw)
    assert [g["n_layers"] for g in lc.gpus] == [(n + 2) // 2, n + 1 - (n + 2) // 2 - 1]


def test_plan_budget_too_small_for_one_gpu_notes_it(builtin_gguf):
    from dsq.runtime.placement import MiB, plan_placement

    p = plan_placement(builtin_gguf, vram=[4096 * MiB, 600 * MiB], backend="native", gpu_layers="all",
                       tensor_split=[1, 1], cpu_bw=20e9, gpu_bw=500e9)
    assert any("GPU 1 needs" in n and "600 MiB budget" in n for n in p.notes)


# -- the command line ----------------------------------------------------------------------------------
def _two_gpus(monkeypatch):
    from dsq.runtime import placement

    two = [placement.GpuInfo("NVIDIA H100", 80 << 30, 79 << 30)] * 2
    monkeypatch.setattr(placement, "detect_gpus", lambda: list(two))
    monkeypatch.setattr(placement, "detect_gpu", lambda: two[0])


@pytest.mark.parametrize("cmd", [["run", "-p", "hi"], ["chat"], ["bench"], ["offload"]])
@pytest.mark.parametrize("split, says", [
    ("1,1,1", "--tensor-split has 3 shares, for 2 GPUs here"),
    ("2", "--tensor-split has 1 share, for 2 GPUs here"),
    ("1,-2", "0 or more"),
    ("0,0", "a share above 0"),
    ("3;1", "numbers separated by commas"),
])
def test_bad_tensor_split_is_one_line(cmd, split, says, runner, builtin_gguf, monkeypatch):
    from test_cli_errors import one_line_error

    from dsq.cli import app

    _two_gpus(monkeypatch)
    r = runner.invoke(app, cmd[:1] + [str(builtin_gguf)] + cmd[1:] + ["-b", "native", "--tensor-split", split],
                      input="")
    one_line_error(r, says)


def test_offload_vram_list_sets_the_gpu_count(runner, builtin_gguf):
    from test_cli_errors import one_line_error

    from dsq.cli import app

    r = runner.invoke(app, ["offload", str(builtin_gguf), "--vram", "1G,1G,1G", "--tensor-split", "1,1"])
    one_line_error(r, "--tensor-split has 2 shares, for 3 GPUs here")
    r = runner.invoke(app, ["offload", str(builtin_gguf), "-b", "native", "--vram", "2G,2G", "--tensor-split", "3,1",
                            "--gpu-layers", "all", "--json", "--cpu-bw", "20", "--gpu-bw", "500"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["tensor_split"] == [3.0, 1.0] and [g["gpu"] for g in plan["gpus"]] == [0, 1]
    assert all(g["bytes"] > 0 for g in plan["gpus"]) and plan["gpus"][1]["output"]


def test_tensor_split_without_a_gpu_is_noted_and_ignored(runner, tiny_dir, monkeypatch):
    from dsq.cli import app
    from dsq.runtime import placement

    monkeypatch.setattr(placement, "detect_gpus", lambda: [])
    monkeypatch.setattr(placement, "detect_gpu", lambda: None)
    r = runner.invoke(app, ["run", str(tiny_dir("llama")), "-b", "native", "-p", "hi", "-n", "2", "--temperature", "0",
                            "--tensor-split", "3,1"])
    assert r.exit_code == 0, r.output
    assert r.stderr.count("no GPU: running on the CPU") == 1


def test_llama_cpp_gets_the_split_by_layers(monkeypatch, builtin_gguf):
    """llama-cpp-python's Llama(...) receives tensor_split and split_mode=LLAMA_SPLIT_MODE_LAYER."""
    import dsq.runtime.llama_cpp_backend as lcb
    from dsq.runtime import llama_probe

    llama_cpp = lcb.import_llama_cpp()
    seen = {}

    class Seen(Exception):
        pass

    def record(**kw):
        seen.update(kw)
        raise Seen

    monkeypatch.setattr(llama_cpp, "Llama", record)
    monkeypatch.setattr(lcb, "exports_cxx_runtime", lambda *a: False)
    monkeypatch.setattr(llama_probe, "check_loads", lambda *a, **k: None)
    with pytest.raises(Seen):
        lcb.LlamaCppModel(builtin_gguf, gpu_layers="all", tensor_split=[3.0, 1.0])
    assert seen["tensor_split"] == [3.0, 1.0]
    assert seen["split_mode"] == llama_cpp.LLAMA_SPLIT_MODE_LAYER
    seen.clear()
    with pytest.raises(Seen):
        lcb.LlamaCppModel(builtin_gguf, gpu_layers="all")
    assert "tensor_split" not in seen and "split_mode" not in seen
