"""A CPU decoder layer's decode step in one C call (kernels/csrc/layer_cpu.inc, dsq/runtime/fused_layer.py):
against the op-by-op eager step it replaces (same kernels: equal up to the activation's last bit),
with each ISA build, one row and left-padded batches, over positions past a sliding window; and
against the torch reference (DSQ_KERNELS=reference: dequantized weights, torch norms, rope and SDPA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsq.kernels import cpu

BUILDS = [isa for isa in cpu.supported_isas() if cpu.load(isa) is not None]
IDS = [5, 17, 99, 250, 31, 7, 40, 12, 3, 77, 120, 64]
STEPS = 20  # decode steps after the prompt: positions 12..31, past the tiny gemma3's window of 16

pytestmark = pytest.mark.skipif(not cpu.available() or not cpu.has("dsq_layer_decode"),
                                reason="no C kernels with dsq_layer_decode built")


@pytest.fixture(autouse=True)
def float_x(monkeypatch):
    """The float row dots on AVX-512 (DSQ_NO_VNNI=1): the VNNI ones round x to int8 per 32 values,
    so a last-bit difference upstream (the activation's) can move an x across a rounding step and a
    logit by ~1%, as on the avx2 build, which has only those (held to 2%: _tol)."""
    monkeypatch.setenv("DSQ_NO_VNNI", "1")


def _tol(isa: str | None = None) -> float:
    return 2e-2 if (isa or cpu.library()[1]) == "avx2" else 1e-5


@pytest.fixture(params=BUILDS)
def build(request, monkeypatch):
    """Each ISA build in turn, for the whole model (the op-by-op kernels and the fused layer)."""
    monkeypatch.setenv("DSQ_CPU_ISA", request.param)
    cpu.library.cache_clear()
    yield request.param
    monkeypatch.delenv("DSQ_CPU_ISA")
    cpu.library.cache_clear()


def _decode(model, fused: bool, B: int = 1, steps: int = STEPS) -> torch.Tensor:
    """Logits of a prompt (B rows, left-padded by 0, 3, 5.. tokens) and `steps` greedy decode steps,
    through the fused layers or op by op. (steps + 1, B, V)."""
    keep = model._fused_decode
    if not fused:
        model._fused_decode = None
    try:
        pad = torch.tensor([3 * b - (b > 0) * (b - 1) for b in range(B)])
        T = len(IDS)
        ids = torch.tensor([IDS] * B)
        ids[pad[:, None] > torch.arange(T)[None]] = 0
        out = []
        with torch.inference_mode():
            cache = model.make_cache(B, 64, torch.float32)
            logits = model(ids, torch.arange(T), cache, pad, kv_len=T, last_only=True)[:, -1]
            out.append(logits)
            for s in range(T, T + steps):
                tok = logits.argmax(-1)[:, None]
                logits = model(tok, torch.tensor([s]), cache, pad, kv_len=s + 1, last_only=True)[:, -1]
                out.append(logits)
    finally:
        model._fused_decode = keep
    return torch.stack(out)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("B", [1, 2])
def test_fused_decode_equals_op_by_op(kind, B, build, tiny_gguf):
    """Every layer of a tiny Q4_K_M GGUF is covered (llama; qwen2's q/k/v biases; gemma3's GELU-tanh,
    sandwich and q/k norms, sliding windows with their own rope) and decodes the op-by-op step's
    logits within 1e-5 of the largest, one row and left-padded rows: the same kernels run inside,
    only the activation's expf / tanhf differ from torch's vectorized ones in the last bits (avx2:
    within 2%, see float_x)."""
    from dsq.runtime.native import NativeModel

    m = NativeModel(tiny_gguf(kind, "Q4_K_M"), "gguf", n_ctx=64)
    assert m.fused_layers == len(m.model.model.layers)
    got, want = _decode(m.model, True, B), _decode(m.model, False, B)
    assert got.isfinite().all()
    assert _rel(got, want) < _tol(build), _rel(got, want)


def test_separate_projections_and_the_kernels_used(tiny_gguf, monkeypatch):
    """Unfused q/k/v and gate/up modules (three and two GEMVs in the call) decode as fused ones do;
    a fused step makes no op-by-op GEMV for its layers (only the output head's)."""
    from dsq.runtime.native import NativeModel

    path = tiny_gguf("llama", "Q4_K_M")
    plain = NativeModel(path, "gguf", n_ctx=64, fuse=False)
    assert plain.fused_layers == 2 and {f.desc.n_qkv for f in plain.model._fused_decode.layers} == {3}
    assert _rel(_decode(plain.model, True), _decode(plain.model, False)) < _tol()
    calls = []
    real = cpu.gguf_linear
    monkeypatch.setattr(cpu, "gguf_linear", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    counts = []
    for fused in (True, False):
        for steps in (0, 3):
            calls.clear()
            _decode(plain.model, fused, steps=steps)
            counts.append(len(calls))
    assert counts[1] - counts[0] <= 3  # three fused decode steps: the head's GEMV at most, once each
    assert counts[3] - counts[2] >= 3 * 2 * 7  # op by op: seven a layer


def test_split_segments(tiny_gguf):
    """The CPU segment of a split step (layers 0..start on the CPU, as _SplitStep runs them) through the
    fused layers, then the rest op by op, gives the one-pass step's logits."""
    from dsq.runtime.native import NativeModel

    model = NativeModel(tiny_gguf("gemma3", "Q8_0"), "gguf", n_ctx=64).model
    T = len(IDS)
    with torch.inference_mode():
        caches = [model.make_cache(1, 64, torch.float32) for _ in range(2)]
        pad = torch.zeros(1, dtype=torch.long)
        for c in caches:
            model(torch.tensor([IDS]), torch.arange(T), c, pad, kv_len=T)
        tok, slots = torch.tensor([[9]]), torch.tensor([T])
        keep, model._fused_decode = model._fused_decode, None
        want = model(tok, slots, caches[0], pad, kv_len=T + 1, last_only=True)
        model._fused_decode = keep
        x = model.forward_layers(model.embed(tok), 0, 1, slots, caches[1], pad, T + 1)
        x = model.forward_layers(x, 1, len(model.model.layers), slots, caches[1], pad, T + 1)
        got = model.head(x, last_only=True)
    assert _rel(got, want) < _tol()
    # layer 0's keys and values come before any activation: the same bits
    assert torch.equal(caches[0].k[0], caches[1].k[0]) and torch.equal(caches[0].v[0], caches[1].v[0])
    assert _rel(caches[1].v[2], caches[0].v[2]) < _tol()


def _random_model(kind: str):
    """A tiny Transformer of `kind`'s layer options with random GGUF projections (|w| <~ 0.02, as
    dsq.bench.random_gguf writes them), q/k/v and gate/up fused as the runtime fuses them."""
    from dsq.bench.random_gguf import random_blocks
    from dsq.models.base import ModelArgs, Transformer
    from dsq.runtime.qmodules import GGUFLinear

    opts = {"llama": {}, "qwen2": dict(attention_bias=True),
            "gemma3": dict(hidden_act="gelu_tanh", norm_offset=1.0, qk_norm=True, sandwich_norm=True,
                           query_pre_attn_scalar=48, sliding_window=5, rope_local={"rope_type": "default",
                                                                                   "rope_theta": 10000.0},
                           layer_types=["sliding_attention", "full_attention"])}[kind]
    args = ModelArgs(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     rope={"rope_type": "default", "rope_theta": 500000.0}, **opts)
    torch.manual_seed(0)
    model = Transformer(args)
    rng = np.random.default_rng(0)
    types = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_K", "gate_proj": "Q4_K",
             "up_proj": "Q4_K", "down_proj": "Q6_K"}
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
        for layer in model.model.layers:
            for parent in (layer.self_attn, layer.mlp):
                for name, qt in types.items():
                    if name in parent._modules:
                        old = parent._modules[name]
                        m = GGUFLinear(qt, old.in_features, old.out_features, bias=old.bias is not None)
                        m.raw.copy_(torch.from_numpy(random_blocks(qt, old.out_features, old.in_features, rng)))
                        if old.bias is not None:
                            m.bias.normal_(0, 0.02)
                        setattr(parent, name, m)
            for n in (layer.input_layernorm, layer.post_attention_layernorm):
                n.weight.add_(0 if args.norm_offset else 1)
    model.fuse_projections()
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
def test_fused_layer_against_torch_reference(kind, build, monkeypatch):
    """The fused layers against the torch reference of every op (DSQ_KERNELS=reference: GGUF blocks
    dequantized to float32, torch's rms_norm, rope and SDPA), one row and left-padded rows. The
    avx2 build's row dots round x to int8 per 32 values: held to 2%, the float ones to 1e-4."""
    from dsq.runtime.fused_layer import attach

    model = _random_model(kind)
    assert attach(model) == 2
    tol = 2e-2 if build == "avx2" else 1e-4
    for B in (1, 3):
        got = _decode(model, True, B, steps=8)
        monkeypatch.setenv("DSQ_KERNELS", "reference")
        want = _decode(model, False, B, steps=8)
        monkeypatch.delenv("DSQ_KERNELS")
        assert _rel(got, want) < tol, (B, _rel(got, want))


def test_layer_decode_refuses_bad_arguments():
    from dsq.runtime.fused_layer import FusedLayer

    model = _random_model("llama")
    f = FusedLayer(model, 0)
    x = torch.randn(1, 1, 256)
    kc = torch.zeros(1, 2, 8, 64)
    cos, sin = torch.ones(8, 64), torch.zeros(8, 64)
    pad = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="layer_decode"):
        cpu.layer_decode(f.desc, x, kc, kc.clone(), 8, pad, 8, cos, sin)  # slot past the cache
    with pytest.raises(ValueError, match="scratch"):
        cpu.layer_decode(f.desc, x, kc, kc.clone(), 0, pad, 1, cos, sin, scratch=torch.empty(10))
    with pytest.raises(ValueError, match="refused"):
        cpu.layer_decode(f.desc, x, kc, kc.clone(), 0, torch.tensor([1]), 1, cos, sin)  # position -1
    f.desc.o.K += 1  # a descriptor whose projections do not fit the layer
    with pytest.raises(ValueError, match="refused"):
        cpu.layer_decode(f.desc, x, kc, kc.clone(), 0, pad, 1, cos, sin)
    f.desc.o.K -= 1
    assert kc.abs().sum() == 0  # nothing written by the refused calls
    y = cpu.layer_decode(f.desc, x.clone(), kc, kc.clone(), 0, pad, 1, cos, sin)
    assert y.isfinite().all() and kc[:, :, 0].abs().sum() > 0 and kc[:, :, 1:].abs().sum() == 0


def test_coverage(tiny_gguf, tiny_dir, monkeypatch):
    """What falls back to the op-by-op step: float weights, DeepSeek's layers, a softcap, and
    everything under DSQ_FUSED_LAYER=0; a reference-kernel step (DSQ_KERNELS=reference) too."""
    from dsq.runtime.fused_layer import attach, uncovered
    from dsq.runtime.native import NativeModel

    assert NativeModel(tiny_gguf("qwen2", "F32"), "gguf", n_ctx=32).fused_layers == 0
    assert "not GGUF blocks" in uncovered(NativeModel(tiny_gguf("qwen2", "F32"), "gguf", n_ctx=32).model, 0)
    assert NativeModel(tiny_dir("deepseek_v2"), "hf", n_ctx=32).fused_layers == 0
    model = _random_model("gemma3")
    model.args.attn_logit_softcapping = 50.0
    assert uncovered(model, 0) == "attention logit softcap" and attach(model) == 0
    model.args.attn_logit_softcapping = None
    monkeypatch.setenv("DSQ_FUSED_LAYER", "0")
    assert attach(model) == 0 and model._fused_decode is None
    monkeypatch.delenv("DSQ_FUSED_LAYER")
    assert attach(model) == 2
    with torch.inference_mode():
        x, cache = torch.randn(1, 1, 256), model.make_cache(1, 8, torch.float32)
        assert model._fused_decode.begin(x, torch.tensor([0]), cache, None, 1) is not None
        monkeypatch.setenv("DSQ_KERNELS", "reference")
        assert model._fused_decode.begin(x, torch.tensor([0]), cache, None, 1) is None
        monkeypatch.delenv("DSQ_KERNELS")
        assert model._fused_decode.begin(torch.randn(1, 2, 256), torch.tensor([0, 1]), cache, None, 2) is None
    with torch.no_grad():
        assert model._fused_decode.begin(x, torch.tensor([0]), cache, None, 1) is not None
    assert model._fused_decode.begin(x, torch.tensor([0]), cache, None, 1) is None  # gradients wanted: op by op


def test_builtin_model_past_its_window(builtin_gguf):
    """The built-in Gemma 3 270M (its mix stores v in another type than q/k in some layers: a fused
    q/k projection and a separate v) decodes past its sliding window (512) as the op-by-op step does."""
    from dsq.runtime.native import NativeModel

    m = NativeModel(builtin_gguf, "gguf", n_ctx=600)
    model = m.model
    assert m.fused_layers == len(model.model.layers) and model.args.sliding_window == 512
    assert 2 in {f.desc.n_qkv for f in model._fused_decode.layers}
    assert {f.desc.window for f in model._fused_decode.layers} == {0, 512}
    ids = [(7 * i) % 5000 + 100 for i in range(516)]
    outs = []
    for fused in (True, False):
        keep = model._fused_decode
        model._fused_decode = keep if fused else None
        with torch.inference_mode():
            cache = model.make_cache(1, 600, torch.float32)
            logits = model(torch.tensor([ids]), torch.arange(516), cache, kv_len=516, last_only=True)[:, -1]
            out = [logits]
            for s in range(516, 520):  # slots past the window: the first tokens fall out of sliding layers
                tok = logits.argmax(-1)[:, None]
                logits = model(tok, torch.tensor([s]), cache, kv_len=s + 1, last_only=True)[:, -1]
                out.append(logits)
        model._fused_decode = keep
        outs.append(torch.stack(out))
    assert _rel(outs[0], outs[1]) < _tol()
