"""The native torch engine against transformers (tiny random configs, fp32) and llama.cpp
(the built-in model): logits with and without the KV cache, batches, GGUF weights, sampling,
prefix reuse, and its bad inputs."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from dsq.cli import app
from tiny import corpus, hf_logits, kld_top1, same_greedy_over_chunk_starts, stand_in_graphs

KINDS = ["llama", "qwen2", "gemma3"]
IDS = [5, 17, 99, 250, 31, 7, 400, 12, 3, 77] * 8  # 80 tokens: longer than gemma3's window of 16


@pytest.fixture(scope="module")
def native(tiny_dir):
    from dsq.runtime.native import NativeModel

    cache = {}

    def get(kind, fmt="hf", tiny_gguf=None):
        key = (kind, fmt)
        if key not in cache:
            path, k = (tiny_dir(kind), "hf") if fmt == "hf" else (tiny_gguf(kind, fmt), "gguf")
            cache[key] = NativeModel(path, k, n_ctx=256, dtype="fp32")
        return cache[key]

    return get


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(kind, native, tiny_dir):
    ref = hf_logits(tiny_dir(kind), IDS)
    m = native(kind)
    assert np.abs(m.logits(IDS) - ref).max() < 1e-4
    # with the KV cache: a prefill, then one token at a time
    with torch.inference_mode():
        cache = m.model.make_cache(1, 128, torch.float32)
        outs = [m.model(torch.tensor([IDS[:37]]), torch.arange(37), cache, kv_len=37)[0]]
        for i in range(37, len(IDS)):
            outs.append(m.model(torch.tensor([[IDS[i]]]), torch.tensor([i]), cache, kv_len=i + 1)[0])
    assert np.abs(torch.cat(outs).numpy() - ref).max() < 1e-4


@pytest.mark.parametrize("kind", KINDS + ["deepseek_v2", "deepseek_v3"])
def test_batch_with_padding_matches_single_sequences(kind, native, tiny_dir):
    """Left-padded rows prefilled together, then one decode step each: each row's logits are its
    sequence's alone (DeepSeek: through its latent cache, the step on the absorbed path)."""
    from dsq.runtime.native import _left_padded

    m = native(kind)
    seqs = [IDS[:50], IDS[3:30], IDS[10:61]]
    longest = max(map(len, seqs))
    ids, pad = _left_padded(seqs, longest)
    with torch.inference_mode():
        cache = m.model.make_cache(3, longest + 1, torch.float32)
        out = m.model(ids, torch.arange(longest), cache, pad, kv_len=longest)
        step = m.model(torch.tensor([[7], [8], [9]]), torch.tensor([longest]), cache, pad, kv_len=longest + 1)
    for i, s in enumerate(seqs):
        ref = hf_logits(tiny_dir(kind), s + [7 + i])
        assert np.abs(out[i, longest - len(s):].numpy() - ref[:-1]).max() < 1e-4
        assert np.abs(step[i, 0].numpy() - ref[-1]).max() < 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_weights_same_as_hf(kind, native, tiny_gguf, tiny_dir):
    ref = hf_logits(tiny_dir(kind), IDS)
    assert np.abs(native(kind, "F32", tiny_gguf).logits(IDS) - ref).max() < 1e-4


@pytest.mark.parametrize("kind,qtype", [("llama", "Q4_K_M"), ("qwen2", "Q8_0"), ("gemma3", "Q4_K_M")])
def test_quantized_gguf_equals_transformers_on_dequantized_weights(kind, qtype, native, tiny_gguf, tmp_path):
    """Quant blocks stay in memory; the reference path must equal the dequantized float model."""
    from dsq.convert.gguf_to_hf import gguf_to_hf

    path = tiny_gguf(kind, qtype)
    m = native(kind, qtype, tiny_gguf)
    assert any(type(mod).__name__ == "GGUFLinear" for mod in m.model.modules())
    gguf_to_hf(path, tmp_path / "deq", dtype="float32", progress=lambda *a: None)
    assert np.abs(m.logits(IDS) - hf_logits(tmp_path / "deq", IDS)).max() < 1e-4


