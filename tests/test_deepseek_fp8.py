"""DeepSeek's native FP8 checkpoints (float8_e4m3fn Linear weights, a float32 `weight_scale_inv` per
128x128 block, quantization_config {quant_method: fp8, weight_block_size: [128, 128], ...}), made
here from the tiny deepseek_v3 by dsq's own FP8 quantizer as DeepSeek lays them out (the router,
norms and embeddings in bf16): the native runtime runs them as FP8 (FP8Linear, experts too) and
computes what transformers computes on the dequantized weights; GGUF, GPTQ and AWQ made from them
are bit for bit those made from their bf16 dequantized copy, and the converter and the driver
dequantize one block's tensors at a time (counted, per call)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tiny import hf_logits

IDS = [5, 17, 99, 250, 31, 7, 400, 12, 3, 77] * 8


def _is_fp8_linear(name: str, t: torch.Tensor) -> bool:
    """What DeepSeek stores in FP8: every Linear weight of the decoder layers but the router's."""
    return name.startswith("model.layers.") and name.endswith(".weight") and t.ndim == 2 \
        and not name.endswith("mlp.gate.weight")


def _copy_dir(src: Path, out: Path, tensors: dict, cfg: dict) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


@pytest.fixture(scope="module")
def fp8(tiny_dir, tmp_path_factory):
    """{"fp8": the FP8 checkpoint, "bf16": its weights dequantized to bf16 (what dsq reads it as),
    "fp32": dequantized to float32 (the exact function the FP8 model computes)}."""
    from safetensors.torch import load_file

    from dsq.formats.fp8_checkpoint import deepseek_config, fp8_dequantize
    from dsq.quant.fp8 import fp8_quantize

    src = tiny_dir("deepseek_v3")
    sd = load_file(str(src / "model.safetensors"))
    q, exact = {}, {}
    for name, t in sd.items():
        if _is_fp8_linear(name, t):
            w8, s = fp8_quantize(t, "block")
            q[name], q[name[:-len("weight")] + "weight_scale_inv"] = w8, s
            exact[name] = fp8_dequantize(w8, s)
        else:
            q[name] = t.to(torch.bfloat16)
            exact[name] = q[name].float()
    cfg = {k: v for k, v in json.loads((src / "config.json").read_text()).items() if k != "dtype"}
    root = tmp_path_factory.mktemp("fp8")
    return {
        "fp8": _copy_dir(src, root / "fp8", q, {**cfg, "torch_dtype": "bfloat16",
                                                  "quantization_config": deepseek_config()}),
        "bf16": _copy_dir(src, root / "bf16", {k: v.to(torch.bfloat16) for k, v in exact.items()},
                          {**cfg, "torch_dtype": "bfloat16"}),
        "fp32": _copy_dir(src, root / "fp32", exact, {**cfg, "torch_dtype": "float32"}),
    }


def test_checkpoint_is_laid_out_as_deepseek_publishes_it(fp8):
    from safetensors import safe_open

    cfg = json.loads((fp8["fp8"] / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}
    with safe_open(str(fp8["fp8"] / "model.safetensors"), framework="pt") as st:
        w = st.get_tensor("model.layers.1.mlp.experts.3.down_proj.weight")
        s = st.get_tensor("model.layers.1.mlp.experts.3.down_proj.weight_scale_inv")
        kv_a = st.get_slice("model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv").get_shape()
        gate = st.get_tensor("model.layers.1.mlp.gate.weight")
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (2, 2)
    assert kv_a == [3, 2]  # 288 rows: a partial last block
    assert gate.dtype == torch.bfloat16


# -- running it ------------------------------------------------------------------------------------
def test_native_runs_it_as_fp8(fp8, monkeypatch):
    """Every Linear of the layers, the experts included, is an FP8Linear over the file's FP8
    bytes (nothing dequantized at load); logits are transformers' on the dequantized weights."""
    from dsq.formats import fp8_checkpoint
    from dsq.runtime.native import NativeModel
    from dsq.runtime.qmodules import FP8Linear

    def no_dequantize(*a, **k):
        raise AssertionError("an FP8 weight was dequantized at load")

    with monkeypatch.context() as m:
        m.setattr(fp8_checkpoint, "fp8_dequantize", no_dequantize)
        model = NativeModel(fp8["fp8"], "hf", n_ctx=256, dtype="fp32")
    layers = model.model.model.layers
    fp8s = [mod for layer in layers for name, mod in layer.named_modules() if isinstance(mod, FP8Linear)]
    assert len(fp8s) == (5 + 3) + 2 * (5 + 3 * 8 + 3)  # attention + dense MLP; attention, 8 experts, shared
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in fp8s)
    assert layers[1].mlp.gate.weight.dtype == torch.float32  # the router stays float
    assert np.abs(model.logits(IDS) - hf_logits(fp8["fp32"], IDS)).max() < 1e-4


