"""`dsq serve --draft`: speculative decoding with a draft model, over HTTP with the official
`openai` client (servers on 127.0.0.1, bounded waits), and in the engine.

- the built-in model as its own draft: every proposal is kept (acceptance ~1);
- a draft that disagrees: the built-in model without its last decoder layer (its first 17 layers
  and its head, a bf16 HF directory written here), which the target overrules about half the time;
- both: greedy replies to concurrent requests (more than spec_max_rows decoding: the draft path
  checks all rows in one batched pass) equal to speculation off; a sampled request proposes nothing;
- a draft with another vocabulary (a tiny random GGUF) is refused in one line before serving.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_serve import N_TOKENS, PROMPTS, _dsq_run_all, _metrics, _start, _stop, int8_x_build

openai = pytest.importorskip("openai")

MODEL = "gemma-3-270m-q4_k_m"


@pytest.fixture(autouse=True)
def _float_x(monkeypatch):
    if int8_x_build():  # greedy equality across batch shapes is about batching, not x's rounding
        monkeypatch.setenv("DSQ_NO_VNNI", "1")


@pytest.fixture(scope="module")
def expected():
    """Greedy replies with speculation off (dsq run's)."""
    return _dsq_run_all(PROMPTS)


@pytest.fixture(scope="module")
def shallow_draft(builtin_hf, tmp_path_factory):
    """The built-in model minus its last decoder layer, as a bf16 HF directory."""
    from benchmarks.draft_layers import write_first_layers

    n = json.loads((builtin_hf / "config.json").read_text())["num_hidden_layers"] - 1
    return write_first_layers(builtin_hf, tmp_path_factory.mktemp("draft-first-layers"), n)


def _greedy_all(base: str, prompts: list[str]) -> list[str]:
    c = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=300, max_retries=0)

    def one(p: str) -> str:
        return c.completions.create(model=MODEL, prompt=p, max_tokens=N_TOKENS, temperature=0).choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts, timeout=600))


def test_the_model_as_its_own_draft_keeps_every_proposal(expected, runner):
    from dsq.cli import app

    s = _start("--draft", "builtin", "--spec-tokens", "4")
    try:
        jobs = PROMPTS + PROMPTS[:3]  # 8 at once: more rows than prompt lookup would speculate on
        assert _greedy_all(s["base"], jobs) == [expected[p] for p in jobs]
        m = _metrics(s)
        assert m["spec_method"] == "draft" and m["spec_draft_tokens"] > 0
        assert m["spec_acceptance_rate"] >= 0.9
        assert m["draft_rows"] > 0 and m["failed"] == 0
        assert m["kv_blocks_held"] == 0 and m["draft_kv_blocks_held"] == 0
        # a sampled request decodes plainly: no proposals
        c = openai.OpenAI(base_url=s["base"] + "/v1", api_key="none", timeout=120, max_retries=0)
        r = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=1.0, seed=3)
        assert r.usage.completion_tokens >= 1
        assert _metrics(s)["spec_draft_tokens"] == m["spec_draft_tokens"]
        # dsq bench --serve reports the server's acceptance over each level
        b = runner.invoke(app, ["bench", "--serve", s["base"], "--concurrency", "2", "--requests", "2",
                                "--max-tokens", "6", "--prompt-tokens", "16"])
        assert b.exit_code == 0, b.output
        assert "speculative acceptance" in b.stderr
    finally:
        _stop(s)


def test_a_draft_the_model_overrules_keeps_greedy_output(expected, shallow_draft):
    s = _start("--draft", str(shallow_draft), "--spec-tokens", "3")
    try:
        assert _greedy_all(s["base"], PROMPTS) == [expected[p] for p in PROMPTS]
        m = _metrics(s)
        assert m["spec_draft_tokens"] > 0
        assert 0 < m["spec_accepted_tokens"] < m["spec_draft_tokens"]
        assert 0 < m["spec_acceptance_rate"] < 1
        assert m["kv_blocks_held"] == 0 and m["draft_kv_blocks_held"] == 0 and m["failed"] == 0
    finally:
        _stop(s)


def test_a_draft_with_another_vocabulary_is_one_line(runner, tmp_path):
    from dsq.bench.random_gguf import write_random_gguf
    from dsq.cli import app

    tiny = write_random_gguf(tmp_path / "tiny.gguf", shape="tiny", mix="Q8_0")
    r = runner.invoke(app, ["serve", "--port", "0", "--ctx", "256", "--draft", str(tiny)])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 1 and len(lines) == 1, r.output
    assert lines[0].startswith("error: --draft") and "vocabulary" in lines[0] and "1024 tokens" in lines[0]
    r = runner.invoke(app, ["serve", "--port", "0", "--ctx", "256", "--draft", str(tmp_path / "nope.gguf")])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: --draft: "), r.output
    assert "does not exist" in lines[0] and "'builtin'" in lines[0]
    r = runner.invoke(app, ["serve", "--port", "0", "--draft", str(tiny), "--spec-tokens", "0"])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 1 and len(lines) == 1 and "--spec-tokens" in lines[0], r.output


def test_vocab_check_names_what_differs(builtin_gguf):
    """Same tokens: no complaint; a tokenizer that splits text differently, or other special
    tokens, is named."""
    from dsq.runtime.engine import load
    from dsq.serve.draft import vocab_mismatch

    nm = load(None, backend="native", ctx=64, cuda_graph=False)
    assert vocab_mismatch(nm, nm) is None

    class Other:
        model, bos_token, eos_token = nm.model, nm.bos_token, nm.eos_token
        detokenize, is_eog = nm.detokenize, nm.is_eog

        def tokenize(self, text, add_bos=True):
            return nm.tokenize(text, add_bos=add_bos)[::-1]

    assert "splits" in vocab_mismatch(nm, Other())
    Other.tokenize = lambda self, text, add_bos=True: nm.tokenize(text, add_bos=add_bos)
    assert vocab_mismatch(nm, Other()) is None
    Other.eos_token = "</s>"
    assert "eos token is '</s>'" in vocab_mismatch(nm, Other())


