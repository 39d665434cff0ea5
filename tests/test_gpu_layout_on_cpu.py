"""What the loader does for a GPU, run on the CPU: every quantized module becomes a PackedLinear
(the Triton kernels' layout), same-format q/k/v and gate/up fuse, and the model computes the
same logits as with the checkpoint's own modules. On the CPU a PackedLinear runs the packed
torch reference, so this checks the repacking, fusion and module plumbing that a GPU run uses;
the kernels themselves are checked in test_kernels_triton.py."""

from __future__ import annotations

import numpy as np
import pytest

IDS = list(range(3, 40))


def logits(path, kind, packed: bool, monkeypatch):
    from dsq.kernels import dispatch
    from dsq.runtime.native import NativeModel
    from dsq.runtime.qmodules import PackedLinear

    with monkeypatch.context() as mp:
        if packed:
            mp.setattr(dispatch, "use_triton", lambda device: True)
        m = NativeModel(path, kind, n_ctx=64, dtype="fp32")
    mods = [x for x in m.model.modules() if isinstance(x, PackedLinear)]
    assert bool(mods) == packed
    fused = sum(hasattr(layer.self_attn, "qkv_proj") + hasattr(layer.mlp, "gate_up_proj")
                for layer in m.model.model.layers)
    return np.asarray(m.logits(IDS)), fused


@pytest.mark.parametrize("kind,qtype", [("llama", "Q8_0"), ("llama", "Q4_K_M"), ("deepseek_v3", "Q4_K_M")])
def test_gguf_packed_for_the_gpu(kind, qtype, tiny_gguf, monkeypatch):
    """(DeepSeek: each routed expert's slice of the stacked blocks packed on its own.) The C row
    dots keep x in float (DSQ_NO_VNNI=1), as the packed reference does: their int8 rounding of x
    (VNNI, the avx2 build) moves a random MoE's routing by more than the repacking may."""
    monkeypatch.setenv("DSQ_NO_VNNI", "1")
    path = tiny_gguf(kind, qtype)
    ref, _ = logits(path, "gguf", False, monkeypatch)
    got, fused = logits(path, "gguf", True, monkeypatch)
    assert np.abs(got - ref).max() < 1e-3 * np.abs(ref).max()
    if qtype == "Q8_0":
        assert fused == 2 * 2  # one format everywhere: q/k/v and gate/up fuse in both layers


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M"])
def test_one_token_adds_the_residual_in_the_down_projection(qtype, tiny_gguf, monkeypatch):
    """A one-token step on the GPU's route (dispatch._triton_device) on the CPU: each layer's
    x + mlp(h) goes into its down projection's int8-x GEMV as the bias (dispatch.linear_add), run
    by the interpreter, and the logits equal those of the separate add. The GEMVs without a bias
    run the kernel's torch reference (packed.linear_ref_q8), as the interpreter takes ~5 s a call.
    Q4_K_M: Q6_K down projections among them."""
    import torch

    from dsq.kernels import dispatch, packed, triton_gemv_q8
    from dsq.runtime.native import NativeModel

    if not dispatch.ACT_Q8:
        pytest.skip("DSQ_ACT_Q8=0: no int8-x GEMV")
    with monkeypatch.context() as mp:
        mp.setattr(dispatch, "use_triton", lambda device: True)
        m = NativeModel(tiny_gguf("llama", qtype), "gguf", n_ctx=64, dtype="fp32")
    seen, real = [], triton_gemv_q8.q8_linear

    def q8_linear(x, p, bias=None, **k):
        seen.append(bias is not None)
        if bias is None:
            return packed.linear_ref_q8(x, p)
        return real(x, p, bias, config={"BN": 64, "BK": 256})

    monkeypatch.setattr(dispatch, "_triton_device", lambda x: True)
    monkeypatch.setattr(triton_gemv_q8, "q8_linear", q8_linear)
    ids = torch.tensor([[IDS[5]]])
    with torch.inference_mode():
        fused = m.model(ids)
        n, seen[:] = sum(seen), []
        monkeypatch.setattr(dispatch, "FUSE_RESIDUAL", False)
        plain = m.model(ids)
    assert n == len(m.model.model.layers) and seen and not any(seen)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5 * float(plain.abs().max()))


@pytest.mark.parametrize("method", ["gptq", "awq", "fp8"])
def test_checkpoints_packed_for_the_gpu(method, tiny_dir, tmp_path, monkeypatch):
    from dsq.quant import CalibSpec, QuantSpec, quantize

    out = tmp_path / method
    spec = QuantSpec(method, calib=CalibSpec(samples=4, seq_len=32), act_order=method == "gptq")
    quantize(tiny_dir("llama"), out, spec)
    ref, _ = logits(out, "hf", False, monkeypatch)
    got, fused = logits(out, "hf", True, monkeypatch)
    assert np.abs(got - ref).max() < 1e-3 * np.abs(ref).max()
    # q/k/v and gate/up fuse in both layers, act-order included: GPTQ gives linears that read one
    # input one column order (dsq solves them together), so they stack with it
    assert fused == 2 * 2