# -- quantizing it onward, one block at a time --------------------------------------------------
class DequantCounter:
    """Bytes of float weights made from FP8 ones, in runs cut where `mark` is called."""

    def __init__(self, monkeypatch):
        from dsq.convert import fp8_source

        self.runs: list[list[tuple[str, int]]] = [[]]
        real = fp8_source.dequantize

        def counted(name, w, scale, dtype):
            out = real(name, w, scale, dtype)
            self.runs[-1].append((name, out.numel() * out.element_size()))
            return out

        monkeypatch.setattr(fp8_source, "dequantize", counted)

    def mark(self, *_args) -> None:
        self.runs.append([])

    def names(self) -> list[str]:
        return [n for run in self.runs for n, _ in run]

    def largest_run(self) -> int:
        return max(sum(b for _, b in run) for run in self.runs)


def _block_float_bytes(model_dir: Path) -> int:
    """The largest decoder block's FP8 weights, as bf16: one block's float tensors."""
    from safetensors import safe_open

    per: dict[int, int] = {}
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as st:
        for name in st.keys():
            sl = st.get_slice(name)
            if sl.get_dtype() == "F8_E4M3":
                per[int(name.split(".")[2])] = per.get(int(name.split(".")[2]), 0) + 2 * int(np.prod(sl.get_shape()))
    return max(per.values())


def _fp8_weights(model_dir: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as st:
        return sorted(n for n in st.keys() if st.get_slice(n).get_dtype() == "F8_E4M3")


def test_gguf_conversion_dequantizes_a_tensor_at_a_time(fp8, tmp_path, monkeypatch):
    """HF -> GGUF of the FP8 checkpoint writes the bytes its bf16 copy converts to; each GGUF
    tensor dequantizes only its own sources (a layer's 8 experts' projection, stacked, at most),
    each FP8 weight once (kv_b_proj, written as two tensors, twice)."""
    from dsq.convert.hf_to_gguf import hf_to_gguf
    from dsq.formats.gguf_file import GGUFFile

    count = DequantCounter(monkeypatch)
    a = GGUFFile(hf_to_gguf(fp8["fp8"], tmp_path / "fp8.gguf", "BF16", name="tiny", progress=count.mark))
    b = GGUFFile(hf_to_gguf(fp8["bf16"], tmp_path / "bf16.gguf", "BF16", name="tiny"))
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for t in a.tensors:
        assert np.array_equal(a.raw(t.name)[0], b.raw(t.name)[0]), t.name
    names = count.names()
    assert sorted(set(names)) == _fp8_weights(fp8["fp8"])
    assert {n for n in names if names.count(n) > 1} == {n for n in names if n.endswith("kv_b_proj.weight")}
    assert count.largest_run() == 8 * 256 * 256 * 2 < _block_float_bytes(fp8["fp8"])


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_layer_methods_dequantize_a_block_at_a_time(method, fp8, tmp_path, monkeypatch):
    """GPTQ / AWQ of the FP8 checkpoint are bit for bit those of its bf16 copy; between two
    finished blocks the driver dequantized that block's weights, once each, nothing more."""
    from dsq.quant import CalibSpec, QuantSpec, quantize
    from test_quant_crash import same, tensors

    spec = QuantSpec(method, calib=CalibSpec(samples=4, seq_len=32), min_expert_tokens=16)
    count = DequantCounter(monkeypatch)
    got = quantize(fp8["fp8"], tmp_path / "from-fp8", spec, eval_tokens=0,
                   progress=lambda s: count.mark() if s.done else None)
    want = quantize(fp8["bf16"], tmp_path / "from-bf16", spec, eval_tokens=0)
    assert same(tensors(got), tensors(want))
    assert sorted(count.names()) == _fp8_weights(fp8["fp8"])
    assert count.largest_run() <= _block_float_bytes(fp8["fp8"])
    assert json.loads((got / "config.json").read_text())["quantization_config"]["quant_method"] == method


def test_gguf_with_imatrix_from_fp8(fp8, tmp_path):
    """The GGUF pipeline (importance matrix through the driver's block reader, conversion, llama.cpp's
    quantizer) makes from the FP8 checkpoint the file it makes from the bf16 copy."""
    from dsq.quant import CalibSpec, GGUFSpec, quantize

    spec = GGUFSpec("Q4_K_M", imatrix=True, calib=CalibSpec(samples=4, seq_len=32))
    a = quantize(fp8["fp8"], tmp_path / "fp8.gguf", spec)
    b = quantize(fp8["bf16"], tmp_path / "bf16.gguf", spec)
    from dsq.formats.gguf_file import GGUFFile

    ga, gb = GGUFFile(a), GGUFFile(b)
    for t in ga.tensors:
        assert np.array_equal(ga.raw(t.name)[0], gb.raw(t.name)[0]), t.name
