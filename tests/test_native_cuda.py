"""The native runtime on CUDA (runs where a GPU is; CI has none): the same oracles as on the CPU,
plus the captured decode step against the eager one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiny import hf_logits, same_greedy_over_chunk_starts

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
        assert (m._split is not None) == (graph and gpu_layers == 1)  # the GPU part captured, the CPU's eager
        per, _ = GpuLayers.parse(gpu_layers).devices(len(m.model.model.layers), torch.device("cuda"))
        assert [d.type for d in m.model.layer_devices()] == [d.type for d in per]  # the last N layers
        assert m.head_device.type == "cuda" and m.gpu_layers.n_gpu_layers == gpu_layers  # the head with them
        st = GenStats()
        list(m.stream(IDS[:30], SamplingParams(temperature=0), 40, st, ignore_eos=True))
        outs.append(st.token_ids)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_split_model_matches_the_cpu_one(qtype, tiny_gguf):
    """A model split between the CPU (first layer, float32, C kernels) and the GPU (second layer
    and head, bf16): its logits are the all-CPU float32 model's within bf16 rounding, its CPU
    layers and KV cache are float32 and its GPU ones bf16, and the captured split step (_SplitStep)
    decodes the eager split model's greedy tokens."""
    from dsq.runtime.generate import GenStats
    from dsq.runtime.native import NativeModel
    from dsq.runtime.sampling import SamplingParams

    path = tiny_gguf("llama", qtype)
    cpu = NativeModel(path, "gguf", n_ctx=256, gpu_layers=0)
    split = NativeModel(path, "gguf", n_ctx=256, gpu_layers=1, head="gpu")
    eager = NativeModel(path, "gguf", n_ctx=256, gpu_layers=1, cuda_graph=False, head="gpu")
    from dsq.runtime.placement import split_head

    default = NativeModel(path, "gguf", n_ctx=256, gpu_layers=1)  # without --head: the planner's share
    assert split_head(path, 1, 256) == "cpu" and default.head_device.type == "cpu"
    assert [d.type for d in split.model.layer_devices()] == ["cpu", "cuda"] and split.head_device.type == "cuda"
    assert split.model.layer_dtypes() == [torch.float32, torch.bfloat16]
    assert [k.dtype for k in split.cache.k] == [torch.float32, torch.bfloat16]
    ref, out = cpu.logits(IDS), split.logits(IDS)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 2e-2
    toks = []
    for m in (split, eager):
        st = GenStats()
        list(m.stream(IDS[:30], SamplingParams(temperature=0), 24, st, ignore_eos=True))
        toks.append(st.token_ids)
    assert split._split is not None and eager._split is None
    assert toks[0] == toks[1]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M"])
def test_split_cpu_layer_in_one_call(qtype, tiny_gguf):
    """The split step's CPU layer decodes through one C call (dsq/runtime/fused_layer.py): its
    descriptor points at the weights as they end up (StreamedLayers pins them after loading), and
    the captured split step decodes the op-by-op CPU layer's greedy tokens."""
    from dsq.runtime.generate import GenStats
    from dsq.runtime.native import NativeModel
    from dsq.runtime.sampling import SamplingParams

    m = NativeModel(tiny_gguf("llama", qtype), "gguf", n_ctx=256, gpu_layers=1)
    assert m.fused_layers == 1 and m._split is not None
    layer, f = m.model.model.layers[0], m.model._fused_decode.layers[0]
    first = next(mod for n, mod in layer.self_attn._modules.items() if n in ("qkv_proj", "qk_proj", "q_proj"))
    assert f.desc.qkv[0].w == first.raw.data_ptr() and f.desc.down.w == layer.mlp.down_proj.raw.data_ptr()
    toks = []
    for fused in (True, False):
        keep = m.model._fused_decode
        m.model._fused_decode = keep if fused else None
        m.reset()
        st = GenStats()
        list(m.stream(IDS[:30], SamplingParams(temperature=0), 24, st, ignore_eos=True))
        m.model._fused_decode = keep
        toks.append(st.token_ids)
    assert toks[0] == toks[1]


def _prefill_two_chunks(m):
    """(first chunk's logits, a second chunk's after the cached prefix, layer 0's keys and values)."""
    pad = torch.zeros(1, dtype=torch.long)
    with torch.inference_mode():
        first = m._prefill(IDS[:24], 0, m.cache, pad).float().cpu()
        logits = m._prefill(IDS[24:60], 24, m.cache, pad).float().cpu()
    return first, logits, m.cache.k[0][:, :, :60].float().cpu(), m.cache.v[0][:, :, :60].float().cpu()


