"""The eager CPU decode step's shortcuts: GGUF q/k/v and gate/up rows fused into one C kernel call
(GGUFLinear.fuse_rows), the C RMS norm and the C one-query attention, each against the plain
path it replaces (unfused modules, torch.rms_norm, SDPA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dsq.kernels import cpu, dispatch
from test_kernels_ref import random_blocks

BUILDS = [isa for isa in cpu.supported_isas() if cpu.load(isa) is not None]
IDS = [5, 17, 99, 250, 31, 7, 400, 12, 3, 77] * 4

needs_kernels = pytest.mark.skipif(not cpu.available(), reason="no C kernels built")


def _gguf_linear(qtype: str, n: int, k: int, rng, bias: bool = False):
    from dsq.runtime.qmodules import GGUFLinear

    m = GGUFLinear(qtype, k, n, bias=bias)
    m.raw.copy_(torch.from_numpy(random_blocks(qtype, n, k, rng)))
    if bias:
        m.bias.data.normal_()
    return m


@pytest.mark.parametrize("bias", [False, True])
def test_gguf_fuse_rows_equals_separate_modules(bias):
    from dsq.runtime.qmodules import GGUFLinear

    rng = np.random.default_rng(0)
    mods = [_gguf_linear("Q5_0", n, 64, rng, bias) for n in (96, 32, 32)]
    fused = GGUFLinear.fuse_rows(mods)
    assert isinstance(fused, GGUFLinear) and fused.out_features == 160 and fused.qtype == "Q5_0"
    for x in (torch.randn(1, 1, 64), torch.randn(2, 5, 64)):
        with torch.inference_mode():
            assert torch.equal(fused(x), torch.cat([m(x) for m in mods], -1))
    # another type, width or bias layout: not fused
    assert GGUFLinear.fuse_rows([mods[0], _gguf_linear("Q8_0", 32, 64, rng, bias)]) is None
    assert GGUFLinear.fuse_rows([mods[0], _gguf_linear("Q5_0", 32, 128, rng, bias)]) is None
    assert GGUFLinear.fuse_rows([mods[0], _gguf_linear("Q5_0", 32, 64, rng, not bias)]) is None


def _attn(args, rng, qtypes):
    from dsq.models.base import Attention

    a = Attention(args, 0)
    h, d = args.hidden_size, args.head_dim
    for name, qt, n in zip(("q_proj", "k_proj", "v_proj"), qtypes,
                           (args.num_attention_heads * d, args.num_key_value_heads * d,
                            args.num_key_value_heads * d)):
        setattr(a, name, _gguf_linear(qt, n, h, rng))
    a.o_proj = _gguf_linear("Q8_0", h, args.num_attention_heads * d, rng)
    return a


@pytest.mark.parametrize("qtypes,fused_name", [(("Q4_K",) * 3, "qkv_proj"), (("Q5_0", "Q5_0", "Q8_0"), "qk_proj")])
def test_attention_fuses_gguf_projections(qtypes, fused_name):
    """q/k/v of one type become one module; q/k of one type with v of another (the built-in
    model's mix) become q/k plus v; the outputs are those of the separate modules."""
    from dsq.models.base import KVCache, ModelArgs

    args = ModelArgs(vocab_size=8, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    rng = np.random.default_rng(1)
    a = _attn(args, rng, qtypes)
    x = torch.randn(1, 3, args.hidden_size) * 0.1
    cache = KVCache(args, 1, 8, torch.float32, [torch.device("cpu")])
    cos, sin = cache.rope[("full", "cpu")]
    pos = torch.arange(3)[None, :, None]
    with torch.inference_mode():
        ref = a(x, cos[pos], sin[pos], None, cache, torch.arange(3), 3)
        assert a.fuse()
        assert fused_name in a._modules and "q_proj" not in a._modules
        out = a(x, cos[pos], sin[pos], None, KVCache(args, 1, 8, torch.float32, [torch.device("cpu")]),
                torch.arange(3), 3)
    assert torch.allclose(out, ref, atol=1e-6, rtol=1e-5)


def test_mlp_fuses_gguf_gate_up():
    from dsq.models.base import MLP, ModelArgs

    args = ModelArgs(vocab_size=8, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                     num_attention_heads=1, num_key_value_heads=1, head_dim=64, hidden_act="gelu_tanh")
    rng = np.random.default_rng(2)
    m = MLP(args)
    m.gate_proj, m.up_proj = _gguf_linear("Q5_0", 96, 64, rng), _gguf_linear("Q5_0", 96, 64, rng)
    m.down_proj = _gguf_linear("Q8_0", 64, 96, rng)
    x = torch.randn(2, 3, 64) * 0.1
    with torch.inference_mode():
        ref = m(x)
        assert m.fuse() and "gate_up_proj" in m._modules
        assert torch.allclose(m(x), ref, atol=1e-6, rtol=1e-5)


def test_tiny_gguf_fused_logits_equal_unfused(tiny_gguf, monkeypatch):
    """End to end on a tiny quantized GGUF: the fused model (default) gives the unfused logits,
    with and without the KV cache (the eager decode step). With the float row dots: the integer
    ones round x per 32 values, so float differences upstream (fusion does not keep every op's
    rounding) can move an x across a rounding step (up to 2^-16 of the block's largest
    |x| on the avx2 build) and the logits by more than what fusion itself changes."""
    from dsq.runtime.native import NativeModel

    monkeypatch.setenv("DSQ_NO_VNNI", "1")

    path = tiny_gguf("gemma3", "Q4_K_M")
    fused = NativeModel(path, "gguf", n_ctx=64, dtype="fp32")
    plain = NativeModel(path, "gguf", n_ctx=64, dtype="fp32", fuse=False)
    layers = fused.model.model.layers
    assert all("gate_up_proj" in layer.mlp._modules for layer in layers)
    assert all({"qkv_proj", "qk_proj"} & set(layer.self_attn._modules) for layer in layers)
    assert np.abs(fused.logits(IDS) - plain.logits(IDS)).max() < 1e-4

    def decode(m):
        outs = []
        with torch.inference_mode():
            cache = m.model.make_cache(1, 64, torch.float32)
            outs.append(m.model(torch.tensor([IDS[:9]]), torch.arange(9), cache, kv_len=9)[0])
            for i in range(9, 20):
                outs.append(m.model(torch.tensor([[IDS[i]]]), torch.tensor([i]), cache, kv_len=i + 1)[0])
        return torch.cat(outs)

    assert (decode(fused) - decode(plain)).abs().max() < 1e-4


@needs_kernels
@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("shape", [(1, 1, 640), (1, 1, 4, 256), (3, 5, 33), (2, 7)])
def test_c_rms_norm_matches_torch(isa, shape):
    x = torch.randn(*shape) * 3
    w = torch.randn(shape[-1])
    y = cpu.rms_norm(x, w, 1e-6, lib=cpu.load(isa))
    assert y.shape == x.shape
    torch.testing.assert_close(y, torch.rms_norm(x, (shape[-1],), w, 1e-6), atol=1e-5, rtol=1e-5)


@needs_kernels
def test_rms_norm_module_uses_c_in_decode(monkeypatch):
    """RMSNorm (Gemma's offset weights and plain) gives torch's result through the C path, and
    takes it for small float32 rows only."""
    from dsq.models.base import RMSNorm

    calls = []
    real = cpu.rms_norm
    monkeypatch.setattr(cpu, "rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    for offset in (0.0, 1.0):
        n = RMSNorm(640, 1e-6, offset)
        n.weight.data.normal_()
        x = torch.randn(1, 1, 640)
        with torch.inference_mode():
            y = n(x)
        torch.testing.assert_close(y, torch.rms_norm(x, (640,), offset + n.weight, 1e-6), atol=1e-5, rtol=1e-5)
    assert len(calls) == 2
    with torch.inference_mode():
        RMSNorm(640, 1e-6)(torch.randn(128, 640))  # prefill-sized: torch's threaded norm
    assert len(calls) == 2


def _sdpa(q, k, v, mask, scale):
    B, H, D = q.shape[0], q.shape[2], q.shape[3]
    return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=H != k.shape[1]).transpose(1, 2).reshape(B, 1, H * D)


@needs_kernels
@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("B,H,Hk,S,D", [(1, 4, 1, 160, 256), (3, 4, 2, 37, 64), (2, 3, 3, 1, 8), (1, 8, 2, 300, 128)])
def test_c_attn_decode_matches_sdpa(isa, B, H, Hk, S, D):
    L = S + 11  # a slice of a longer cache, as in decode
    kc, vc = torch.randn(B, Hk, L, D), torch.randn(B, Hk, L, D)
    k, v = kc[:, :, :S], vc[:, :, :S]
    q = torch.randn(B, 1, H, D)
    mask = torch.rand(B, 1, 1, S) > 0.3
    mask[..., -1] = True  # the new token always sees itself
    for m in (mask, None):
        out = cpu.attn_decode(q, k, v, m, 0.125, lib=cpu.load(isa))
        ref = _sdpa(q, k, v, m, 0.125)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    # a row with every key masked: NaN, as SDPA gives
    mask[0] = False
    out = cpu.attn_decode(q, k, v, mask, 0.125, lib=cpu.load(isa))
    assert out[0].isnan().all() and not out[1:].isnan().any()


@needs_kernels
@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("H,Hk", [(8, 8), (8, 4), (6, 2), (8, 2), (10, 2), (28, 4), (16, 2)])
def test_c_attn_decode_groups_of_query_heads_give_the_same_bits(isa, H, Hk):
    """A unit of the C attention is up to four query heads of one KV head, as many as leave every
    thread one: whatever the grouping (1 to 16 threads: one head a unit to four), each head's
    output has the same bits, and they match SDPA."""
    B, S, D = 2, 45, 64
    k, v = torch.randn(B, Hk, S, D), torch.randn(B, Hk, S, D)
    q = torch.randn(B, 1, H, D)
    mask = torch.rand(B, 1, 1, S) > 0.2
    mask[..., -1] = True
    lib = cpu.load(isa)
    outs = [cpu.attn_decode(q, k, v, mask, 0.125, lib=lib, threads=t) for t in (1, 2, 5, 16)]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    torch.testing.assert_close(outs[0], _sdpa(q, k, v, mask, 0.125), atol=2e-5, rtol=1e-4)


def _tiny_transformer(**extra):
    """Two layers (a sliding one and a full one), grouped KV heads, random weights (seed 0)."""
    from dsq.models.base import ModelArgs, Transformer

    args = ModelArgs(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                     layer_types=["sliding_attention", "full_attention"], **extra)
    torch.manual_seed(0)
    model = Transformer(args)
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    return model


def _prefill_then_decode(model):
    """A 3-token prompt, then 7 decode steps (T = 1) into a fresh cache: (logits of all 10, cache)."""
    with torch.inference_mode():
        cache = model.make_cache(1, 16, torch.float32)
        outs = [model(torch.tensor([[1, 2, 3]]), torch.arange(3), cache, kv_len=3)[0]]
        for i in range(3, 10):
            outs.append(model(torch.tensor([[i * 3]]), torch.tensor([i]), cache, kv_len=i + 1)[0])
    return torch.cat(outs), cache


@needs_kernels
def test_attention_decode_step_uses_c_attention(monkeypatch):
    """The eager CPU decode step (T = 1, with a mask) runs the C attention; its logits equal the
    SDPA step's (DSQ_KERNELS=reference forces SDPA and the torch kernels)."""
    model = _tiny_transformer()
    calls = []
    real = cpu.attn_decode
    monkeypatch.setattr(cpu, "attn_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(dispatch, "attn_step_cpu", lambda *a, **k: None)  # (the one-call step: tested below)

    fast = _prefill_then_decode(model)[0]
    assert len(calls) == 7 * 2
    monkeypatch.setenv("DSQ_KERNELS", "reference")
    torch.testing.assert_close(fast, _prefill_then_decode(model)[0], atol=1e-5, rtol=1e-5)
    assert len(calls) == 7 * 2
    assert dispatch.attn_decode_cpu(torch.randn(1, 1, 4, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16),
                                    None, 0.25) is None  # reference forced: not taken


def test_compile_help_names_the_cpu(runner):
    """--compile works on the CPU too (_CompiledStep): its help must not say CUDA only."""
    from dsq.cli import app

    r = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "300", "TERM": "dumb"})
    assert r.exit_code == 0
    line = next(ln for ln in r.output.splitlines() if "--compile" in ln)
    assert "CPU" in line and "native on CUDA:" not in line


def _attn_step_inputs(B, H, Hk, S, D, norm, gen):
    """q, k, v as views of one fused projection output (B, 1, (H + 2 Hk) D), norm weights, rope
    rows at per-row positions, caches longer than S, the slot S - 1, a mask."""
    from dsq.models.base import rope_tables

    qkv = torch.randn(B, 1, (H + 2 * Hk) * D, generator=gen)
    q, k, v = (t.view(B, 1, -1, D) for t in qkv.split((H * D, Hk * D, Hk * D), dim=-1))
    qw, kw = (torch.randn(D, generator=gen) + 1, torch.randn(D, generator=gen) + 1) if norm else (None, None)
    cos, sin = rope_tables({"rope_type": "default", "rope_theta": 10000.0}, D, 512, "cpu")
    pos = torch.tensor([max(S - 1 - 3 * b, 0) for b in range(B)])[:, None, None]  # left-padded rows: other positions
    kc, vc = torch.randn(B, Hk, S + 5, D, generator=gen), torch.randn(B, Hk, S + 5, D, generator=gen)
    mask = torch.rand(B, 1, 1, S, generator=gen) > 0.3
    mask[..., -1] = True
    return q, k, v, qw, kw, cos[pos], sin[pos], kc, vc, torch.tensor([S - 1]), mask


@needs_kernels
@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("B,H,Hk,S,D,norm", [(1, 4, 1, 160, 256, True), (2, 4, 2, 37, 64, True),
                                             (3, 3, 3, 1, 8, False), (1, 8, 2, 300, 128, False)])
def test_c_attn_step_equals_the_ops_it_replaces(isa, B, H, Hk, S, D, norm):
    """cpu.attn_step (q/k norm, rope, KV cache write, attention in one C call) gives exactly the
    results of the C norm, apply_rope, KVCache.update's index_copy_ and the C attention one by one."""
    from dsq.models.base import apply_rope

    lib = cpu.load(isa)
    gen = torch.Generator().manual_seed(B * 1000 + S)
    q, k, v, qw, kw, cos, sin, kc, vc, slots, mask = _attn_step_inputs(B, H, Hk, S, D, norm, gen)
    for m in (mask, None):
        kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        out = cpu.attn_step(q, k, v, qw, kw, 1e-6, cos, sin, kc1, vc1, slots, S, m, 0.0625, lib=lib)
        qn, kn = q, k
        if norm:
            qn, kn = cpu.rms_norm(q.contiguous(), qw, 1e-6, lib=lib), cpu.rms_norm(k.contiguous(), kw, 1e-6, lib=lib)
        qr, kr = apply_rope(qn, cos, sin), apply_rope(kn, cos, sin)
        kc2.index_copy_(2, slots, kr.transpose(1, 2))
        vc2.index_copy_(2, slots, v.transpose(1, 2))
        ref = cpu.attn_decode(qr, kc2[:, :, :S], vc2[:, :, :S], m, 0.0625, lib=lib)
        assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2)
        assert torch.equal(out, ref)