# -- the engine, without HTTP --------------------------------------------------------------

@pytest.fixture(scope="module")
def builtin():
    from dsq.runtime.engine import load

    return load(None, backend="native", ctx=512, cuda_graph=False)


def _greedy_engine(eng, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = False) -> list[str]:
    """Run `prompts` through `eng` step by step; each request's text."""
    from dsq.runtime.sampling import SamplingParams
    from dsq.serve.engine import Request

    texts = [""] * len(prompts)
    reqs = []
    for i, p in enumerate(prompts):
        def emit(ev, i=i):
            assert ev.kind != "error", ev.text
            texts[i] += ev.text if ev.kind == "text" else ""
        reqs.append(Request(p, SamplingParams(temperature=0), max_tokens, emit, ignore_eos=ignore_eos))
        eng.submit(reqs[-1])
    eng.waiting.extend(eng.inbox)
    eng.inbox.clear()
    for _ in range(20 * max_tokens * len(prompts)):
        if all(r.finished for r in reqs):
            break
        eng.step()
    assert all(r.finished for r in reqs)
    return texts, reqs


def test_seq_catch_up_counts_the_kept_proposals():
    from dsq.serve.draft import _Seq

    s = _Seq(base=5, fed=[7, 8, 9])
    assert s.catch_up([0, 1, 2, 3, 4, 7, 8, 9, 6, 2]) == 8  # all three kept, then more
    assert s.catch_up([0, 1, 2, 3, 4, 7, 5]) == 6  # one kept, then the target's own
    assert s.catch_up([0, 1, 2, 3, 4, 7]) == 5  # never the last token: the draft runs it
    assert s.catch_up([0, 1, 2]) == 2  # fewer tokens than the draft saw (cannot happen; still safe)


def test_engine_draft_survives_a_full_draft_pool_and_preemption(builtin, shallow_draft):
    """A draft pool too small for every request skips some (they decode plainly); a target pool
    too small for all preempts; greedy replies stay those of speculation off."""
    from dsq.runtime.engine import encode_prompt, load
    from dsq.serve.draft import Drafter
    from dsq.serve.engine import Engine

    draft = load(str(shallow_draft), backend="native", ctx=512, cuda_graph=False)
    ids = [encode_prompt(builtin, p) for p in PROMPTS[:4]]
    ref, _ = _greedy_engine(Engine(builtin, kv_tokens=4096, block_size=4), ids, 12)
    eng = Engine(builtin, kv_tokens=4096, block_size=4, spec_tokens=3, draft=draft)
    eng.drafter = Drafter(draft, num_blocks=8, block_size=4, max_len=eng.n_ctx + 4, vocab=eng.drafter.vocab,
                          prefill_chunk=eng.prefill_chunk)  # room for about two of the four
    got, _ = _greedy_engine(eng, ids, 12)
    m = eng.metrics()
    assert got == ref
    assert m["draft_skipped_rows"] > 0 and m["draft_rows"] > 0 and 0 < m["spec_acceptance_rate"] < 1
    assert m["draft_kv_blocks_held"] == 0 and m["kv_blocks_held"] == 0
    # a target pool of 11 blocks of 4 tokens for four sequences of ~21 tokens: preemptions
    eng = Engine(builtin, kv_tokens=44, block_size=4, max_seqs=4, prefix_cache=False, n_ctx=40, spec_tokens=3,
                 draft=builtin)
    got, reqs = _greedy_engine(eng, ids, 12)
    assert eng.counters["preempted"] > 0 and eng.metrics()["spec_accepted_tokens"] > 0
    # a preempted request is recomputed by a prefill, whose rounding may part greedy ways at a near-tie
    kept = [i for i, r in enumerate(reqs) if r.preemptions == 0]
    assert kept and [got[i] for i in kept] == [ref[i] for i in kept]
    assert eng.metrics()["draft_kv_blocks_held"] == 0
    # the same prompt twice: the draft's pool shares the first one's full prompt blocks with the second
    eng = Engine(builtin, kv_tokens=4096, block_size=4, spec_tokens=3, draft=builtin)
    got, _ = _greedy_engine(eng, [ids[0], ids[0]], 12)
    assert got == [ref[0], ref[0]]
    assert eng.metrics()["draft_prefix_cache_hit_tokens"] >= (len(ids[0]) - 1) // 4 * 4 > 0


def test_engine_draft_on_deepseek_latent_cache(tiny_gguf):
    """A DeepSeek V2 (MLA: the paged blocks hold latent rows; MoE) as its own draft: the draft's
    pool is latent rows too, and greedy replies stay those of speculation off."""
    from dsq.runtime.engine import encode_prompt, load
    from dsq.serve.engine import Engine

    nm = load(str(tiny_gguf("deepseek_v2", "Q8_0")), backend="native", ctx=256, cuda_graph=False, experts="cpu")
    ids = [encode_prompt(nm, p) for p in PROMPTS]
    ref, _ = _greedy_engine(Engine(nm, kv_tokens=2048), ids, 12, ignore_eos=True)
    eng = Engine(nm, kv_tokens=2048, spec_tokens=3, draft=nm)
    got, _ = _greedy_engine(eng, ids, 12, ignore_eos=True)
    m = eng.metrics()
    assert got == ref and m["spec_method"] == "draft" and m["draft_rows"] > 0
    assert m["spec_acceptance_rate"] >= 0.5 and m["draft_kv_blocks_held"] == 0
