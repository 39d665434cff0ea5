"""The native engine's compiled CPU decode step (NativeModel(compile=True) without a GPU): the
same greedy tokens as the eager step, logits within float rounding, one graph for every cache
position, and a graph of its own per model (its module guards are skipped)."""

from __future__ import annotations

import pytest
import torch

from dsq.kernels import cpu

IDS = [5, 17, 99, 250, 31, 7, 400, 12, 3, 77] * 3

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path (a GPU takes the CUDA graph path)")


def _decode_logits(m, ids, steps):
    """Greedy tokens of a stream, and the logits of `steps` further decode steps after a prefill."""
    from dsq.runtime.generate import GenStats
    from dsq.runtime.sampling import SamplingParams

    m.reset()
    st = GenStats()
    list(m.stream(ids, SamplingParams(temperature=0), 12, st, ignore_eos=True))
    with torch.inference_mode():
        pad = torch.zeros(1, dtype=torch.long)
        logits = [m._prefill(ids, 0, m.cache, pad)]
        tok = logits[0].argmax(-1)
        for i in range(steps):
            logits.append(m._decode(tok, len(ids) + i, m.cache, pad))
            tok = logits[-1].argmax(-1)
    m.reset()
    return st.token_ids, torch.cat(logits)


@pytest.mark.skipif(not cpu.available(), reason="no CPU kernels built")
def test_compiled_cpu_decode_equals_eager(tiny_gguf, monkeypatch):
    """Grouped-query attention (llama: 2 query heads per KV head; gemma3: 4, sliding windows),
    and two quantized models of the same architecture and shapes compiled in one process: each
    must run its own graph (its kernels' formats are constants in it). With the float row dots:
    the integer ones round x per 32 values, so inductor's own float rounding upstream can move an
    x across a rounding step (up to 2^-16 of its block's largest |x| on the avx2 build) and the
    logits by more than compiling itself changes them."""
    from dsq.runtime.native import NativeModel

    monkeypatch.setenv("DSQ_NO_VNNI", "1")
    monkeypatch.setenv("DSQ_FUSED_LAYER", "0")  # else every layer is one C call and nothing compiles

    for kind, qtype in (("llama", "Q4_K_M"), ("gemma3", "Q4_K_M"), ("gemma3", "Q8_0")):
        path = tiny_gguf(kind, qtype)
        eager = NativeModel(path, "gguf", n_ctx=64, dtype="fp32")
        compiled = NativeModel(path, "gguf", n_ctx=64, dtype="fp32", compile=True)
        assert compiled._compiled is not None and eager._compiled is None
        want_ids, want = _decode_logits(eager, IDS, 8)
        got_ids, got = _decode_logits(compiled, IDS, 8)
        assert got_ids == want_ids
        assert (got - want).abs().max() < 1e-4


@pytest.mark.skipif(not cpu.available(), reason="no CPU kernels built")
def test_compile_keeps_the_one_call_layers(tiny_gguf):
    """Where every layer decodes as one C call, --compile says so and keeps that step (it decodes
    faster than inductor's: docs/benchmarks.md#cpu-decode); the output is the default's."""
    from dsq.runtime.native import NativeModel

    path = tiny_gguf("llama", "Q4_K_M")
    with pytest.warns(UserWarning, match="one C call"):
        m = NativeModel(path, "gguf", n_ctx=64, dtype="fp32", compile=True)
    assert m._compiled is None and m.fused_layers == len(m.model.model.layers)
    plain = NativeModel(path, "gguf", n_ctx=64, dtype="fp32")
    assert _decode_logits(m, IDS, 4)[0] == _decode_logits(plain, IDS, 4)[0]


def test_compile_failure_keeps_the_eager_step(tiny_dir, monkeypatch):
    from dsq.runtime import native

    def fail(*a, **k):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(native, "_CompiledStep", fail)
    with pytest.warns(UserWarning, match="decoding eagerly"):
        m = native.NativeModel(tiny_dir("llama"), "hf", n_ctx=64, dtype="fp32", compile=True)
    assert m._compiled is None
    assert len(_decode_logits(m, IDS[:10], 2)[0]) == 12

