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

from dsq.models import base
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
    greedy, n = SamplingParams(temperature=0.0), 8
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
