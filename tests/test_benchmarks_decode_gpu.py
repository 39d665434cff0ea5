"""The quantized models the GPU decode benchmark times (benchmarks.decode_gpu.to_format): dsq's own
quantizers make weights that approximate the float ones, q4_k_m is llama.cpp's type mix of random
blocks, and every format's model computes the logits of its own dequantized weights (through the
packed reference on the CPU), which the benchmark's per-layer check would catch a kernel missing."""

from __future__ import annotations

import pytest
import torch

from benchmarks.decode_gpu import RANDOM_FORMATS, kernels_vs_dequantized, layers_vs_dequantized, to_format
from dsq.bench.random_models import random_transformer
from dsq.runtime.qmodules import PackedLinear


def _model(layers: int):
    return random_transformer("tiny", device="cpu", dtype=torch.float32, layers=layers)[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _packed(model) -> dict[str, PackedLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}


@pytest.mark.parametrize("fmt,tol", [("awq-int4", 0.12), ("gptq-int4-actorder", 0.12), ("fp8", 0.05)])
def test_quantizers_approximate_the_float_weights(fmt, tol):
    model = _model(2)
    float_w = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    to_format(model, fmt)
    mods = _packed(model)
    assert set(mods) == set(float_w) - {"lm_head"}  # the head stays bf16 in these formats
    for name, m in mods.items():
        w = float_w[name]
        deq = m.weight_float()
        assert _rel(deq, w) < tol, name
        assert _rel(deq, w[torch.randperm(w.shape[0])]) > 1  # a wrong weight would fail


def test_act_order_is_shared_by_the_linears_of_one_input():
    model = _model(1)
    to_format(model, "gptq-int4-actorder")
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert torch.equal(attn.q_proj.perm, attn.k_proj.perm) and torch.equal(attn.q_proj.perm, attn.v_proj.perm)
    assert torch.equal(mlp.gate_proj.perm, mlp.up_proj.perm)
    assert not torch.equal(attn.q_proj.perm, attn.o_proj.perm)
    assert not torch.equal(attn.q_proj.perm, torch.arange(attn.q_proj.in_features))
    assert bool((attn.q_proj.zp == 8).all())  # symmetric, as dsq's GPTQ by default
    model = _model(1)
    to_format(model, "awq-int4")
    assert all(m.perm is None for m in _packed(model).values())


def test_q4_k_m_is_llama_cpps_type_mix_of_random_blocks():
    model = _model(8)
    to_format(model, "q4_k_m")
    types = {n: m.source for n, m in _packed(model).items()}
    assert types.pop("lm_head") == "Q6_K"
    more_bits = {0, 3, 6, 7}  # llama.cpp's Q4_K_M at 8 layers: attn_v and ffn_down in Q6_K there
    for name, t in types.items():
        layer, leaf = int(name.split(".")[2]), name.rsplit(".", 1)[1]
        assert t == ("Q6_K" if leaf in ("v_proj", "down_proj") and layer in more_bits else "Q4_K"), name
    w = model.model.layers[0].mlp.gate_proj.weight_float()
    assert bool(w.isfinite().all()) and 0 < float(w.abs().max()) < 0.05  # a trained model's range


@pytest.mark.parametrize("fmt", ["awq-int4", "gptq-int4-actorder", "fp8", "q4_k_m"])
def test_quantized_model_keeps_its_logits(fmt):
    model = _model(2)
    ids = torch.randint(0, 1024, (1, 16))
    with torch.inference_mode():
        ref = model(ids).float()
        to_format(model, fmt)
        model.fuse_projections()
        got = model(ids).float()
    assert _packed(model)
    assert not hasattr(model.model.layers[0].self_attn, "k_proj")  # q/k/v fused, act-order included
    before = [type(m) for m in model.modules()]
    err = kernels_vs_dequantized(model, ids, got)  # float32 here: the packed path computes its weights
    assert err < 1e-5
    # the model leaves as it came (decode_gpu times several variants of one model after the check)
    assert [type(m) for m in model.modules()] == before
    with torch.inference_mode():
        assert torch.equal(model(ids).float(), got)
    if fmt not in RANDOM_FORMATS:
        assert _rel(got, ref) < 0.5  # and they are the float model's, quantized


def test_layer_check_finds_the_wrong_layer():
    """decode_gpu.layers_vs_dequantized: per layer, packed kernels against the dequantized weights on
    the same input. Exact here (the CPU reference computes the same weights); a kernel that is off
    by 1% in one layer shows in that layer and no other; the model leaves as it came."""
    model = _model(3)
    to_format(model, "q4_k_m")  # the head is packed too
    model.fuse_projections()
    ids = torch.randint(0, 1024, (1, 16))
    before = [type(m) for m in model.modules()]
    errs = layers_vs_dequantized(model, ids)
    assert len(errs) == 4 and max(errs) < 1e-5, errs  # three layers and the head
    assert [type(m) for m in model.modules()] == before
    broken = model.model.layers[1].mlp.down_proj
    assert isinstance(broken, PackedLinear)
    fwd = broken.forward
    broken.forward = lambda x: fwd(x) * 1.01  # a kernel 1% off
    errs = layers_vs_dequantized(model, ids)
    # down_proj adds a small part of the layer's output (the residual stream carries the rest)
    assert errs[1] > 1e-4 and max(errs[0], errs[2], errs[3]) < 1e-5, errs
