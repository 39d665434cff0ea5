"""--experts gpu on a GPU: each MoE layer's routed experts stacked into one packed weight per
projection (GPUStackedExperts, runtime/experts.experts_to_gpu) and run as (token, expert) pairs
through the grouped GEMV with the ids on the device, so the decode step has no host sync and is
captured as one CUDA graph.

CI has no GPU: the module runs on CPU tensors, its grouped GEMV through the Triton interpreter
(triton_interp), against RoutedExperts (one MLP per expert over the GGUF reference) on tiny random
DeepSeek GGUFs' experts. The CUDA tests (skipped without a GPU) load the model on the GPU and
check the captured step against the eager one."""

from __future__ import annotations

import weakref

import pytest
import torch
from triton_interp import CUDA

KINDS = ["deepseek_v2", "deepseek_v3"]
IDS = [5, 17, 99, 250, 31, 7, 400, 12, 3, 77] * 3


def _cpu_model(path):
    from dsq.runtime.native import NativeModel

    return NativeModel(path, "gguf", n_ctx=128, dtype="fp32", experts="gpu", cuda_graph=False)


def _pack_experts(model) -> None:
    """What prepare_kernels does on a GPU, for the experts only: each GGUFLinear a PackedLinear."""
    from dsq.kernels import packed
    from dsq.models.deepseek_model import MoE
    from dsq.runtime.qmodules import PackedLinear

    for layer in model.model.layers:
        if isinstance(layer.mlp, MoE):
            for e in layer.mlp.experts:
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    m = getattr(e, proj)
                    setattr(e, proj, PackedLinear(packed.from_gguf(m.raw, m.qtype, m.in_features), None, m.qtype))


def _interpreted(monkeypatch, calls: list, q8: bool = False):
    """dispatch.packed_experts through the Triton kernel on CPU tensors (the interpreter), float x
    or (q8) x rounded to int8; counts calls."""
    from dsq.kernels import dispatch, triton_gemv, triton_gemv_q8

    def run(x, p, ids, n_expert):
        calls.append(ids.numel())
        if q8:
            return triton_gemv_q8.q8_experts(x, p, ids, n_expert, config={"BN": 8, "BK": 256})
        return triton_gemv.gemv_experts(x, p, ids, n_expert, config={"BN": 32, "BK": 256})

    monkeypatch.setattr(dispatch, "packed_experts", run)


