"""--experts cpu: a DeepSeek model's routed experts kept in RAM as the GGUF's stacked blocks and run
by one C call per MoE layer (CPURoutedExperts), the rest of the model where it would be. CI has no
GPU, so the CPU stands in for it: the "GPU part" runs on the CPU device and the experts through the
C kernel path; the logits must be those of the all-in-one model on tiny random deepseek_v2 and
deepseek_v3 GGUFs. The CUDA test (skipped without a GPU) runs the real split: attention, router,
shared experts on the GPU, the experts in RAM, the hidden state across once per MoE layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsq.cli import app
from test_cli_errors import one_line_error

KINDS = ["deepseek_v2", "deepseek_v3"]
IDS = [5, 17, 99, 250, 31, 7, 400, 12, 3, 77] * 3
QTYPES = ["Q4_K_M", "Q8_0"]


def _load(path, experts, **kw):
    from dsq.runtime.native import NativeModel

    return NativeModel(path, "gguf", n_ctx=128, dtype="fp32", experts=experts, **kw)


def _greedy(m, n=8):
    """The n greedy tokens after IDS[:12]: the stream's token ids as GenStats keeps them (a token
    whose text is not complete yet, a byte of a character, yields no event of its own)."""
    from dsq.runtime.generate import GenStats
    from dsq.runtime.sampling import SamplingParams

    stats = GenStats()
    for _ in m.stream(IDS[:12], SamplingParams(temperature=0.0), n, stats, ignore_eos=True):
        pass
    return stats.token_ids


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qtype", QTYPES)
def test_cpu_experts_equal_the_all_in_one_model(kind, qtype, tiny_gguf):
    from dsq.models.deepseek_model import CPURoutedExperts, MoE

    path = tiny_gguf(kind, qtype)
    whole, split = _load(path, "gpu"), _load(path, "cpu")
    assert whole.experts == "gpu" and split.experts == "cpu"
    moes = [layer.mlp for layer in split.model.model.layers if isinstance(layer.mlp, MoE)]
    assert moes and all(isinstance(m.experts, CPURoutedExperts) for m in moes)
    a, b = whole.logits(IDS), split.logits(IDS)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max()
    # decode through the cache: the same greedy tokens
    assert _greedy(whole) == _greedy(split)


@pytest.mark.parametrize("kind", KINDS)
def test_stacked_experts_are_the_files_memory(kind, tiny_gguf, monkeypatch):
    """In RAM, the experts' stacked blocks are the file's (memory-mapped) tensor, not a copy. The
    all-in-one model is loaded on the CPU for this (on a GPU machine it would go to the GPU)."""
    from dsq.runtime.experts import _stacked

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    whole = _load(tiny_gguf(kind, "Q4_K_M"), "gpu")
    raws = [e.down_proj.raw for e in whole.model.model.layers[-1].mlp.experts]
    assert raws[0].device.type == "cpu"
    stacked = _stacked(raws)
    assert all(stacked[i].data_ptr() == r.data_ptr() and torch.equal(stacked[i], r) for i, r in enumerate(raws))
    assert _stacked([r.clone() for r in raws]).data_ptr() != raws[0].data_ptr()  # scattered: copied


def test_queued_call_on_a_stand_in_stream(tiny_gguf, monkeypatch):
    """The queued path (a GPU's decode: pinned buffers per layer and row count, the C call as a
    host function on the stream) with the CPU standing in: the "stream" runs the host function at
    once. Each call refills the same buffers and equals the direct call."""
    import types

    from dsq.kernels import cpu
    from dsq.models.deepseek_model import MoE

    m = _load(tiny_gguf("deepseek_v3", "Q4_K_M"), "cpu")
    moe = next(layer.mlp for layer in m.model.model.layers if isinstance(layer.mlp, MoE))
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    launched = []
    monkeypatch.setattr(cpu, "cuda_host_launcher", lambda: lambda stream, fn, arg: (
        launched.append(fn), cpu.run_moe_host(cpu.MoeArgs.from_address(arg))))
    for _ in range(3):
        x = torch.randn(2, m.model.args.hidden_size)
        w, ids = moe.gate(x)
        torch.testing.assert_close(moe.experts.queued(x, ids, w), moe.experts(x, ids, w), rtol=0, atol=0)
    assert launched == [cpu.moe_host_fn()] * 3 and len(moe.experts._slots) == 1


def test_a_step_that_queues_the_experts_on_the_host_says_so(tiny_gguf, monkeypatch):
    """host_work_in_step (the decode loop then waits for its tokens asleep, not spinning on a core
    the C call's threads want): true only where some layer's experts in RAM are queued from its
    device's stream. The CPU stands in for the GPU's stream by making `queues` say yes."""
    from dsq.models.deepseek_model import CPURoutedExperts

    in_ram, in_model = _load(tiny_gguf("deepseek_v2", "Q4_K_M"), "cpu"), _load(tiny_gguf("deepseek_v2", "Q4_K_M"), "gpu")
    assert not in_ram.model.host_work_in_step  # a CPU's call runs directly, not queued
    monkeypatch.setattr(CPURoutedExperts, "queues", staticmethod(lambda device: True))
    assert in_ram.model.host_work_in_step and not in_model.model.host_work_in_step


def test_cpu_experts_refuse_float_experts(tiny_gguf, tiny_dir):
    from dsq.errors import UnsupportedModel

    for path, kind in ((tiny_gguf("deepseek_v3", "F32"), "gguf"), (tiny_dir("deepseek_v3"), "hf")):
        from dsq.runtime.native import NativeModel

        with pytest.raises(UnsupportedModel, match="--experts cpu runs GGUF experts"):
            NativeModel(path, kind, n_ctx=64, dtype="fp32", experts="cpu")
        # auto never picks what cannot run
        assert NativeModel(path, kind, n_ctx=64, dtype="fp32", experts="auto").experts == "gpu"


def test_cli_experts_flag(runner, tiny_gguf):
    path = str(tiny_gguf("deepseek_v3", "Q4_K_M"))
    r = runner.invoke(app, ["run", path, "-b", "native", "--experts", "cpu", "-p", "hello", "-n", "4", "-t", "0"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["run", path, "-b", "native", "--experts", "sideways", "-p", "hello", "-n", "2"])
    assert r.exit_code == 1 and one_line_error(r).startswith("error: --experts takes cpu, gpu or auto")
    r = runner.invoke(app, ["run", path, "-b", "llama.cpp", "--experts", "cpu", "-p", "hello", "-n", "2"])
    assert r.exit_code == 1 and "--backend native" in one_line_error(r)


def test_offload_plans_experts_in_ram(tiny_gguf):
    """With the experts in RAM the GPU holds every layer less their experts, the CPU reads a
    token's share of them, and each MoE layer on the GPU pays one exchange."""
    from dsq.runtime.machine import Bandwidths
    from dsq.runtime.model_shape import load_shape
    from dsq.runtime.placement import plan_placement

    shape = load_shape(tiny_gguf("deepseek_v3", "Q4_K_M"))
    bw = Bandwidths(cpu=10e9, gpu=100e9, split_overhead_s=1e-4, source="test")
    gpu = plan_placement(shape, 1 << 40, ctx=64, backend="native", gpu_layers="all", bandwidths=bw, experts="gpu")
    cpu = plan_placement(shape, 1 << 40, ctx=64, backend="native", gpu_layers="all", bandwidths=bw, experts="cpu")
    experts = sum(shape.expert_bytes)
    n_moe = sum(1 for e in shape.expert_bytes if e)
    assert (gpu.experts, cpu.experts) == ("gpu", "cpu") and cpu.expert_bytes_cpu == experts
    assert gpu.gpu_total_bytes - cpu.gpu_total_bytes == experts
    assert cpu.cpu_total_bytes - gpu.cpu_total_bytes == experts
    read = sum(e * shape.n_expert_used // shape.n_expert for e in shape.expert_bytes)
    assert gpu.bytes_per_token_gpu - cpu.bytes_per_token_gpu == read
    assert cpu.bytes_per_token_cpu - gpu.bytes_per_token_cpu == read
    assert cpu.split_overhead_s == pytest.approx(n_moe * 1e-4)
    # auto: everything fits, all on the GPU is faster; a budget without room for the experts: cpu
    assert plan_placement(shape, 1 << 40, ctx=64, backend="native", gpu_layers="all", bandwidths=bw,
                          experts="auto").experts == "gpu"
    tight = cpu.gpu_total_bytes + 1024
    assert plan_placement(shape, tight, ctx=64, backend="native", gpu_layers="all", bandwidths=bw,
                          experts="auto").experts == "cpu"


def test_experts_gpu_that_cannot_fit_says_what_to_do(tiny_gguf, monkeypatch):
    """On a (pretend) GPU too small for the layers with their experts: --experts gpu is one line
    naming --experts cpu; auto picks cpu; a GPU with room keeps them there."""
    from dsq.errors import DsqError
    from dsq.runtime import experts, placement
    from dsq.runtime.gpu_layers import GpuLayers
    from dsq.runtime.machine import Bandwidths, GpuInfo

    path = tiny_gguf("deepseek_v3", "Q4_K_M")
    bw = Bandwidths(cpu=10e9, gpu=100e9, split_overhead_s=1e-4, source="test")
    monkeypatch.setattr("dsq.runtime.machine.machine_bandwidths", lambda *a, **k: bw)
    need = {e: placement.plan_placement(path, 1 << 40, ctx=64, backend="native", gpu_layers="all", bandwidths=bw,
                                        experts=e).gpu_total_bytes for e in ("gpu", "cpu")}
    assert need["cpu"] < need["gpu"]
    between = (need["cpu"] + need["gpu"]) // 2
    monkeypatch.setattr(placement, "detect_gpu", lambda: GpuInfo("pretend", 1 << 40, between))
    cuda = torch.device("cuda")
    with pytest.raises(DsqError) as e:
        experts.resolve_experts("gpu", path, 64, cuda, GpuLayers.ALL)
    assert "--experts cpu" in e.value.one_line() and "\n" not in e.value.one_line()
    assert experts.resolve_experts("auto", path, 64, cuda, GpuLayers.ALL) == "cpu"
    monkeypatch.setattr(placement, "detect_gpu", lambda: GpuInfo("pretend", 1 << 40, 1 << 40))
    assert experts.resolve_experts("gpu", path, 64, cuda, GpuLayers.ALL) == "gpu"
    assert experts.resolve_experts("auto", path, 64, cuda, GpuLayers.ALL) == "gpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_experts_cpu_rest_on_gpu(kind, tiny_gguf, monkeypatch):
    """The real split: every layer but the routed experts on the GPU (bf16), the experts' blocks in
    RAM. Prompts past QUEUE_ROWS rows take the sent path (one sync a layer), shorter ones the queued
    one (a CUDA host function a layer, no sync), and the decode step is one CUDA graph holding them
    (a batch's too); the logits stay close to the all-on-GPU model's."""
    from dsq.models.deepseek_model import CPURoutedExperts
    from dsq.runtime.native import NativeModel
    from dsq.runtime.sampling import SamplingParams
    from tiny import kld_top1

    path = tiny_gguf(kind, "Q4_K_M")
    whole = NativeModel(path, "gguf", n_ctx=128, gpu_layers="all", experts="gpu")
    split = NativeModel(path, "gguf", n_ctx=128, gpu_layers="all", experts="cpu")
    cpu_parts = [m for m in split.model.modules() if isinstance(m, CPURoutedExperts)]
    assert cpu_parts and all(p.gate.device.type == "cpu" for p in cpu_parts)
    assert all(str(d) == "cuda:0" for d in split.model.layer_devices())
    assert CPURoutedExperts.queues(torch.device("cuda")) and split._graph is not None  # captured
    assert split._wait_blocks and not whole._wait_blocks  # the decode loop sleeps beside the C calls
    for ids in (IDS, IDS[:12]):  # sent, queued
        a, b = whole.logits(ids), split.logits(ids)
        kld, top1, _ = kld_top1(a, b)
        # as test_deepseek's GPU Q4_K_M against the CPU: bf16 on the GPU, int8-rounded x in its
        # kernels against float32 in the C call, so routing may move a few tokens
        assert np.isfinite(b).all() and kld < 0.25 and top1 >= 0.6, (len(ids), kld, top1)
    b = _greedy(split, 16)
    assert len(b) == 16
    assert [len(x) for x in split.generate_batch([IDS[:20], IDS[5:9]], SamplingParams(temperature=0), 4,
                                                 ignore_eos=True)] == [4, 4]  # a batch's captured step
    # without queueing: eager, a sync a layer; it decodes what the captured step does
    monkeypatch.setenv("DSQ_MOE_QUEUE", "0")
    eager = NativeModel(path, "gguf", n_ctx=128, gpu_layers="all", experts="cpu")
    c = _greedy(eager, 16)
    assert eager._graph is None and sum(x == y for x, y in zip(b, c)) >= 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_prompt_chunks_stream_the_experts_from_ram(kind, tiny_gguf, monkeypatch):
    """Experts in RAM, the rest on the GPU: a prompt of STREAM_ROWS tokens or more copies each MoE
    layer's experts to the GPU and runs them with the GPU's kernels, so its logits are the all-on-GPU
    model's (the same grouped kernels over the same blocks: PAIRS_ROWS lowered so that the all-on-GPU
    pass takes them too, not the pairs' int8-rounded x) up to the order of sums, closer than the C
    call's (int8-rounded x); nothing of the streamed weights stays in VRAM after the prompt."""
    from dsq.models.deepseek_model import CPURoutedExperts, GPUStackedExperts
    from dsq.runtime.native import NativeModel
    from tiny import kld_top1

    path = tiny_gguf(kind, "Q4_K_M")
    whole = NativeModel(path, "gguf", n_ctx=128, gpu_layers="all", experts="gpu")
    split = NativeModel(path, "gguf", n_ctx=128, gpu_layers="all", experts="cpu")
    monkeypatch.setattr(GPUStackedExperts, "PAIRS_ROWS", 16)
    a = whole.logits(IDS)
    c_call = split.logits(IDS)  # 30 rows < STREAM_ROWS: the C call
    monkeypatch.setattr(CPURoutedExperts, "STREAM_ROWS", 16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    streamed = split.logits(IDS)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before + (1 << 20)
    kld_s, top1_s, _ = kld_top1(a, streamed)
    kld_c, _, _ = kld_top1(a, c_call)
    assert np.isfinite(streamed).all() and top1_s >= 0.9 and kld_s <= kld_c + 1e-4, (kld_s, kld_c, top1_s)


def test_streamed_blocks_pass_through_two_buffers_in_turn():
    """CPURoutedExperts.streamed's staging (page-locked on a GPU; plain memory here): each put gives
    the blocks' contents in their shape, from the two buffers in turn, each grown to the largest it
    held; a buffer is filled again only after the copies queued from it are done (its event)."""
    from dsq.models.deepseek_model import _Staging

    st = _Staging(pin=False)
    g = torch.Generator().manual_seed(0)
    blocks = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=g) for shape in ((6, 10), (4, 30), (2, 5))]
    seen = []
    for t in blocks + blocks[:1]:
        with st.put(t) as view:
            assert view.shape == t.shape and torch.equal(view, t)
            seen.append(view.untyped_storage().data_ptr())
    assert seen[0] == seen[2] != seen[1] == seen[3]  # buffers 0, 1, 0, 1
    assert [b.numel() for b in st.bufs] == [60, 120]  # buffer 0 held 60 and 10 bytes, buffer 1 120 and 60

    class Event:  # a queued copy from a buffer, done once synchronized
        def __init__(self):
            self.done = False

        def synchronize(self):
            self.done = True

    ev = st.events[0] = Event()
    with st.put(blocks[2]) as view:  # buffer 0 again: waits for its copies first
        assert ev.done and torch.equal(view, blocks[2])


def test_a_bench_row_with_experts_in_ram_gets_their_roofline(tiny_gguf, monkeypatch):
    """dsq bench's decode roofline for a run with the routed experts in RAM counts the token's share
    of them at the CPU's bandwidth: each summary row says where its experts ran, and the plan beside
    it (dsq.bench.prediction) takes that placement, not the GPU's."""
    import dsq.bench.prediction as prediction
    from dsq.bench.report import summarize
    from dsq.runtime.machine import Bandwidths, GpuInfo
    from dsq.runtime.placement import plan_placement

    path = tiny_gguf("deepseek_v3", "Q4_K_M")
    monkeypatch.setattr(prediction, "detect_gpu", lambda: GpuInfo("test GPU", 80 << 30, 80 << 30))
    bw = Bandwidths(cpu=10e9, gpu=1000e9, split_overhead_s=1e-5, source="calibrated test")
    run = dict(backend="native", gpu_layers="all", gpu_layers_effective=-1, prompt_tokens=16, gen_tokens=4,
               prefill_tok_s=1.0, decode_tok_s=1.0, ttft_ms=1.0, tpot_ms=1.0, peak_rss_mb=1.0, peak_vram_mb=1.0,
               load_s=1.0, threads=1)
    rows = summarize([dict(run, experts="cpu")])
    assert rows[0]["experts"] == "cpu"
    got = prediction.predicted_plans(path, rows, ctx=64, kv_tokens=18, bandwidths=bw)[("native", "all")]
    want = {e: plan_placement(path, vram=0, ctx=64, backend="native", gpu_layers="all", kv_tokens=18,
                              bandwidths=bw, experts=e).roofline_tok_s for e in ("cpu", "gpu")}
    assert got.experts == "cpu" and got.roofline_tok_s == pytest.approx(want["cpu"])
    assert want["cpu"] < want["gpu"] / 2  # the CPU's share dominates: reading it at 1% of the GPU's bandwidth
    gpu_row = summarize([dict(run)])  # a record without the field: the experts ran with their layers
    assert prediction.predicted_plans(path, gpu_row, ctx=64, kv_tokens=18, bandwidths=bw)[
        ("native", "all")].roofline_tok_s == pytest.approx(want["gpu"])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qtype", QTYPES)
def test_a_prompt_chunk_streams_the_experts_and_gets_the_same_logits(kind, qtype, tiny_gguf, monkeypatch):
    """From STREAM_ROWS tokens a call from a GPU copies the layer's experts over and runs them there
    (CPURoutedExperts.streamed: the GGUF blocks converted by packed.from_gguf, run as
    GPUStackedExperts). Here the copy's target is the CPU (streams() is made to answer for CPU rows):
    one call equals the C kernels' on the same rows (to float rounding: both dequantize the same
    blocks), with and without the shared experts' `add`, and a prompt through the model
    (MoE.forward's streamed branch) gives the C path's logits to ~1% of the largest: inside a prompt
    the C kernels round x to int8 (dispatch.int8_prefill), the torch stand-in here does not. A
    chunk below the threshold does not stream. A streamed call runs the grouped GEMMs whatever its
    rows (GPUStackedExperts._grouped), never the pairs."""
    import torch

    from dsq.models.deepseek_model import CPURoutedExperts, GPUStackedExperts, MoE

    path = tiny_gguf(kind, qtype)
    m = _load(path, "cpu")
    moe = next(layer.mlp for layer in m.model.model.layers if isinstance(layer.mlp, MoE))
    ex = moe.experts
    g = torch.Generator().manual_seed(3)
    x = torch.randn(70, ex.hidden, generator=g)
    weights, ids = moe.gate(x)
    want = ex(x, ids, weights)  # the C kernels (CPU rows never stream)
    grouped = []
    real_grouped = GPUStackedExperts._grouped
    monkeypatch.setattr(GPUStackedExperts, "_grouped", lambda self, *a: grouped.append(1) or real_grouped(self, *a))
    got = ex.streamed(x, ids, weights)
    assert grouped  # 70 rows, under PAIRS_ROWS: still the grouped GEMMs, never the pairs
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    add = torch.randn(70, ex.hidden, generator=g)
    assert torch.allclose(ex.streamed(x, ids, weights, add=add), got + add, atol=1e-5)
    base = m.logits(IDS)
    calls = []
    real = CPURoutedExperts.streamed

    def spy(self, *a, **k):
        calls.append(a[0].shape[0])
        return real(self, *a, **k)

    monkeypatch.setattr(CPURoutedExperts, "streams", lambda self, x: x.shape[0] >= 16)
    monkeypatch.setattr(CPURoutedExperts, "streamed", spy)
    streamed = m.logits(IDS)  # 30 tokens: every MoE layer streams
    assert calls and set(calls) == {len(IDS)}
    assert np.abs(streamed - base).max() <= 2e-2 * np.abs(base).max()
    calls.clear()
    m.logits(IDS[:10])
    assert not calls
