"""dsq serve on DeepSeek V2/V3 (MLA + MoE), tiny random models: the paged latent cache's forward
against the model's own full-sequence forward (absorbed and plain attention, several sequences at
their own positions), its sizing, FP8 latent rows, the engine loop against `dsq.generate`
(batching, preemption, prefix caching), and a server on 127.0.0.1 through the official `openai`
client against `dsq run` (a Q8_0 GGUF, routed experts in RAM: --experts cpu, as CPU CI has it).

Every wait is bounded."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from dsq.serve.paged import FP8, PagedKV
from serve_util import _env, _get, _start, int8_x_build
from test_serve_engine import _run_engine

ROOT = Path(__file__).resolve().parents[1]
KINDS = ["deepseek_v2", "deepseek_v3"]
PROMPTS = ["The history of the Roman Empire", "Why is the sky blue?", "def fibonacci(n):",
           "Once upon a time, in a land far away", "one two three four five six seven one two three four five"]
N_TOKENS = 12
CTX = 256


@pytest.fixture(autouse=True)
def _float_x(monkeypatch):
    if int8_x_build():
        monkeypatch.setenv("DSQ_NO_VNNI", "1")


def _set_absorb(model, absorb):
    from dsq.models.deepseek_model import MLAttention

    for m in model.modules():
        if isinstance(m, MLAttention):
            m.absorb = absorb


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    from dsq.runtime.native import NativeModel

    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = NativeModel(tiny_dir(kind), "hf", n_ctx=CTX, dtype="fp32", cuda_graph=False)
        return cache[kind]

    return get


def _check_paged_forward(model, absorb, tol, captured: bool = False):
    """Three sequences prefilled in two chunks each, then decoded together at their own positions,
    their latent rows in blocks scattered over the pool: every position's logits are the full
    forward's (padded rows of the shorter sequences masked). captured: the decode steps and chunks
    replay captured graphs (a graph of 4 rows, chunks of 8 and 32 tokens over the whole context)."""
    a = model.args
    kv = PagedKV(model, 64, 4, CTX)
    assert kv.k[0].shape == (64, 1, 4, a.kv_lora_rank + a.qk_rope_head_dim) and kv.v[0].numel() == 0
    g = torch.Generator().manual_seed(1)
    order = list(range(64))
    random.Random(1).shuffle(order)
    if captured:
        kv.scratch = order.pop()
        assert kv.capture([4]) == [4] and [t for t, _ in kv.capture_chunks([8, 32])] == [8, 32]
    seqs = []
    for n in (3, 17, 45):
        ids = torch.randint(0, a.vocab_size, (n + 6,), generator=g).tolist()
        seqs.append({"ids": ids, "table": [order.pop() for _ in range(-(-(n + 6) // 4))], "n": n})
    _set_absorb(model, absorb)
    try:
        for s in seqs:
            h = s["n"] // 2 or 1
            kv.forward([s["ids"][:h]], [0], [s["table"]])
            s["logits"] = [kv.forward([s["ids"][h:s["n"]]], [h], [s["table"]])[0]]
        for step in range(6):
            out = kv.forward([[s["ids"][s["n"] + step]] for s in seqs], [s["n"] + step for s in seqs],
                             [s["table"] for s in seqs])
            for s, lg in zip(seqs, out):
                s["logits"].append(lg)
        with torch.inference_mode():
            for s in seqs:
                full = model(torch.tensor([s["ids"]]))[0].float()
                for j, lg in enumerate(s["logits"]):
                    ref = full[s["n"] - 1 + j]
                    assert (lg.float() - ref).abs().max() <= tol * ref.abs().max(), (s["n"], j)
    finally:
        _set_absorb(model, None)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("absorb", [None, True, False])
def test_paged_latent_forward_matches_the_full_sequence(kind, absorb, hf_model):
    _check_paged_forward(hf_model(kind).model, absorb, 1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_captured_latent_steps_match_the_full_sequence(kind, hf_model, monkeypatch):
    """dsq serve's captured decode steps and prompt chunks (the CPU standing in for the GPU's
    graphs) over the latent cache: the longest context's span, padding rows and tokens in the
    scratch block, and still the full forward's logits."""
    from tests.tiny import stand_in_graphs

    stand_in_graphs(monkeypatch)
    _check_paged_forward(hf_model(kind).model, None, 1e-4, captured=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("experts", ["gpu", "cpu"])
def test_paged_latent_forward_on_a_gpu(kind, experts, tiny_gguf, monkeypatch):
    """The same on a GPU (--gpu-layers all), fp32, the routed experts with their layers or in RAM
    (queued from the stream in decode, sent and received for prompt chunks). x stays in float:
    a GPU rounds it to int8 for 1-4 rows (dispatch.ACT_Q8) and not for the full forward's 51,
    which moves a logit by a few percent and, through a random router, flips experts."""
    from dsq.kernels import dispatch
    from dsq.runtime.native import NativeModel

    monkeypatch.setattr(dispatch, "ACT_Q8", False)

    nm = NativeModel(tiny_gguf(kind, "Q8_0"), "gguf", n_ctx=CTX, dtype="fp32", gpu_layers="all", experts=experts,
                     cuda_graph=False)
    assert nm.experts == experts and {d.type for d in nm.model.layer_devices()} == {"cuda"}
    _check_paged_forward(nm.model, None, 1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kind", KINDS)
def test_moe_prompt_chunks_and_mixed_steps_are_captured_on_a_gpu(kind, tiny_gguf, monkeypatch):
    """The routed experts stacked on the GPU with fused grouped GEMMs (model.prefill_graph_safe: a
    pass of any length has no host sync): dsq serve's warm-up captures prompt chunks and mixed
    steps (more rows than sequences) as it does for a dense model. Their replays give the eager
    passes' logits: two prompt chunks padded up to a graph's length, a mixed step of two decode
    rows and a third sequence's first prompt tokens, then that prompt's last tokens alone; and
    the engine over them finishes every request."""
    from dsq.models.deepseek_model import GPUStackedExperts
    from dsq.runtime.native import NativeModel
    from test_serve_engine import _run_engine

    monkeypatch.setattr(GPUStackedExperts, "PAIRS_ROWS", 8)  # passes past 8 rows take the fused grouped GEMMs
    nm = NativeModel(tiny_gguf(kind, "Q4_K_M"), "gguf", n_ctx=CTX, gpu_layers="all", experts="gpu", cuda_graph=False)
    assert nm.model.prefill_graph_safe
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, nm.model.args.vocab_size, (n,), generator=g).tolist() for n in (40, 20, 30)]
    tables = [list(range(1 + i * 4, 5 + i * 4)) for i in range(3)]  # four blocks of 16 each
    out, replays = {}, []
    for graphs in (False, True):
        kv = PagedKV(nm.model, 16, 16, CTX)
        if graphs:
            kv.scratch = 0
            assert kv.capture([32], seqs=3) == [32] and (64, 256) in kv.capture_chunks([64])
            for gr in [kv.graphs[32]] + list(kv.chunk_graphs.values()):
                real = gr.graph.replay
                monkeypatch.setattr(gr.graph, "replay", lambda r=real, gr=gr: replays.append(type(gr).__name__) or r())
        got = [kv.forward([s[:-1]], [0], [t])[0] for s, t in zip(seqs[:2], tables)]  # 39 and 19 tokens
        got.append(kv.forward_rows([seqs[0][-1], seqs[1][-1]] + seqs[2][:20], [39, 19] + list(range(20)),
                                   [0, 1] + [2] * 20, tables, [0, 1]))
        got.append(kv.forward_rows(seqs[2][20:], list(range(20, 30)), [0] * 10, [tables[2]], [9]))
        out[graphs] = [x.float() for x in got]
    assert replays == ["_ChunkGraph", "_ChunkGraph", "_PagedGraph", "_PagedGraph"]
    for a, b in zip(out[False], out[True]):
        assert a.shape == b.shape and (a - b).abs().max() <= 2e-2 * a.abs().max(), (a - b).abs().max()
    prompts = [s[:n] for s, n in zip(seqs, (40, 17, 30))]
    _, usages, eng, _ = _run_engine(nm, prompts, 8, ignore_eos=True, warm=True, kv_tokens=2048, block_size=16,
                                        max_seqs=4, prefill_chunk=64)
    assert eng.warmed["chunk_graphs"] and max(eng.warmed["graphs"]) > eng.max_seqs  # chunks and mixed steps
    m = eng.metrics()
    assert m["failed"] == 0 and m["packed_prompt_tokens"] > 0
    assert [u["completion_tokens"] for u in usages.values()] == [8, 8, 8]