def test_greedy_generation_matches_transformers(native, tiny_dir):
    from transformers import AutoModelForCausalLM

    from dsq.runtime.sampling import SamplingParams

    from dsq.runtime.generate import GenStats

    m = native("qwen2")
    m.reset()
    st = GenStats()
    list(m.stream(IDS[:20], SamplingParams(temperature=0), 24, st, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir("qwen2"), dtype=torch.float32)
    ref = hf.generate(torch.tensor([IDS[:20]]), max_new_tokens=24, do_sample=False, min_new_tokens=24)
    assert st.token_ids == ref[0, 20:].tolist()


def test_prefix_cache_reuses_and_stays_exact(native):
    from dsq.runtime.generate import GenStats
    from dsq.runtime.sampling import SamplingParams

    m = native("llama")
    greedy = SamplingParams(temperature=0)
    m.reset()
    a = GenStats()
    list(m.stream(IDS[:40], greedy, 6, a, ignore_eos=True))
    assert m.last_prefill_tokens == 40
    turn2 = IDS[:40] + a.token_ids + IDS[40:50]
    b = GenStats()
    list(m.stream(turn2, greedy, 6, b, ignore_eos=True))
    assert m.last_prefill_tokens <= 11  # only what is new (plus the last reused token at most)
    m.reset()
    c = GenStats()
    list(m.stream(turn2, greedy, 6, c, ignore_eos=True))
    assert m.last_prefill_tokens == len(turn2)
    assert b.token_ids == c.token_ids  # reuse gives exactly what a fresh prefill gives


@pytest.mark.parametrize("kind", ["gemma3", "deepseek_v3"])
def test_batch_generation_equals_single(kind, native):
    from dsq.runtime.generate import GenStats
    from dsq.runtime.sampling import SamplingParams

    m = native(kind)
    prompts = [IDS[:30], IDS[5:12], IDS[20:61]]
    greedy = SamplingParams(temperature=0)
    st = GenStats()
    batch = m.generate_batch(prompts, greedy, 10, ignore_eos=True, stats=st)
    # rates count every sequence: 10 steps of 3 tokens, the first step's with the prefill
    assert (st.steps, st.sampled_tokens, st.generated_tokens, st.prompt_tokens) == (10, 30, 30, 30 + 7 + 41)
    assert st.decode_tok_s == pytest.approx(27 / st.decode_s) and st.tpot_ms == pytest.approx(1000 * st.decode_s / 9)
    for p, got in zip(prompts, batch):
        m.reset()
        st = GenStats()
        list(m.stream(p, greedy, 10, st, ignore_eos=True))
        assert got == st.token_ids


def test_cache_claims_only_the_tokens_run(native):
    """`cached` holds the prompt and every generated token whose step ran: the last token of a
    reply was never run through the model, whether the budget or the consumer ended it."""
    from dsq.runtime.generate import GenStats
    from dsq.runtime.sampling import SamplingParams

    m = native("llama")
    m.reset()
    st = GenStats()
    list(m.stream(IDS[:20], SamplingParams(temperature=0), 6, st, ignore_eos=True))
    assert m.cached == IDS[:20] + st.token_ids[:-1]
    events = m.stream(IDS[:20], SamplingParams(temperature=0), 6, GenStats(), ignore_eos=True)
    first = next(events).token_id
    events.close()
    assert m.cached == IDS[:20] and first == st.token_ids[0]


def test_batch_of_one_with_repeat_penalty_equals_stream(native):
    """One decode loop: a batch of one long prompt samples as the stream does (repeat penalty and
    seeded draws included)."""
    from dsq.runtime.generate import GenStats
    from dsq.runtime.sampling import SamplingParams

    m = native("qwen2")
    sp = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, repeat_penalty=1.3, seed=5)
    m.reset()
    st = GenStats()
    list(m.stream(IDS, sp, 12, st, ignore_eos=True))
    assert m.generate_batch([IDS], sp, 12, ignore_eos=True) == [st.token_ids]