@needs_kernels
def test_c_attn_step_rejects_bad_input():
    gen = torch.Generator().manual_seed(0)
    q, k, v, qw, kw, cos, sin, kc, vc, slots, mask = _attn_step_inputs(1, 4, 2, 9, 16, True, gen)
    ok = (q, k, v, qw, kw, 1e-6, cos, sin, kc, vc, slots, 9, mask, 0.25)
    cpu.attn_step(*ok)
    for i, bad in [(11, 16), (10, torch.tensor([9])), (0, q.double()), (9, vc[:, :, :-1]), (12, mask[..., :-1]),
                   (3, torch.randn(8)), (8, kc.transpose(2, 3))]:
        args = list(ok)
        args[i] = bad
        with pytest.raises(ValueError):
            cpu.attn_step(*args)
    assert dispatch.attn_step_cpu(*ok[:8], kc.half(), vc.half(), *ok[10:]) is None  # another cache dtype: not taken


@needs_kernels
@pytest.mark.parametrize("gemma", [True, False])
def test_decode_step_uses_one_call_attention(monkeypatch, gemma):
    """The eager CPU decode step (T = 1) runs q/k norm, rope, the cache write and attention as one
    C call (cpu.attn_step): logits and KV cache exactly those of the op-by-op step."""
    extra = dict(qk_norm=True, norm_offset=1.0, sandwich_norm=True, hidden_act="gelu_tanh",
                 query_pre_attn_scalar=16) if gemma else {}
    model = _tiny_transformer(**extra)
    calls = []
    real = cpu.attn_step
    monkeypatch.setattr(cpu, "attn_step", lambda *a, **k: calls.append(1) or real(*a, **k))

    fast, fast_cache = _prefill_then_decode(model)
    assert len(calls) == 7 * 2
    monkeypatch.setattr(dispatch, "attn_step_cpu", lambda *a, **k: None)
    slow, slow_cache = _prefill_then_decode(model)
    assert len(calls) == 7 * 2
    assert torch.equal(fast, slow)
    assert all(torch.equal(a, b) for a, b in zip(fast_cache.k + fast_cache.v, slow_cache.k + slow_cache.v))


