"""The native runtime on CUDA (runs where a GPU is; CI has none): the same oracles as on the CPU,
plus the captured decode step against the eager one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiny import hf_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
IDS = [5, 17, 99, 250, 31, 7, 400, 12, 3, 77] * 8


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
def test_cuda_fp32_logits_match_transformers(kind, tiny_dir):
    from dsq.runtime.native import NativeModel

    m = NativeModel(tiny_dir(kind), "hf", n_ctx=256, gpu_layers=-1, dtype="fp32")
    assert {str(d) for d in m.model.layer_devices()} == {"cuda:0"}
    assert np.abs(m.logits(IDS) - hf_logits(tiny_dir(kind), IDS)).max() < 1e-3


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_cuda_bf16_close_to_fp32(kind, tiny_dir):
    from dsq.runtime.native import NativeModel

    m = NativeModel(tiny_dir(kind), "hf", n_ctx=256, gpu_layers=-1, dtype="bf16")
    ref = hf_logits(tiny_dir(kind), IDS)
    out = m.logits(IDS)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 3e-2


@pytest.mark.parametrize("gpu_layers", [-1, 1])
def test_graph_decode_equals_eager(gpu_layers, tiny_dir):
    """Greedy tokens through the captured step (all on GPU) and the eager/split paths agree."""
    from dsq.runtime.generate import GenStats
    from dsq.runtime.gpu_layers import GpuLayers
    from dsq.runtime.native import NativeModel
    from dsq.runtime.sampling import SamplingParams

    outs = []
    for graph in (True, False):
        m = NativeModel(tiny_dir("gemma3"), "hf", n_ctx=256, gpu_layers=gpu_layers, dtype="fp32", cuda_graph=graph)
        assert (m._graph is not None) == (graph and gpu_layers == -1)
        per, head = GpuLayers.parse(gpu_layers).devices(len(m.model.model.layers), torch.device("cuda"))
        assert [d.type for d in m.model.layer_devices()] == [d.type for d in per]  # the last N layers
        assert m.head_device.type == head.type and m.gpu_layers.n_gpu_layers == gpu_layers
        st = GenStats()
        list(m.stream(IDS[:30], SamplingParams(temperature=0), 40, st, ignore_eos=True))
        outs.append(st.token_ids)
    assert outs[0] == outs[1]


def test_captured_batch_decode_equals_eager(tiny_dir):
    """generate_batch through the step captured per batch size (reused by the next call of that
    size, a smaller one in between) gives the eager batch's tokens."""
    from dsq.runtime.native import NativeModel
    from dsq.runtime.sampling import SamplingParams

    greedy = SamplingParams(temperature=0)
    prompts = [IDS[:30], IDS[5:12], IDS[20:61], IDS[3:9]]
    eager = NativeModel(tiny_dir("gemma3"), "hf", n_ctx=128, gpu_layers=-1, dtype="fp32", cuda_graph=False)
    m = NativeModel(tiny_dir("gemma3"), "hf", n_ctx=128, gpu_layers=-1, dtype="fp32")
    want = eager.generate_batch(prompts, greedy, 20, ignore_eos=True)
    assert m.generate_batch(prompts, greedy, 20, ignore_eos=True) == want
    assert m._batch is not None and m._batch[:2] == (4, 128)  # 61 + 20 tokens, rounded up, capped at the context
    assert m.generate_batch(prompts[:2], greedy, 20, ignore_eos=True) == eager.generate_batch(
        prompts[:2], greedy, 20, ignore_eos=True)
    assert m.generate_batch(prompts, greedy, 20, ignore_eos=True) == want


def test_compiled_step_equals_eager(tiny_dir):
    from dsq.runtime.generate import GenStats
    from dsq.runtime.native import NativeModel
    from dsq.runtime.sampling import SamplingParams

    outs = []
    for compile_ in (True, False):
        m = NativeModel(tiny_dir("llama"), "hf", n_ctx=256, gpu_layers=-1, dtype="fp32", compile=compile_)
        st = GenStats()
        list(m.stream(IDS[:30], SamplingParams(temperature=0), 40, st, ignore_eos=True))
        outs.append(st.token_ids)
    assert outs[0] == outs[1]


def test_failed_compile_falls_back_to_the_eager_graph(tiny_dir, monkeypatch):
    """A decode step that torch.compile cannot build (here: one that raises) costs a warning, not
    the run: the eager step is captured instead and generates the same tokens."""
    from dsq.runtime.generate import GenStats
    from dsq.runtime.native import NativeModel
    from dsq.runtime.sampling import SamplingParams

    def broken(model, **kw):
        def step(*a, **k):
            raise RuntimeError("inductor could not build this")
        return step

    outs = []
    for compile_ in (True, False):
        with monkeypatch.context() as mp:
            if compile_:
                mp.setattr(torch, "compile", broken)
            ctx = pytest.warns(UserWarning, match="torch.compile of the decode step failed") if compile_ else \
                __import__("contextlib").nullcontext()
            with ctx:
                m = NativeModel(tiny_dir("llama"), "hf", n_ctx=256, gpu_layers=-1, dtype="fp32", compile=compile_)
        st = GenStats()
        list(m.stream(IDS[:30], SamplingParams(temperature=0), 20, st, ignore_eos=True))
        outs.append(st.token_ids)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_quantize_on_cuda(method, tiny_dir, tmp_path):
    from dsq.quant import CalibSpec, QuantSpec, quantize
    from dsq.runtime.native import NativeModel

    quantize(tiny_dir("llama"), tmp_path / method, QuantSpec(method, calib=CalibSpec(samples=8, seq_len=64)),
             device="cuda")
    m = NativeModel(tmp_path / method, "hf", n_ctx=64, dtype="fp32")
    ref = hf_logits(tiny_dir("llama"), IDS[:30])
    got = m.logits(IDS[:30])
    assert np.isfinite(got).all() and np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.8


@pytest.mark.parametrize("group", [128, 64, -1])
def test_gptq_graph_equals_eager(group):
    import dsq.quant.gptq as Q

    torch.manual_seed(0)
    w = torch.randn(96, 512, device="cuda")
    x = torch.randn(2048, 64, device="cuda") @ torch.randn(64, 512, device="cuda")
    h = Q.Hessian(512, "cuda")
    h.add(x)
    graphed = Q.gptq(w, h.H, 4, group, sym=True, act_order=True)
    Q.GPTQ_CUDA_GRAPHS = False
    try:
        eager = Q.gptq(w, h.H, 4, group, sym=True, act_order=True)
    finally:
        Q.GPTQ_CUDA_GRAPHS = True
    assert torch.equal(graphed.q, eager.q) and torch.equal(graphed.scales, eager.scales)