def test_sampler():
    from dsq.runtime.sampling import Sampler, SamplingParams

    logits = torch.randn(4, 1000)
    assert torch.equal(Sampler(SamplingParams(temperature=0))(logits), logits.argmax(-1))
    assert torch.equal(Sampler(SamplingParams(temperature=1.0, top_k=1))(logits), logits.argmax(-1))
    assert torch.equal(Sampler(SamplingParams(temperature=1.0, top_p=1e-6))(logits), logits.argmax(-1))
    a = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=3))
    b = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=3))
    draws_a = torch.stack([a(logits) for _ in range(20)])
    assert torch.equal(draws_a, torch.stack([b(logits) for _ in range(20)]))
    assert len(set(draws_a[:, 0].tolist())) > 1  # it samples
    top5 = set(logits[0].topk(5).indices.tolist())
    s = Sampler(SamplingParams(temperature=5.0, top_k=5, top_p=1.0, seed=1))
    assert {int(s(logits[:1])[0]) for _ in range(50)} <= top5
    # repetition penalty: a recent token's logit shrinks toward zero
    pos = torch.tensor([[3.0, 1.0, 2.5]])
    pen = Sampler(SamplingParams(temperature=0, repeat_penalty=2.0))
    assert int(pen(pos, torch.tensor([[0]]))) == 2


@pytest.mark.parametrize("top_k,top_p,min_p", [(40, 0.9, 0.0), (0, 0.8, 0.0), (30, 1.0, 0.05), (0, 1.0, 0.0)])
def test_sampler_draws_from_the_filtered_distribution(top_k, top_p, min_p):
    """The sampler filters only the top-k prefix and maps its draw back: the frequencies of many
    draws match the distribution written out over the whole vocabulary (llama.cpp's order: top-k,
    top-p, min-p, temperature), within sampling noise."""
    from dsq.runtime.sampling import Sampler, SamplingParams

    torch.manual_seed(0)
    V, T, n = 1000, 0.7, 40000
    row = torch.randn(V) * 2
    want = row.clone()
    if top_k:
        want[want < want.topk(top_k).values[-1]] = float("-inf")
    order = want.argsort(descending=True)
    p = want[order].softmax(-1)
    drop = torch.zeros(V, dtype=torch.bool)
    drop[order] = p.cumsum(-1) - p > top_p
    want[drop] = float("-inf")
    if min_p:
        q = want.softmax(-1)
        want[q < min_p * q.max()] = float("-inf")
    want = (want / T).softmax(-1)
    s = Sampler(SamplingParams(temperature=T, top_k=top_k, top_p=top_p, min_p=min_p, seed=2))
    got = torch.bincount(s(row.expand(n, V).contiguous()), minlength=V).double() / n
    assert got[want == 0].sum() == 0  # nothing filtered out is ever drawn
    assert 0.5 * (got - want.double()).abs().sum() < 0.03  # total variation


# -- the built-in model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def builtin_native(builtin_gguf):
    from dsq.runtime.native import NativeModel

    return NativeModel(builtin_gguf, "gguf", n_ctx=512, dtype="fp32")


@pytest.fixture(scope="module")
def builtin_f32(builtin_gguf, tmp_path_factory):
    """The built-in Q4_K_M dequantized exactly to float32: as HF, and as an F32 GGUF."""
    from dsq.convert.gguf_to_hf import gguf_to_hf
    from dsq.convert.hf_to_gguf import hf_to_gguf

    d = tmp_path_factory.mktemp("builtin-f32")
    hf = gguf_to_hf(builtin_gguf, d / "hf", dtype="float32", progress=lambda *a: None)
    return hf, hf_to_gguf(hf, d / "f32.gguf", "F32")


def test_builtin_against_llama_cpp(builtin_native, builtin_gguf, builtin_f32):
    from dsq.runtime.llama_cpp_backend import LlamaCppModel

    ids = builtin_native.tokenize(corpus()[100_000:104_000])[:256]
    ours = builtin_native.logits(ids)
    same_weights = LlamaCppModel(builtin_f32[1], logits_all=True, n_ctx=512, f32_kv=True).logits(ids)
    kld, top1, _ = kld_top1(same_weights, ours)
    print(f"native vs llama.cpp, same (dequantized F32) weights: KLD {kld:.2e}, top-1 {top1:.4f}")
    assert top1 >= 0.98 and kld < 1e-4
    q = LlamaCppModel(builtin_gguf, logits_all=True, n_ctx=512, f32_kv=True).logits(ids)
    kld_q, top1_q, _ = kld_top1(q, ours)
    # llama.cpp's Q4_K_M path also rounds activations to 8 bits: it differs from both float paths
    print(f"native vs llama.cpp Q4_K_M path (8-bit activations): KLD {kld_q:.4f}, top-1 {top1_q:.4f}")
    assert top1_q >= 0.92 and kld_q < 0.02