def _no_host_sync(monkeypatch):
    """Any of the ops that read a tensor back to the host raises."""
    def boom(*a, **k):
        raise AssertionError("a host sync in the pairs path")

    for name in ("tolist", "item", "nonzero", "unique", "__bool__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    monkeypatch.setattr(torch, "unique", boom)
    monkeypatch.setattr(torch, "nonzero", boom)


@pytest.mark.skipif(CUDA, reason="the CPU stand-in; the CUDA tests below load the model on the GPU")
@pytest.mark.parametrize("kind,qtype,q8", [("deepseek_v2", "Q4_K_M", False), ("deepseek_v3", "Q8_0", False),
                                          ("deepseek_v2", "Q4_K_M", True)])
def test_stacked_experts_equal_routed_experts(kind, qtype, q8, tiny_gguf, monkeypatch):
    """Float x: within 1e-4 of the largest output; x rounded to int8 per 32 elements (the GPU's
    default, as llama.cpp's): within 4e-2."""
    from dsq.kernels import dispatch
    from dsq.models.deepseek_model import GPUStackedExperts, MoE, RoutedExperts
    from dsq.runtime.experts import experts_to_gpu

    monkeypatch.setenv("DSQ_KERNELS", "reference")  # RoutedExperts over the GGUF reference: the oracle
    m = _cpu_model(tiny_gguf(kind, qtype)).model
    moes = [layer.mlp for layer in m.model.layers if isinstance(layer.mlp, MoE)]
    refs = [moe.experts for moe in moes]
    assert moes and all(type(r) is RoutedExperts for r in refs)
    _pack_experts(m)
    assert experts_to_gpu(m) == 0  # CPU tensors: not stacked outside the tests
    assert experts_to_gpu(m, on=("cpu",)) == len(moes)
    assert all(isinstance(moe.experts, GPUStackedExperts) for moe in moes)
    assert "gate_up" in moes[0].experts._fmts  # gate and up of one format: one stacked weight
    calls: list = []
    _interpreted(monkeypatch, calls, q8)
    tol = 4e-2 if q8 else 1e-4  # q8 rounds x and the activation (1.5e-2 measured; the kernel is exact)
    torch.manual_seed(0)
    for moe, ref in zip(moes, refs):
        H, k = moe.experts.hidden, moe.gate.top_k
        for T in (1, 3):
            x = torch.randn(T, H)
            w, ids = moe.gate(x)
            if T == 3:  # the same experts for two tokens, their slots in another order
                ids[2], w[2] = ids[0].flip(0), w[0].flip(0)
            want = ref(x, ids, w)
            del calls[:]
            with monkeypatch.context() as mp:
                _no_host_sync(mp)
                got = moe.experts(x, ids, w)
            assert calls == [T * k, T * k]  # gate/up, down: every pair in one launch each
            assert got.dtype == x.dtype
            assert (got - want).abs().max() <= tol * want.abs().max(), (T, (got - want).abs().max())
            with monkeypatch.context() as mp:  # as on a GPU: the weighted sum and the shared add in one launch
                mp.setattr(dispatch, "_elementwise_gpu", lambda *ts: True)
                shared = torch.randn(T, H)
                got = moe.experts(x, ids, w, add=shared)
            assert (got - (want + shared)).abs().max() <= tol * (want + shared).abs().max()
        with monkeypatch.context() as mp:  # past PAIRS_ROWS tokens: the pairs sorted by expert (prompt chunks)
            mp.setattr(GPUStackedExperts, "PAIRS_ROWS", 2)
            x = torch.randn(5, H)
            w, ids = moe.gate(x)
            want = ref(x, ids, w)
            del calls[:]
            got = moe.experts(x, ids, w)  # off a GPU: one packed_linear per chosen expert
            assert not calls and (got - want).abs().max() <= 1e-4 * want.abs().max()
            if not hasattr(torch, "_grouped_mm"):  # this torch has no grouped GEMM: the loop is all there is
                continue
            grouped: list = []

            def gemm(xs, p, counts, n_expert):  # the GPU's grouped GEMMs, on the interpreter
                grouped.append((xs.shape[0], sum(counts), n_expert))
                return dispatch.grouped_gemm(xs, p, counts, n_expert)

            mp.setattr(dispatch, "grouped_experts", gemm)
            got = moe.experts(x, ids, w)
            assert not calls and len(grouped) == 2 and all(g == (5 * k, 5 * k, len(refs[0])) for g in grouped)
            assert (got - want).abs().max() <= 1e-4 * want.abs().max()
            shared = torch.randn(5, H)
            got = moe.experts(x, ids, w, add=shared)
            assert (got - (want + shared)).abs().max() <= 1e-4 * (want + shared).abs().max()
            # the fused grouped kernels (a GPU's, here on the interpreter): the counts stay on the device,
            # so the chunk has no host sync at all
            mp.undo()
            mp.setattr(GPUStackedExperts, "PAIRS_ROWS", 2)
            mp.setattr(dispatch, "grouped_fused", lambda xs, p, n: dispatch._FUSED)
            assert moe.experts.fused(x)
            with monkeypatch.context() as m2:
                _no_host_sync(m2)
                got = moe.experts(x, ids, w, add=shared)
            assert not calls and (got - (want + shared)).abs().max() <= 1e-4 * (want + shared).abs().max()


@pytest.mark.skipif(CUDA, reason="the CPU stand-in for the loader's GPU path")
def test_loading_stacks_each_layers_experts_as_soon_as_it_is_converted(tiny_gguf, monkeypatch):
    """The loader stacks a layer's experts right after converting that layer, before the next one,
    and the per-expert weights are freed then (nothing else holds them: the loader's map of the
    model's modules did, which doubled a V2-Lite load's peak VRAM); so the next layer's per-expert
    weights reuse the freed blocks instead of all layers' sitting beside their stacks. The model
    loaded so equals the one with its experts one module each.
    CPU tensors stand in for the GPU's (STACK_ON), the GPU's packed layout made as on a GPU."""
    from types import SimpleNamespace

    from dsq.models.deepseek_model import GPUStackedExperts, MoE
    from dsq.runtime import experts as ex, native_loader

    monkeypatch.setenv("DSQ_KERNELS", "reference")
    path = tiny_gguf("deepseek_v2", "Q4_K_M")
    want = torch.as_tensor(_cpu_model(path).logits(IDS[:12]))
    events: list = []
    freed: list[bool] = []
    convert, stack = native_loader.prepare_kernels, ex.stack_experts

    def converting(module):
        convert(module)
        if isinstance(getattr(module, "mlp", None), MoE):  # a decoder layer with routed experts
            _pack_experts(SimpleNamespace(model=SimpleNamespace(layers=[module])))
        events.append(("convert", id(module)))

    def stacking(layer, on=("cuda",)):
        old = weakref.ref(layer.mlp.experts) if isinstance(layer.mlp, MoE) else None
        done = stack(layer, on)
        events.append(("stack", id(layer)) if done else ("plain", id(layer)))
        if done:  # the per-expert weights go as the stack replaces them, not when the load ends
            freed.append(old() is None)
        return done

    monkeypatch.setattr(native_loader, "prepare_kernels", converting)
    monkeypatch.setattr(ex, "stack_experts", stacking)
    monkeypatch.setattr(native_loader, "STACK_ON", ("cpu",))
    m = _cpu_model(path)
    layers = list(m.model.model.layers)
    moe = [id(layer) for layer in layers if isinstance(layer.mlp, MoE)]
    assert moe and all(isinstance(m.model.model.layers[i].mlp.experts, GPUStackedExperts)
                       for i, layer in enumerate(layers) if id(layer) in moe)
    for lid in moe:  # its stack comes right after its own conversion
        i = events.index(("convert", lid))
        assert events[i + 1] == ("stack", lid), events
    assert freed == [True] * len(moe)
    _interpreted(monkeypatch, [])
    got = torch.as_tensor(m.logits(IDS[:12]))
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


# -- CUDA (skipped without a GPU) --------------------------------------------------------------------
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_stacked_experts_graph_decode_equals_eager(kind, tiny_gguf, monkeypatch):
    """All on the GPU with --experts gpu: every MoE layer's experts stacked, the model graph-safe
    and its decode step captured as one CUDA graph (a batch's too), whose logits step by step are
    the eager step's; prompts of up to PAIRS_ROWS tokens (the pairs path) and longer ones (the
    grouped GEMMs) stay close to the CPU model's (bf16 and int8-rounded x in the GPU's dense
    kernels against float32: routing may move a few tokens)."""
    from dsq.models.deepseek_model import GPUStackedExperts, MoE
    from dsq.runtime.native import NativeModel
    from dsq.runtime.sampling import SamplingParams
    from tiny import kld_top1

    monkeypatch.setattr(GPUStackedExperts, "PAIRS_ROWS", 16)  # the 30-token prompt below takes the grouped GEMMs
    path = tiny_gguf(kind, "Q4_K_M")
    graph = NativeModel(path, "gguf", n_ctx=128, gpu_layers="all", experts="gpu")
    eager = NativeModel(path, "gguf", n_ctx=128, gpu_layers="all", experts="gpu", cuda_graph=False)
    for m in (graph, eager):
        moes = [layer.mlp for layer in m.model.model.layers if isinstance(layer.mlp, MoE)]
        assert moes and all(isinstance(x.experts, GPUStackedExperts) for x in moes)
        assert all(b.is_cuda for x in moes for b in x.experts.buffers())
    assert graph.model.graph_safe and graph._graph is not None and eager._graph is None
    pad = torch.zeros(1, dtype=torch.long, device="cuda")
    prompt = IDS[:12]
    # in inference mode, as generation runs (with autograd on, the MLA decode kernel declines and the
    # eager step would attend through SDPA instead: one bf16 ulp apart, ~1% of these random logits)
    with torch.inference_mode():
        a, b = graph._prefill(prompt, 0, graph.cache, pad), eager._prefill(prompt, 0, eager.cache, pad)
        torch.testing.assert_close(a, b)
        for step in range(8):  # the same tokens into both: the captured step against the eager one
            tok = a.argmax(-1)
            a = graph._decode(tok, len(prompt) + step, graph.cache, pad).clone()
            b = eager._decode(tok, len(prompt) + step, eager.cache, pad)
            assert torch.isfinite(a).all()
            assert (a - b).abs().max() <= 1e-3 * b.abs().max(), (step, (a - b).abs().max())
    cpu = NativeModel(path, "gguf", n_ctx=128, dtype="fp32", experts="gpu")
    for ids in (IDS[:12], IDS):  # pairs, grouped GEMMs
        kld, top1, _ = kld_top1(cpu.logits(ids), graph.logits(ids))
        assert kld < 0.25 and top1 >= 0.6, (len(ids), kld, top1)
    out = graph.generate_batch([IDS[:20], IDS[5:9]], SamplingParams(temperature=0), 4, ignore_eos=True)
    assert [len(x) for x in out] == [4, 4] and graph._batch is not None  # the batch's step captured


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_moe_prompt_chunks_replay_from_graphs(kind, tiny_gguf, monkeypatch):
    """With every projection's grouped GEMM fused, a MoE prompt chunk has no host sync (the experts'
    counts stay on the device), so full chunks are captured and replayed as the dense model's are:
    the same greedy tokens and logits as eager chunks, over several chunks and spans."""
    from dsq.models.deepseek_model import GPUStackedExperts
    from dsq.runtime import native
    from tiny import same_greedy_over_chunk_starts

    monkeypatch.setattr(native, "PREFILL_CHUNK", 16)  # chunks of 16 tokens: spans 16, 32, 64, 128
    monkeypatch.setattr(GPUStackedExperts, "PAIRS_ROWS", 8)  # a chunk takes the grouped GEMMs
    path = tiny_gguf(kind, "Q4_K_M")
    graphs = native.NativeModel(path, "gguf", n_ctx=128, gpu_layers="all", experts="gpu")
    eager = native.NativeModel(path, "gguf", n_ctx=128, gpu_layers="all", experts="gpu")
    eager._prefill_graphs = None
    assert graphs.model.prefill_graph_safe and graphs._prefill_graphs is not None
    prompt = (IDS * 3)[:90]
    same_greedy_over_chunk_starts(graphs, eager, prompt)
    assert graphs._prefill_graphs.graphs and not graphs._prefill_graphs.failed
    pad = torch.zeros(1, dtype=torch.long, device="cuda")
    with torch.inference_mode():
        for m in (graphs, eager):
            m.reset()
        a = graphs._prefill(prompt, 0, graphs.cache, pad).float()
        b = eager._prefill(prompt, 0, eager.cache, pad).float()
    assert torch.allclose(a, b, rtol=1e-3, atol=1e-3 * b.abs().max().item())


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q8_0", "fp8-block"])
def test_cuda_grouped_experts_equal_each_expert_alone(fmt, fused, monkeypatch):
    """On the GPU in bf16, the two grouped paths (not the per-expert fallback) against each expert's
    float32 reference GEMM; every expert chosen but a few, as a prompt chunk chooses them, one of
    them with more rows than a tile: fused (MOE_FUSED: the tensor-core kernel for Q4_K, the tl.dot
    one for the rest) and written out (torch._grouped_mm over dequantized slabs, several of them)."""
    from dsq.kernels import dispatch, packed, triton_dequant, triton_gemm, triton_mma

    monkeypatch.setattr(dispatch, "MOE_FUSED", fused)
    ran: list = []
    name = ("grouped_gemm", dispatch) if not fused else (
        ("grouped_mma_scaled", triton_mma) if fmt == "Q4_K" else ("grouped_linear", triton_gemm))
    real = getattr(name[1], name[0])
    monkeypatch.setattr(name[1], name[0], lambda *a, **k: ran.append(1) or real(*a, **k))

    monkeypatch.setattr(triton_dequant, "SLAB_BYTES", 5 * 512 * 1024 * 2)  # five experts a slab
    E, N, K = 16, 512, 1024
    p = _stacked(fmt, E, N, K).to("cuda")
    counts = [int(c) for c in torch.randint(0, 40, (E,))]
    counts[0] = counts[7] = counts[-1] = 0
    counts[3] = 150  # three tiles of 64 rows on the fused path
    x = torch.randn(sum(counts), K, device="cuda", dtype=torch.bfloat16)
    got = dispatch.grouped_experts(x, p, counts, E)
    assert ran and not [f for f in dispatch.FAILED if f.startswith("grouped experts")], dispatch.FAILED
    r = 0
    for e, c in enumerate(counts):
        if not c:
            continue
        want = x[r:r + c].float() @ packed.dequantize(p.rows(e * N, (e + 1) * N)).float().t()
        assert (got[r:r + c].float() - want).abs().max() <= 2e-2 * want.abs().max().clamp(min=1e-6), e
        r += c


def test_expert_views_of_the_stack():
    """Expert e's rows of a stacked weight (what the grouped GEMMs dequantize, a slab of experts at
    a time): views, FP8 128-row scale blocks included."""
    from dsq.kernels import packed
    from dsq.models.deepseek_model import GPUStackedExperts

    E, N, K = 3, 128, 256
    ws = [(torch.randn(N, K) * 3).to(torch.float8_e4m3fn) for _ in range(E)]
    ps = [packed.from_fp8(w, torch.rand(1, 2) + 0.01) for w in ws]
    st = packed.Packed.cat(ps)
    m = GPUStackedExperts(None, st, st, st, E, torch.nn.functional.silu)
    for e in range(E):
        ex = m.weight("down").rows(e * N, (e + 1) * N)
        assert ex.N == N and ex.lo.data_ptr() == m.down_lo[e * N].data_ptr()
        assert torch.equal(packed.dequantize(ex), packed.dequantize(ps[e]))
    both = m.weight("down").rows(N, 3 * N)
    assert torch.equal(packed.dequantize(both), torch.cat([packed.dequantize(ps[1]), packed.dequantize(ps[2])]))


def _stacked(fmt: str, E: int, N: int, K: int):
    import numpy as np
    from test_kernels_ref import random_blocks

    from dsq.kernels import packed

    if fmt == "fp8-block":
        return packed.Packed.cat([packed.from_fp8((torch.randn(N, K) * 3).to(torch.float8_e4m3fn),
                                                  torch.rand(N // 128, K // 128) + 0.01) for _ in range(E)])
    rng = np.random.default_rng()
    return packed.from_gguf(torch.from_numpy(random_blocks(fmt, E * N, K, rng)), fmt, K)


@pytest.mark.skipif(CUDA, reason="the CPU stand-in (the interpreter); the CUDA test below runs the GPU's")
@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no grouped GEMM (the loop runs instead)")
@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q8_0", "Q5_K", "fp8-block"])
def test_grouped_gemm_runs_each_expert_once_over_its_rows(fmt):
    """dispatch.grouped_gemm (a prompt chunk's pairs sorted by expert): each row through its own
    expert's weight, equal to that expert's reference GEMM; only the chosen experts are written out,
    a slab of at most slab_bytes at a time (here two experts, so four runs, empty experts at a slab's
    ends left out) and the grouped GEMM skips an empty expert inside one."""
    from dsq.kernels import dispatch, packed, triton_dequant

    E, N, K = 7, 128, 256
    p = _stacked(fmt, E, N, K)
    counts = [0, 3, 0, 5, 1, 0, 4]
    x = torch.randn(sum(counts), K)
    written: list = []

    def dequantize(q, dtype, out):
        written.append(q.N)
        return triton_dequant.dequantize(q, dtype, out=out)

    got = dispatch.grouped_gemm(x, p, counts, E, slab_bytes=2 * N * K * 4 + 1, dequantize=dequantize)
    assert written == [N, 2 * N, N], written  # experts 1, 3-4, 6: never 0, 2 or 5
    r = 0
    for e, c in enumerate(counts):
        if c:
            want = packed.linear_ref(x[r:r + c], p.rows(e * N, (e + 1) * N))
            torch.testing.assert_close(got[r:r + c], want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        r += c
    # one slab over an empty expert in its middle: the grouped GEMM's empty group
    written.clear()
    got = dispatch.grouped_gemm(x, p, counts, E, slab_bytes=E * N * K * 4, dequantize=dequantize)
    assert written == [6 * N]
    loop = dispatch.grouped_experts(x, p, counts, E)  # off a GPU: one packed_linear per chosen expert
    torch.testing.assert_close(got, loop, rtol=1e-5, atol=1e-5 * float(loop.abs().max()))


@pytest.mark.skipif(CUDA, reason="the CPU stand-in (the interpreter); the CUDA test above runs the GPU's")
@pytest.mark.parametrize("fmt", ["Q4_K", "Q4_0", "Q6_K", "Q8_0", "Q5_K", "fp8-block"])
def test_fused_grouped_kernels_run_each_expert_over_its_rows(fmt):
    """The fused grouped launches (MOE_FUSED: no weight written out): each row of x through its own
    expert's weight, one launch for every expert and row tile. 4-bit codes go through the tensor-core
    kernel (triton_mma.grouped_mma_scaled: weights and x rounded to bf16, so within bf16's error of
    the reference); every format through the tl.dot one (triton_gemm.grouped_linear: float32 dots on
    the interpreter, so within 1e-5). Empty experts first, inside and last; an expert longer than a
    tile (several tiles, the last one short)."""
    from dsq.kernels import packed, triton_gemm, triton_mma

    E, N, K = 7, 128, 256
    p = _stacked(fmt, E, N, K)
    counts = [0, 3, 0, 70, 1, 0, 4]
    x = torch.randn(sum(counts), K)
    assert triton_mma.grouped_tiles(counts, 64) == [(1, 0, 3), (3, 3, 64), (3, 67, 6), (4, 73, 1), (6, 74, 4)]
    paths = [("tl.dot", triton_gemm.grouped_linear(x, p, counts, E, config={"BN": 32, "BK": 64, "BM": 16}), 1e-5)]
    if fmt in ("Q4_K", "Q4_0"):
        assert triton_mma.supported_scaled(p, 1)
        paths.append(("tensor cores", triton_mma.grouped_mma_scaled(x, p, counts, E, config={"BN": 32}), 1e-2))
    else:
        assert not triton_mma.supported_scaled(p, 1)
    # the counts left on the device (a prompt chunk with no host sync): the tiles made there, padded with
    # tiles of no rows up to rows // BM + experts, and the same outputs
    dev = torch.tensor(counts)
    table, n = triton_mma.grouped_tile_table(dev, 16, sum(counts), x.device)
    real = triton_mma.grouped_tiles(counts, 16)
    assert n == sum(counts) // 16 + E and table.shape == (n, 3)
    assert table[:len(real)].tolist() == [list(t) for t in real] and not table[len(real):, 2].any()
    on_dev = triton_gemm.grouped_linear(x, p, dev, E, config={"BN": 32, "BK": 64, "BM": 16})
    assert torch.equal(on_dev, paths[0][1])
    if len(paths) == 2:
        torch.testing.assert_close(triton_mma.grouped_mma_scaled(x, p, dev, E, config={"BN": 32}), paths[1][1],
                                   rtol=1e-5, atol=1e-5 * float(paths[1][1].abs().max()))
    for name, got, tol in paths:
        assert got.shape == (sum(counts), N) and torch.isfinite(got).all(), name
        r = 0
        for e, c in enumerate(counts):
            if c:
                xe = x[r:r + c].to(torch.bfloat16).double() if tol > 1e-5 else x[r:r + c].double()
                want = xe @ packed.dequantize(p.rows(e * N, (e + 1) * N)).double().t()
                err = float((got[r:r + c].double() - want).norm() / want.norm())
                assert err < tol, (name, e, err)
            r += c


def test_fused_grouped_kernels_refuse_what_they_cannot_split():
    """A stack whose rows are no whole number of experts, or counts that do not add up to x's rows:
    a ValueError (the dispatcher checks first and never sends them), not a wrong answer."""
    from dsq.kernels import triton_gemm, triton_mma

    p = _stacked("Q4_K", 3, 64, 256)
    x = torch.randn(5, 256)
    for fn in (triton_gemm.grouped_linear, triton_mma.grouped_mma_scaled):
        with pytest.raises(ValueError):
            fn(x, p, [2, 2, 0], 3)  # 4 rows counted, 5 given
        with pytest.raises(ValueError):
            fn(x, p, [1, 1, 1, 1, 1], 5)  # 192 rows are not five experts