def test_latent_blocks_are_sized_by_the_latent_width(hf_model):
    """A block holds one latent row a token and layer (no values): against keys and values of
    every head at the MLA head widths, ~(H (qk + v)) / (rank + rope) more tokens in the same memory."""
    from dsq.serve.engine import Engine

    nm = hf_model("deepseek_v3")
    a = nm.model.args
    width = a.kv_lora_rank + a.qk_rope_head_dim
    assert PagedKV.bytes_per_block(nm.model, 16, torch.bfloat16) == a.num_hidden_layers * 16 * width * 2
    # FP8: a byte a value and a float32 scale a row
    assert PagedKV.bytes_per_block(nm.model, 16, FP8) == a.num_hidden_layers * 16 * (width + 4)
    mha = a.num_attention_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim)
    mem = 4 << 20
    eng = Engine(nm, kv_bytes=mem, kv_dtype=torch.bfloat16)
    tokens = eng.pool.num_blocks * eng.block_size
    assert tokens == mem // (a.num_hidden_layers * width * 2) // 16 * 16
    assert tokens * width == pytest.approx(mem // (a.num_hidden_layers * 2), rel=0.01)
    assert tokens >= 0.99 * (mha / width) * mem // (a.num_hidden_layers * mha * 2)
    assert Engine(nm, kv_bytes=mem, kv_dtype=FP8).pool.num_blocks >= 1.9 * eng.pool.num_blocks


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_latent_rows_are_rounded_rows(kind, hf_model):
    """FP8 latent rows (e4m3, each row scaled by its absmax / 448), as stored: the first layer's
    rows (the same input either way) are the float32 pool's within e4m3's rounding (half a step:
    1/16 of the value, or the scale / 1024 below e4m3's normal range)."""
    model = hf_model(kind).model
    ids = torch.randint(0, model.args.vocab_size, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    pools = {}
    for dt in (torch.float32, FP8):
        kv = PagedKV(model, 8, 16, CTX, dt)
        kv.forward([ids[:24]], [0], [[5, 2, 7]])
        kv.forward([ids[24:]], [24], [[5, 2, 7]])
        pools[dt] = kv
    rows = lambda k: k[[5, 2, 7]].reshape(-1, k.shape[-1])[:40].float()  # noqa: E731
    ref = rows(pools[torch.float32].k[0])
    scale = rows(pools[FP8].k_scale[0][..., None])
    got = rows(pools[FP8].k[0]) * scale
    assert torch.allclose(scale[:, 0], ref.abs().amax(-1) / 448)
    err = (got - ref).abs()
    assert (err <= torch.maximum(ref.abs() / 16, scale / 1024) * 1.001).all()
    assert err.max() > 0  # rounded, not stored in float


def test_fp8_latent_rows_cost_little(hf_model):
    """FP8 latent rows against float32 ones, the tiny V2 (softmax routing), 128 random tokens in
    four chunks (later chunks attend over stored, rounded rows). Measured: mean KLD 0.013, top-1
    agreement 86% (bf16: 1e-4, 98%); a random MoE's routing flips on small changes, so these
    bound gross errors (V3's sigmoid group routing moves KLD to 0.018 even in bf16: not used here)."""
    model = hf_model("deepseek_v2").model
    ids = torch.randint(0, model.args.vocab_size, (128,), generator=torch.Generator().manual_seed(2)).tolist()
    logp = {}
    for dt in (torch.float32, FP8):
        kv = PagedKV(model, 16, 16, CTX, dt)
        out = [kv.forward([ids[i:i + 32]], [i], [list(range(8))], every_position=True)[0] for i in range(0, 128, 32)]
        logp[dt] = torch.cat(out).float().log_softmax(-1)
    ref, q = logp[torch.float32], logp[FP8]
    kld = (ref.exp() * (ref - q)).sum(-1)
    assert 0 < kld.mean() < 0.03, kld.mean()
    assert (ref.argmax(-1) == q.argmax(-1)).float().mean() >= 0.75


# -- the engine loop ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def q8_path(tiny_gguf):
    return tiny_gguf("deepseek_v2", "Q8_0")


@pytest.fixture(scope="module")
def q8(q8_path):
    """The tiny V2 (dense first layer, MoE after) as Q8_0, its routed experts in RAM (one C call a layer)."""
    from dsq.runtime.engine import load

    nm = load(str(q8_path), backend="native", ctx=CTX, cuda_graph=False, experts="cpu")
    assert nm.experts == "cpu"
    return nm


def test_engine_batches_preempts_and_matches_generate(q8):
    from dsq.runtime.engine import encode_prompt, generate

    ref = [generate(q8, p, max_tokens=N_TOKENS, temperature=0, ignore_eos=True).text for p in PROMPTS]
    ids = [encode_prompt(q8, p) for p in PROMPTS]
    texts, usages, eng, _ = _run_engine(q8, ids, N_TOKENS, ignore_eos=True, kv_tokens=4096, max_seqs=8)
    assert texts == ref
    assert all(u["completion_tokens"] == N_TOKENS for u in usages.values())
    # speculative decoding by prompt lookup: a draft is checked in one pass over several positions
    spec, _, eng, _ = _run_engine(q8, ids, N_TOKENS, ignore_eos=True, kv_tokens=4096, max_seqs=8, spec_tokens=4,
                                  spec_max_rows=8)
    assert spec == ref and eng.counters["spec_draft_tokens"] > 0
    # a pool too small for all five: requests wait and are preempted; the ones never preempted
    # match exactly (a preempted one is recomputed by a prefill, whose rounding differs)
    texts, _, eng, reqs = _run_engine(q8, ids, N_TOKENS, ignore_eos=True, kv_tokens=56, block_size=4, max_seqs=5,
                                      prefix_cache=False, n_ctx=48)
    kept = [i for i, r in enumerate(reqs) if r.preemptions == 0]
    assert eng.counters["preempted"] > 0 and kept
    assert [texts[i] for i in kept] == [ref[i] for i in kept]
    assert eng.metrics()["kv_blocks_held"] == 0


def test_mixed_steps_and_captured_chunks_over_the_latent_cache_reply_as_dsq_run(q8, monkeypatch):
    """What dsq serve's warm-up now captures for a MoE model whose passes have no host sync, the CPU
    standing in for the GPU's graphs: prompt tokens as rows of the decode steps (mixed steps: several
    rows of one sequence in a step, each writing its latent row before any row attends), then
    captured prompt chunks alone. Every reply is dsq run's."""
    from dsq.runtime.engine import encode_prompt, generate
    from tests.tiny import stand_in_graphs

    stand_in_graphs(monkeypatch)
    ref = [generate(q8, p, max_tokens=6, temperature=0, ignore_eos=True).text for p in PROMPTS]
    ids = [encode_prompt(q8, p) for p in PROMPTS]
    texts, _, eng, _ = _run_engine(q8, ids, 6, ignore_eos=True, kv_tokens=1024, max_seqs=2, prefill_chunk=8,
                                   prefix_cache=False, capture=[1, 2, 6, 10], capture_seqs=2)
    m = eng.metrics()
    assert texts == ref and m["failed"] == 0
    assert m["chunks"] == 0 and m["packed_prompt_tokens"] == sum(len(i) for i in ids)
    texts, _, eng, _ = _run_engine(q8, ids, 6, ignore_eos=True, kv_tokens=1024, max_seqs=2, prefix_cache=False,
                                   capture=[1, 2], capture_chunks=[8, 16, 32])
    m = eng.metrics()
    assert texts == ref and m["failed"] == 0 and m["chunks"] >= len(ids)
    assert m["chunk_padded_tokens"] > m["chunk_tokens"]  # padded up to a captured length: the graphs ran


def test_engine_prefix_cache_hits_with_the_same_output(q8):
    from dsq.runtime.engine import encode_prompt, generate

    system = "You are a careful assistant. Answer in one short sentence, in plain English. " * 3
    prompts = [system + q for q in ("What is rain?", "What is snow?", "What is hail?")]
    ref = [generate(q8, p, max_tokens=N_TOKENS, temperature=0, ignore_eos=True).text for p in prompts]
    ids = [encode_prompt(q8, p) for p in prompts]
    # one at a time: the first one's prompt blocks are indexed when the second arrives
    texts, usages, eng, _ = _run_engine(q8, ids, N_TOKENS, ignore_eos=True, kv_tokens=2048, block_size=16, max_seqs=1)
    shared = len(ids[0]) - 8
    assert eng.metrics()["prefix_cache_hit_tokens"] >= 2 * (shared // 16) * 16 > 0
    assert usages[2]["prompt_tokens_details"]["cached_tokens"] >= (shared // 16) * 16
    assert texts == ref


# -- over HTTP ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(q8_path):
    pytest.importorskip("uvicorn")
    started = _start(str(q8_path), "--experts", "cpu", ctx=CTX)
    proc = started["proc"]
    yield started
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    first = out.splitlines()[0]
    # the startup line gives the cache's capacity in tokens (4 x --ctx by default)
    assert f"KV cache of {4 * CTX} tokens" in first, first


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="none", timeout=120, max_retries=0)


_GENERATE = """
import json, sys
from dsq.runtime.engine import generate, load
m = load(sys.argv[1], backend="native", ctx=int(sys.argv[2]), experts="cpu")
print(json.dumps([generate(m, p, max_tokens=int(sys.argv[3]), temperature=0).text for p in json.loads(sys.argv[4])]))
"""


def _dsq_run_all(path, prompts: list[str]) -> dict[str, str]:
    """What `dsq run --temperature 0` prints for each prompt: the CLI for the first, the function
    it calls (one model load) for all, which must agree on the first."""
    out = subprocess.run([sys.executable, "-c", _GENERATE, str(path), str(CTX), str(N_TOKENS), json.dumps(prompts)],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    texts = json.loads(out.stdout.splitlines()[-1])
    cli = subprocess.run([sys.executable, "-m", "dsq", "run", str(path), "--backend", "native", "--experts", "cpu",
                          "-p", prompts[0], "--max-tokens", str(N_TOKENS), "--temperature", "0", "--ctx", str(CTX),
                          "--json"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    assert texts[0] == json.loads(cli.stdout)["text"]
    return dict(zip(prompts, texts))


def test_served_concurrent_greedy_and_prefix_hits_match_dsq_run(server, client, q8_path):
    model_id = client.models.list().data[0].id
    system = "You are a patient teacher. Answer every question in one short sentence of plain words. " * 2
    shared = [system + q for q in ("What is rain?", "What is snow?")]
    expected = _dsq_run_all(q8_path, PROMPTS + shared)

    def one(p: str):
        return client.completions.create(model=model_id, prompt=p, max_tokens=N_TOKENS, temperature=0)

    jobs = [PROMPTS[i % len(PROMPTS)] for i in range(10)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, jobs, timeout=300))
    assert [g.choices[0].text for g in got] == [expected[p] for p in jobs]
    before = _get(server["base"] + "/metrics?format=json")["prefix_cache_hit_tokens"]
    first, second = one(shared[0]), one(shared[1])  # one after the other: the second finds the first's blocks
    assert [first.choices[0].text, second.choices[0].text] == [expected[p] for p in shared]
    cached = second.usage.prompt_tokens_details.cached_tokens
    m = _get(server["base"] + "/metrics?format=json")
    assert cached >= 32 and m["prefix_cache_hit_tokens"] - before >= cached > 0
    assert m["failed"] == 0 and m["kv_blocks_held"] == 0 and m["kv_dtype"] == "float32"


def test_cli_experts_flag_errors(runner, tiny_dir, q8_path):
    """Bad --experts for serve: one line, exit 1, before a server starts."""
    from test_cli_errors import one_line_error

    from dsq.cli import app

    r = runner.invoke(app, ["serve", str(q8_path), "--port", "0", "--experts", "sideways"])
    assert one_line_error(r).startswith("error: --experts takes cpu, gpu or auto")
    r = runner.invoke(app, ["serve", str(tiny_dir("deepseek_v2")), "--port", "0", "--experts", "cpu"])
    one_line_error(r, "--experts cpu runs GGUF experts", "--experts gpu")