def test_builtin_greedy_64_equals_transformers(builtin_native, builtin_f32, monkeypatch):
    """The float model's greedy path (DSQ_NO_VNNI=1: x stays in float, or 24 bits, in prefill and
    decode on every build) gives transformers' 64 tokens. The default path of the avx2 build rounds
    x to int8 as llama.cpp does, and a greedy continuation then splits at a near-tie (token 29
    here): it is scored teacher-forced instead (test_builtin_model.py
    test_generation_path_teacher_forced)."""
    from transformers import AutoModelForCausalLM

    from dsq.runtime.engine import generate

    monkeypatch.setenv("DSQ_NO_VNNI", "1")
    builtin_native.reset()
    ours = generate(builtin_native, "The history of the Roman Empire", max_tokens=64, temperature=0,
                    ignore_eos=True).token_ids
    ids = builtin_native.tokenize("The history of the Roman Empire")
    hf = AutoModelForCausalLM.from_pretrained(builtin_f32[0], dtype=torch.float32)
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
    assert ours == ref[0, len(ids):].tolist()


# -- the backend contract ----------------------------------------------------------------------
def test_both_backends_keep_the_contract(tiny_gguf, tiny_dir):
    """NativeModel and LlamaCppModel are Backends; load() hands each the ModelRef it resolved."""
    from pathlib import Path

    from dsq.runtime.backend import Backend, BatchBackend
    from dsq.runtime.engine import load
    from dsq.runtime.gpu_layers import GpuLayers
    from dsq.runtime.model_ref import ModelRef
    from dsq.runtime.native import NativeModel

    path = tiny_gguf("qwen2", "F16")
    native, cpp = (load(str(path), backend=b, ctx=64, gpu_layers="0") for b in ("native", "llama.cpp"))
    for m in (native, cpp):
        assert isinstance(m, Backend)
        assert m.ref == ModelRef("gguf", path) and m.gpu_layers == GpuLayers.NONE
    assert isinstance(native, BatchBackend) and not isinstance(cpp, BatchBackend)
    hf = load(str(tiny_dir("llama")), backend="llama.cpp", ctx=64)  # runs a converted GGUF
    assert hf.ref == ModelRef("hf", tiny_dir("llama")) and hf.path.suffix == ".gguf"
    wrapped = NativeModel.from_model(native.model, native.config, native.tokenizer, n_ctx=64, fuse=False)
    assert isinstance(wrapped, BatchBackend) and wrapped.ref.path == Path("<memory>")


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without CUDA does")
def test_native_gpu_layers_without_cuda(tiny_dir):
    """--gpu-layers all without CUDA: everything on the CPU, 0 layers reported, 'all' kept as typed."""
    from dsq.runtime.engine import load

    m = load(str(tiny_dir("llama")), backend="native", ctx=64, gpu_layers="all")
    assert m.gpu_layers.n_gpu_layers == 0 and str(m.gpu_layers) == "all"
    assert {str(d) for d in m.model.layer_devices()} == {"cpu"} and m.dtype == torch.float32