def test_reference_switch_is_read_at_every_call_without_os_environ_get(monkeypatch):
    """DSQ_KERNELS=reference takes effect whenever it is set (the process's start, or later through
    os.environ / monkeypatch.setenv), but _reference() (~200 calls a decode step) reads os.environ's
    own mapping instead of calling os.environ.get."""
    import os

    def reference() -> bool:
        os.environ.get = lambda *a, **k: pytest.fail("os.environ.get called")
        try:
            return dispatch._reference()
        finally:
            del os.environ.get

    monkeypatch.delenv("DSQ_KERNELS", raising=False)
    assert not reference()
    monkeypatch.setenv("DSQ_KERNELS", "reference")
    assert reference() and not dispatch._cpu_kernels()
    monkeypatch.setenv("DSQ_KERNELS", "c")
    assert not reference()


@needs_kernels
def test_rms_norm_dispatch_checks_the_weight(monkeypatch):
    """dispatch.rms_norm_cpu checks everything cpu.rms_norm would (and calls it with check=False):
    a weight of another width, not contiguous or not 1-D gives None (the caller runs torch)."""
    seen = []
    real = cpu.rms_norm
    monkeypatch.setattr(cpu, "rms_norm", lambda *a, **k: seen.append(k.get("check", True)) or real(*a, **k))
    x, w = torch.randn(1, 1, 64), torch.randn(64)
    with torch.inference_mode():
        assert torch.equal(dispatch.rms_norm_cpu(x, w, 1e-6), real(x, w, 1e-6))
        assert seen == [False]
        for bad in (torch.randn(32), torch.randn(128)[::2], torch.randn(1, 64)):
            assert dispatch.rms_norm_cpu(x, bad, 1e-6) is None
    assert seen == [False]


@needs_kernels
def test_generation_prefill_takes_int8_rows_scoring_does_not(tiny_gguf, monkeypatch):
    """A generation's prefill runs inside dispatch.int8_prefill (the avx2 build then rounds x to
    int8 at M > 1, as its decode does at M = 1), and turns it off after; logits() (scoring, eval)
    never asks for it."""
    from dsq.runtime.generate import GenStats
    from dsq.runtime.native import NativeModel
    from dsq.runtime.sampling import SamplingParams

    m = NativeModel(tiny_gguf("llama", "Q4_K_M"), "gguf", n_ctx=64, dtype="fp32")
    seen = []
    real = cpu.set_int8_rows
    monkeypatch.setattr(cpu, "set_int8_rows", lambda on, lib=None: seen.append(on) or real(on, lib))
    m.logits(IDS[:12])
    assert seen == []
    m.reset()
    list(m.stream(IDS[:12], SamplingParams(temperature=0), 3, GenStats(), ignore_eos=True))
    assert seen == [True, False]