def test_each_source_module_is_freed_before_the_next_converts():
    """prepare_kernels keeps no module past its turn: a GGUF's blocks and the kernels' layout never
    both fill GPU memory (an 8B model peaked at 10.9 GB of VRAM when the loop held them all)."""
    import weakref

    import torch
    from torch import nn

    from dsq.runtime.qmodules import prepare_kernels

    seen = []

    class Source(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("raw", torch.zeros(8, dtype=torch.uint8))

        def kernel_module(self):
            seen.append(sum(r() is not None for r in refs))  # sources still alive as this one converts
            return nn.Identity()

    model = nn.Sequential(nn.Sequential(Source(), Source()), Source(), nn.Linear(2, 2))
    refs = [weakref.ref(m) for m in model.modules() if isinstance(m, Source)]
    assert prepare_kernels(model) == 3
    assert seen == [3, 2, 1] and all(r() is None for r in refs)
    assert all(not isinstance(m, Source) for m in model.modules())



def test_streamed_layers_hold_a_few_modules_at_a_time(monkeypatch):
    """A streamed prefill stages each CPU layer's quantized modules one by one (StreamedLayers.take):
    while one computes, at most STREAM_AHEAD more are converted on the GPU, never two whole
    layers; a module's file blocks are dropped once converted; after the first layer the modules
    are staged in the order the layer calls them (fusing renames them out of that order); the
    result is the CPU layer's; the CPU layers keep their own modules. (On the CPU: a clone stands
    in for the copy to the GPU, events that are already done for the GPU's.)"""
    import weakref

    import torch
    from torch import nn

    from dsq.runtime import streamed as st

    converted, blocks, alive, order = [], [], [], []

    class Kernel(nn.Module):
        def __init__(self, w, name):
            super().__init__()
            self.w, self.name = w, name

        def forward(self, x):
            return x * self.w

    class Source(nn.Module):
        def __init__(self, w):
            super().__init__()
            self.register_buffer("raw", torch.full((8,), w, dtype=torch.uint8))

        def kernel_module(self):
            blk = [r() for r in blocks if r() is not None and r().dtype == torch.uint8]
            alive.append((1 + sum(r() is not None for r in converted), len(blk)))  # with this one
            k = Kernel(float(self.raw[0]), self.tag)
            converted.append(weakref.ref(k))
            order.append(self.tag)
            return k

        def forward(self, x):
            return x * float(self.raw[0])

    class Layer(nn.Module):  # registered in another order than forward calls them
        def __init__(self, i):
            super().__init__()
            self.down, self.up, self.qkv = Source(2 + i), Source(3), Source(5)
            for name in ("down", "up", "qkv"):
                getattr(self, name).tag = (i, name)
            self.norm = nn.LayerNorm(4)

        def forward(self, x):
            return self.down(self.up(self.qkv(self.norm(x))))

    class Done:
        def record(self):
            pass

        def query(self):
            return True

        def synchronize(self):
            pass

    class Copy(st.StreamedLayers):
        def _copy(self, t, is_param):
            g = nn.Parameter(t.clone(), requires_grad=False) if is_param else t.clone()
            blocks.append(weakref.ref(g))
            return g

        def _event(self):
            return Done()

        @staticmethod
        def _on_compute(mod, ready):
            pass

    layers = [Layer(i) for i in range(4)]
    s = Copy.__new__(Copy)
    s.layers, s.copies, s.dtype = layers, None, torch.float32
    s.order = [(i, n) for i, layer in enumerate(layers) for n, m in layer.named_modules()
               if n and hasattr(m, "kernel_module")]
    s._calls, s._ready, s._staged, s._used = [], {}, set(), []
    x = torch.randn(2, 4)
    for i, layer in enumerate(layers):
        twin, _ = s._stage(i)
        assert torch.allclose(twin(x), layer(x))
        del twin
        if i == 0:
            s._learn_order()
    assert len(order) == 12 and all(n <= st.STREAM_AHEAD + 1 and b <= 1 for n, b in alive), alive
    assert max(n for n, _ in alive) == st.STREAM_AHEAD + 1  # the window is used, not just bounded
    assert [n for i, n in order if i >= 1] == ["qkv", "up", "down"] * 3  # the call order, learned
    assert all(isinstance(m, Source) for layer in layers for m in (layer.down, layer.up, layer.qkv))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_repacking_transient_memory(qtype):
    """The GPU converts each layer's GGUF blocks at load, and each streamed layer's at prefill:
    what the conversion holds beside its output stays under 4 bytes a weight of one chunk (it took
    ~14 for Q6_K, 0.2 GB of VRAM a chunk), and the output is the size of the blocks (+3%)."""
    import torch

    from dsq.kernels import packed
    from dsq.kernels.gguf_ref import row_bytes
    from tests.live_bytes import LiveBytes

    N, K, chunk = 1024, 4096, 1 << 20
    raw = torch.randint(0, 256, (N, row_bytes(qtype, K)), dtype=torch.uint8)
    with LiveBytes() as live:
        p = packed.from_gguf(raw, qtype, K, chunk=chunk)
        out = sum(t.numel() * t.element_size() for t in p.tensors().values())
        del p
    assert live.now == 0
    assert out <= 1.03 * raw.numel()
    assert live.peak - out < 4 * chunk, (live.peak - out) / chunk


def test_host_mapped_embedding_falls_back_where_it_cannot_map(monkeypatch):
    """map_embedding leaves the embedding as it was (and says so) where its table cannot be pinned
    and mapped (here: no GPU at all, or a pinning failure) and where DSQ_HOST_EMBED=0 asks for VRAM;
    the loader then moves the module as before."""
    import torch
    from torch import nn

    from dsq.runtime import host_mapped

    emb = nn.Embedding(16, 4)
    before = emb.weight
    monkeypatch.setenv("DSQ_HOST_EMBED", "0")
    assert not host_mapped.map_embedding(emb, torch.device("cuda"))
    monkeypatch.delenv("DSQ_HOST_EMBED")

    def no_pinning(t, device):
        raise RuntimeError("cannot pin")

    monkeypatch.setattr(host_mapped, "host_mapped", no_pinning)
    assert not host_mapped.map_embedding(emb, torch.device("cuda"))
    assert emb.weight is before and emb.weight.device.type == "cpu"