# -- CLI and bad inputs ------------------------------------------------------------------------
def test_cli_native_run_chat_bench(runner, tiny_dir, tiny_gguf, tmp_path):
    r = runner.invoke(app, ["run", str(tiny_dir("llama")), "--backend", "native", "-p", "Classes", "-n", "6",
                            "-t", "0", "--json", "--ignore-eos"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["backend"] == "native" and len(out["token_ids"]) == 6
    r = runner.invoke(app, ["chat", str(tiny_dir("qwen2")), "-b", "native", "-n", "4"], input="hi\n/reset\nyo\n")
    assert r.exit_code == 0, r.output
    assert "native" in r.stderr
    jp = tmp_path / "b.json"
    r = runner.invoke(app, ["bench", str(tiny_gguf("qwen2", "Q8_0")), "--backend", "native,llama.cpp",
                            "--prompt-tokens", "32", "--max-tokens", "4", "--repeat", "1", "--out", str(jp)])
    assert r.exit_code == 0, r.output
    assert [x["backend"] for x in json.loads(jp.read_text())["runs"]] == ["native", "llama.cpp"]


def _one_line(r, needle):
    assert r.exit_code == 1, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.stderr


def test_config_missing_a_field(runner, tiny_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_dir("llama"), d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    _one_line(runner.invoke(app, ["run", str(d), "-b", "native", "-p", "x"]), "hidden_size")


def test_gguf_with_a_tensor_of_the_wrong_size(runner, tiny_gguf, tmp_path):
    """A GGUF whose attn_q is smaller than its metadata says."""
    import gguf

    from dsq.formats.gguf_file import GGUFFile

    src = GGUFFile(tiny_gguf("qwen2", "F32"))
    out = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(out), "qwen2")
    reader = gguf.GGUFReader(src.path)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        val = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, val, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, val, vtype)
    for t in src.tensors:
        data = src.dequantize(t.name)
        if t.name == "blk.0.attn_q.weight":
            data = data[:-8]
        w.add_tensor(t.name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _one_line(runner.invoke(app, ["run", str(out), "-b", "native", "-p", "x"]), "attn_q")


def test_prompt_longer_than_context_native(runner, tiny_dir):
    _one_line(runner.invoke(app, ["run", str(tiny_dir("llama")), "-b", "native", "--ctx", "32", "-p", "word " * 100]),
              "context")


def test_chat_bench_shows_flat_prefill(runner, tiny_gguf, tmp_path):
    jp = tmp_path / "chat.json"
    r = runner.invoke(app, ["bench", str(tiny_gguf("qwen2", "F16")), "--chat-turns", "4", "--max-tokens", "4",
                            "-b", "native,llama.cpp", "--out", str(jp)])
    assert r.exit_code == 0, r.output
    turns = json.loads(jp.read_text())["turns"]
    native = [t for t in turns if t["backend"] == "native"]
    assert [t["turn"] for t in native] == [1, 2, 3, 4]
    assert native[-1]["history_tokens"] > 3 * native[0]["history_tokens"] / 2
    # each later turn prefills only its new message, not the history
    assert all(t["prefilled_tokens"] < native[0]["history_tokens"] + 16 for t in native[1:])


def test_native_only_flags_refused_for_llama_cpp(runner, tiny_gguf):
    _one_line(runner.invoke(app, ["run", str(tiny_gguf("qwen2", "F16")), "-p", "x", "--compile"]), "--compile")


def test_layers_run_in_segments_as_in_one_pass(tiny_dir):
    """A split model runs its layers in two segments (the CPU's, then the GPU's) around one cache:
    embed, forward_layers over each segment and head give the one-pass forward's logits, and a KV
    cache can hold each layer in its own dtype."""
    from dsq.models.base import KVCache
    from dsq.runtime.native import NativeModel

    m = NativeModel(tiny_dir("llama"), "hf", n_ctx=64)
    model = m.model
    ids = torch.tensor([[5, 17, 99, 250, 31, 7]])
    slots = torch.arange(ids.shape[1])
    with torch.inference_mode():
        want = model(ids, slots, model.make_cache(1, 16, torch.float32), kv_len=ids.shape[1])
        cache = model.make_cache(1, 16, torch.float32)
        x = model.embed(ids)
        x = model.forward_layers(x, 0, 1, slots, cache, kv_len=ids.shape[1])
        x = model.forward_layers(x, 1, 2, slots, cache, kv_len=ids.shape[1])
        got = model.head(x)
    assert torch.equal(got, want)
    mixed = KVCache(model.args, 1, 16, [torch.float32, torch.bfloat16], model.layer_devices())
    k = torch.randn(1, model.args.num_key_value_heads, 2, model.args.head_dim)
    kc, _ = mixed.update(1, k, k, torch.tensor([3, 4]))
    assert kc.dtype == torch.bfloat16 and torch.equal(kc[:, :, 3:5], k.to(torch.bfloat16))
    assert mixed.k[0].dtype == torch.float32


def test_a_prompt_through_every_layer_streamed_meets_the_head_where_its_norm_is(tiny_dir, monkeypatch):
    """A model with every layer on the CPU streams a long prompt's layers through the GPU
    (StreamedLayers), which leaves the hidden state there; the placement has it on the last layer's
    device, the CPU. _streamed_prefill hands the last position to the final norm's device itself (a
    head in RAM read a GPU tensor before: 'two devices'). On the CPU, with a stand-in for the
    streamed layers: the hand-off goes to the norm's device, and the logits are the eager pass's."""
    from dsq.runtime import native
    from dsq.runtime.native import NativeModel

    m = NativeModel(tiny_dir("llama"), "hf", n_ctx=64)
    model = m.model
    n = len(model.model.layers)

    class Streamed:  # runs the layers where they are, as StreamedLayers runs them on the GPU
        def __init__(self):
            self.n = n

        def run(self, x, slots, cache, pad, kv_len):
            return model.forward_layers(x, 0, n, slots, cache, pad, kv_len)

    handed = []
    real = native.cross_device
    monkeypatch.setattr(native, "cross_device", lambda x, dev, dt=None: handed.append((x.shape, dev)) or real(x, dev, dt))
    m._streamed = Streamed()
    ids = torch.tensor([[5, 17, 99, 250, 31, 7, 8, 9]])
    slots = torch.arange(ids.shape[1])
    with torch.inference_mode():
        want = model(ids, slots, model.make_cache(1, 16, torch.float32), kv_len=ids.shape[1], last_only=True)
        got = m._streamed_prefill(ids, slots, model.make_cache(1, 16, torch.float32), torch.zeros(1, dtype=torch.long),
                                  ids.shape[1])
    assert handed == [((1, 1, model.args.hidden_size), model.placement.norm)]
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("kind, qtype", [("llama", "Q4_K_M"), ("gemma3", "F32")])
def test_prefill_graph_spans_equal_eager_chunks_on_the_cpu(kind, qtype, tiny_gguf, monkeypatch):
    """The prompt graphs' bookkeeping, with a stand-in for CUDA's capture whose replay runs the
    captured call again on the static buffers: chunks copied in, slots at their positions, each
    chunk attending over its span's keys (PREFILL_CHUNK times a power of two, masked by slot), the
    output copied out before the next replay. Greedy tokens and prompt logits equal the eager
    chunks' for a prompt of several chunks, the same prompt again (replays) and one that shares a
    prefix, so its chunks start at other slots. The capture itself runs on the GPU test
    (test_native_cuda.py::test_prefill_graphs_equal_eager_chunks)."""
    from dsq.runtime import native

    stand_in_graphs(monkeypatch)
    monkeypatch.setattr(native, "PREFILL_CHUNK", 16)  # chunks of 16 tokens: spans 16, 32, 64, 128
    path = tiny_gguf(kind, qtype)
    graphs = native.NativeModel(path, "gguf", n_ctx=128, threads=1)
    eager = native.NativeModel(path, "gguf", n_ctx=128, threads=1)
    graphs._prefill_graphs = native._PrefillGraphs(graphs.model, graphs.cache, torch.device("cpu"))
    assert eager._prefill_graphs is None
    prompt = (IDS * 2)[:90]
    same_greedy_over_chunk_starts(graphs, eager, prompt)
    pg = graphs._prefill_graphs
    assert set(pg.graphs) == {16, 32, 64, 128} and not pg.failed
    assert sum(g.replays for g, _ in pg.graphs.values()) >= 5  # the repeated prompt's chunks replayed
    with torch.inference_mode():
        for m in (graphs, eager):
            m.reset()
        a = graphs._prefill(prompt, 0, graphs.cache, torch.zeros(1, dtype=torch.long)).float()
        b = eager._prefill(prompt, 0, eager.cache, torch.zeros(1, dtype=torch.long)).float()
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())
