"""The round-to-nearest packers the GPU decode benchmark uses (benchmarks.decode_gpu) produce valid
packed weights: dequantized they approximate the float weight, and a model converted by them
computes the logits of its own dequantized weights (through the packed reference on the CPU)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.decode_gpu import quantize_model, quantize_packed
from dsq.kernels import packed


def _random_model(layers: int):
    """A small Llama-shaped Transformer with random weights (seed 0), norms near 1."""
    from dsq.models.base import ModelArgs, Transformer

    torch.manual_seed(0)
    args = ModelArgs(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
                     max_position_embeddings=256, rope={"rope_type": "default", "rope_theta": 10000.0})
    model = Transformer(args).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(1 + 0.05 * torch.randn(p.shape) if "norm" in n else 0.05 * torch.randn(p.shape))
    return model


@pytest.mark.parametrize("fmt,tol", [("int4", 0.12), ("int4-actorder", 0.12), ("fp8", 0.05), ("Q4_K", 0.15),
                                     ("Q6_K", 0.04)])
def test_packers_approximate_the_weight(fmt, tol):
    w = torch.randn(64, 512) * 0.02
    p = quantize_packed(w, fmt)
    deq = packed.dequantize(p)
    if p.perm is not None:
        deq = deq[:, torch.argsort(p.perm)]
    err = float((deq - w).norm() / w.norm())
    assert err < tol, err
    assert float((deq - w[torch.randperm(64)]).norm() / w.norm()) > 1  # a wrong weight would fail


@pytest.mark.parametrize("fmt", ["awq-int4", "gptq-int4-actorder", "fp8", "q4_k_m"])
def test_quantized_model_keeps_its_logits(fmt):
    model = _random_model(2)
    ids = torch.randint(0, 300, (1, 16))
    with torch.inference_mode():
        ref = model(ids).float()
        quantize_model(model, fmt)
        model.fuse_projections()
        got = model(ids).float()
    from benchmarks.decode_gpu import kernels_vs_dequantized
    from dsq.runtime.qmodules import PackedLinear

    assert any(isinstance(m, PackedLinear) for m in model.modules())
    attn = model.model.layers[0].self_attn
    assert not hasattr(attn, "k_proj")  # q/k/v fused, act-order included (one order per input)
    before = [type(m) for m in model.modules()]
    err = kernels_vs_dequantized(model, ids, got)  # float32 here: the packed path computes its weights
    assert err < 1e-5
    # the model leaves as it came (decode_gpu times several variants of one model after the check)
    assert [type(m) for m in model.modules()] == before
    with torch.inference_mode():
        assert torch.equal(model(ids).float(), got)
    assert float((got - ref).norm() / ref.norm()) < 0.5  # and they are the float model's, quantized


def test_layer_check_finds_the_wrong_layer():
    """decode_gpu.layers_vs_dequantized: per layer, packed kernels against the dequantized weights on
    the same input. Exact here (the CPU reference computes the same weights); a kernel that is off
    by 1% in one layer shows in that layer and no other; the model leaves as it came."""
    from benchmarks.decode_gpu import layers_vs_dequantized
    from dsq.runtime.qmodules import PackedLinear

    model = _random_model(3)
    quantize_model(model, "q4_k_m")  # the head is packed too
    model.fuse_projections()
    ids = torch.randint(0, 300, (1, 16))
    before = [type(m) for m in model.modules()]
    errs = layers_vs_dequantized(model, ids)
    assert len(errs) == 4 and max(errs) < 1e-5, errs  # three layers and the head
    assert [type(m) for m in model.modules()] == before
    broken = model.model.layers[1].mlp.down_proj
    assert isinstance(broken, PackedLinear)
    fwd = broken.forward
    broken.forward = lambda x: fwd(x) * 1.01  # a kernel 1% off
    errs = layers_vs_dequantized(model, ids)
    assert errs[1] > 1e-3 and max(errs[0], errs[2], errs[3]) < 1e-5, errs