def _rel(a, b) -> float:
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M"])
@pytest.mark.parametrize("gpu_layers, head", [(1, "gpu"), (0, "cpu"), (0, "gpu")])
def test_streamed_prefill_matches_the_gpu_layers(qtype, gpu_layers, head, tiny_gguf, monkeypatch):
    """A long prompt runs the CPU layers on the GPU, their weights streamed over (StreamedLayers),
    in a split model, in a CPU model on a machine with a GPU and in one whose head alone is on the
    GPU. Layer 0 then computes what it
    computes on the GPU in an all-GPU model (same kernels, bf16): the same keys and values, kept in
    its CPU cache, and the same logits. Against the CPU's own float32 kernels (no streaming) the
    difference is bf16 rounding of activations and weights (~2% on this 2-layer random model)."""
    from dsq.runtime import native
    from dsq.runtime.native import NativeModel

    path = tiny_gguf("llama", qtype)
    gpu = _prefill_two_chunks(NativeModel(path, "gguf", n_ctx=256, gpu_layers=-1, cuda_graph=False))
    m = NativeModel(path, "gguf", n_ctx=256, gpu_layers=gpu_layers, head=head)
    assert m._streamed is not None and m._streamed.pinned
    streamed = _prefill_two_chunks(m)
    monkeypatch.setattr(native, "STREAM_MIN_ROWS", 0)
    cpu_kernels = _prefill_two_chunks(NativeModel(path, "gguf", n_ctx=256, gpu_layers=gpu_layers, head=head))
    for got, same, near in zip(streamed, gpu, cpu_kernels):
        assert _rel(got, same) < (1e-3 if head == "gpu" else 2e-2)  # --head cpu: on the CPU in float32
        assert _rel(got, near) < 5e-2


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


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M"])
def test_host_mapped_embedding(qtype, tiny_gguf, monkeypatch):
    """All on the GPU, the token embedding stays in pinned RAM, read by the GPU at its host address
    (runtime/host_mapped.py): it lies in no segment of torch's GPU allocator (the table in VRAM
    does), and greedy decode (the captured step looks the token up) gives the same tokens and
    logits as with the table in VRAM."""
    from dsq.runtime import native_loader
    from dsq.runtime.native import NativeModel

    path = tiny_gguf("llama", qtype)
    runs = []
    for mapped in (True, False):
        with monkeypatch.context() as mp:
            if not mapped:
                mp.setattr(native_loader, "map_embedding", lambda embed, device: False)
            m = NativeModel(path, "gguf", n_ctx=128, gpu_layers="all")
            raw = m.model.model.embed_tokens.raw
            assert raw.is_cuda
            segments = [(s["address"], s["address"] + s["total_size"]) for s in torch.cuda.memory_snapshot()]
            in_vram = any(a <= raw.data_ptr() < b for a, b in segments)
            runs.append((in_vram, m.logits(IDS[:20]), _greedy(m, 12)))
            del m
    (vram_m, logits_m, toks_m), (vram_g, logits_g, toks_g) = runs
    assert not vram_m and vram_g  # mapped: the table is not in VRAM
    assert np.array_equal(logits_m, logits_g) and toks_m == toks_g


def _greedy(m, n: int) -> list[int]:
    from dsq.runtime.generate import GenStats
    from dsq.runtime.sampling import SamplingParams

    return [e.token_id for e in m.stream(IDS[:30], SamplingParams(temperature=0), n, GenStats(), ignore_eos=True)]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M"])
def test_head_alone_on_the_gpu_at_zero_layers(qtype, tiny_gguf):
    """--gpu-layers 0 with the head on the GPU (the default where llama.cpp's reserve at -ngl 0
    holds it, placement.split_head): every layer on the CPU in float32 through its one C call, the
    final norm and the head a captured graph (_SplitStep after the last layer). Its logits are the
    all-CPU model's within bf16 rounding of the head; the captured step decodes the eager model's
    greedy tokens; --head 0.5 keeps half the rows in RAM, joined after the graph."""
    from dsq.runtime.generate import GenStats
    from dsq.runtime.native import NativeModel
    from dsq.runtime.placement import split_head
    from dsq.runtime.sampling import SamplingParams

    path = tiny_gguf("llama", qtype)
    cpu = NativeModel(path, "gguf", n_ctx=256, gpu_layers=0, head="cpu")
    assert cpu.head_device.type == "cpu" and cpu._split is None and cpu.model.dtype == torch.float32
    default = NativeModel(path, "gguf", n_ctx=256, gpu_layers=0)  # this tiny head is far larger than the reserve
    assert split_head(path, 0, 256) == "cpu" and default.head_device.type == "cpu"
    ref = cpu.logits(IDS)
    n = cpu.model.args.num_hidden_layers
    for head in ("gpu", "0.5"):
        m = NativeModel(path, "gguf", n_ctx=256, gpu_layers=0, head=head)
        eager = NativeModel(path, "gguf", n_ctx=256, gpu_layers=0, head=head, cuda_graph=False)
        assert {d.type for d in m.model.layer_devices()} == {"cpu"} and m.model.model.norm.weight.is_cuda
        assert m.model.layer_dtypes() == [torch.float32] * n and [k.dtype for k in m.cache.k] == [torch.float32] * n
        assert m.fused_layers == n and m._split is not None and m._split.start == n and eager._split is None
        assert m._split.head_rows == (head == "0.5") and m.head_device.type == ("cuda" if head == "gpu" else "cpu")
        assert np.linalg.norm(m.logits(IDS) - ref) / np.linalg.norm(ref) < 2e-2
        toks = []
        for x in (m, eager):
            st = GenStats()
            list(x.stream(IDS[:30], SamplingParams(temperature=0), 24, st, ignore_eos=True))
            toks.append(st.token_ids)
        assert toks[0] == toks[1]
        del m, eager


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M"])
def test_split_head_in_ram(qtype, tiny_gguf):
    """--head cpu: a split model keeps its output head in RAM (as llama.cpp does below 'all'). The
    GPU layers are still one captured graph, the head then runs on the CPU's kernels: the VRAM the
    head took is free, and the captured steps' logits, fed the same tokens, are the head-on-GPU
    model's within bf16-against-float32 rounding of the head (a bf16 GEMV on the GPU, float32 C
    kernels on the CPU). --head 0.5: half its rows in VRAM, run at the end of the graph, the rest
    in RAM; the logits joined in RAM are the same within that rounding, and its VRAM is between."""
    from dsq.runtime.native import NativeModel

    path = tiny_gguf("llama", qtype)
    pad = torch.zeros(1, dtype=torch.long)
    runs = {}
    for head in ("gpu", "cpu", "0.5"):
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        m = NativeModel(path, "gguf", n_ctx=128, gpu_layers=1, head=head)
        held = torch.cuda.memory_allocated() - before
        assert m.head_device.type == ("cuda" if head == "gpu" else "cpu") and m._split is not None
        assert m._split.head_on_cpu == (head != "gpu") and m._split.head_rows == (head == "0.5")
        if head == "0.5":
            assert m.model.lm_head.gpu_rows.lo.is_cuda and m.model.lm_head.cpu_rows.raw.device.type == "cpu"
        head_bytes = sum(t.numel() * t.element_size() for t in m.model.lm_head.buffers())
        # in RAM, the head is fed the final norm's float32 output from the GPU: its logits are float32
        assert m.model.model.norm.weight.is_cuda
        with torch.inference_mode():
            steps = [m._prefill(IDS[:20], 0, m.cache, pad).float().cpu()]
            for j, tok in enumerate(IDS[20:28]):  # teacher-forced: the same tokens into both
                out = m._decode(torch.tensor([tok], device=m.head_device), 20 + j, m.cache, pad)
                assert out.dtype == (m.model.dtype if head == "gpu" else torch.float32)
                assert out.device == m.head_device
                steps.append(out.float().cpu())
        runs[head] = (held, head_bytes, steps)
        del m
    (held_g, _, steps_g), (held_c, n, steps_c) = runs["gpu"], runs["cpu"]
    held_r, _, steps_r = runs["0.5"]
    assert held_g - held_c >= 0.9 * n  # about the head's blocks (as the CPU holds them): not in VRAM
    assert held_c < held_r < held_g
    for c, r, g in zip(steps_c, steps_r, steps_g):
        assert torch.isfinite(c).all() and _rel(c, g) < 0.02 and _rel(r, g) < 0.02


@pytest.mark.parametrize("kind, qtype", [("llama", "Q4_K_M"), ("gemma3", "F32")])
def test_prefill_graphs_equal_eager_chunks(kind, qtype, tiny_gguf, monkeypatch):
    """Full prompt chunks replayed from CUDA graphs (one per attention span) give the eager chunks'
    logits and greedy tokens: a prompt of several chunks, the same prompt again (replays), and a
    prompt that shares a prefix, so its chunks start at other slots."""
    from dsq.runtime import native

    monkeypatch.setattr(native, "PREFILL_CHUNK", 16)  # chunks of 16 tokens: spans 16, 32, 64, 128
    path = tiny_gguf(kind, qtype)
    graphs = native.NativeModel(path, "gguf", n_ctx=128, gpu_layers=-1)
    eager = native.NativeModel(path, "gguf", n_ctx=128, gpu_layers=-1)
    eager._prefill_graphs = None
    assert graphs._prefill_graphs is not None
    prompt = (IDS * 2)[:90]
    same_greedy_over_chunk_starts(graphs, eager, prompt)
    assert set(graphs._prefill_graphs.graphs) == {16, 32, 64, 128} and not graphs._prefill_graphs.failed
    with torch.inference_mode():
        for m in (graphs, eager):
            m.reset()
        a = graphs._prefill(prompt, 0, graphs.cache, torch.zeros(1, dtype=torch.long, device="cuda")).float()
        b = eager._prefill(prompt, 0, eager.cache, torch.zeros(1, dtype=torch.long, device="cuda")).float()
    assert torch.allclose(a, b, rtol=1e-3, atol=1e-3 * b.abs().max().item())
