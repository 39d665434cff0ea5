"""dsq serve's engine without HTTP: the block pool, the paged forward against the model's own
full-sequence forward (tiny random Gemma 3: sliding and global layers), and the engine loop
(continuous batching, preemption, prefix caching) against `dsq.generate` on the built-in model."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from dsq.serve.paged import BlockPool, PagedKV
from serve_util import int8_x_build
from tests.tiny import stand_in_graphs


@pytest.fixture(autouse=True)
def _float_x(monkeypatch):
    if int8_x_build():
        monkeypatch.setenv("DSQ_NO_VNNI", "1")


def test_block_pool_shares_evicts_and_counts():
    pool = BlockPool(4, 2)
    a = [pool.allocate(), pool.allocate()]
    pool.register([1, 2, 3, 4], a)
    assert pool.available() == 2
    got = pool.match([1, 2, 3, 4, 5], 4)  # both full blocks are found, and now held twice
    assert got == a and pool.hits == 4 and pool.ref[a[0]] == 2
    assert pool.match([1, 2, 9, 9], 4) == a[:1]  # the second block's prefix differs
    pool.release(got)
    pool.release(a[:1])
    pool.release(a)  # nobody holds them now: cached, still counted as available
    assert pool.available() == 4 and len(pool.evictable) == 2
    taken = [pool.allocate() for _ in range(4)]  # the free ones first, then the cached ones (forgotten)
    assert sorted(taken) == [0, 1, 2, 3] and not pool.by_hash
    with pytest.raises(MemoryError):
        pool.allocate()
    assert pool.match([1, 2, 3, 4], 4) == []


def test_paged_forward_matches_the_full_sequence(tmp_path):
    from tests.tiny import build_tiny_model

    from dsq.runtime.native import NativeModel

    nm = NativeModel(build_tiny_model("gemma3", tmp_path / "g"), "hf", n_ctx=256, cuda_graph=False)
    model = nm.model
    assert model.args.sliding_window and model.args.sliding_window < 40  # both layer kinds, past the window
    g = torch.Generator().manual_seed(0)
    kv = PagedKV(model, 64, 4, 256)
    order = list(range(64))
    random.Random(0).shuffle(order)  # blocks anywhere in the pool, in no order
    seqs = []
    for n in (3, 17, 45):
        ids = torch.randint(0, model.args.vocab_size, (n + 6,), generator=g).tolist()
        seqs.append({"ids": ids, "table": [order.pop() for _ in range(-(-(n + 6) // 4))], "n": n})
    for s in seqs:  # prefill in two chunks
        h = s["n"] // 2 or 1
        kv.forward([s["ids"][:h]], [0], [s["table"]])
        s["logits"] = [kv.forward([s["ids"][h:s["n"]]], [h], [s["table"]])[0]]
    for step in range(6):  # decode all three together, each at its own position
        rows = [s["ids"][s["n"] + step] for s in seqs]
        out = kv.forward([[t] for t in rows], [s["n"] + step for s in seqs], [s["table"] for s in seqs])
        for s, lg in zip(seqs, out):
            s["logits"].append(lg)
    with torch.inference_mode():
        for s in seqs:
            full = model(torch.tensor([s["ids"]]))[0]
            for j, lg in enumerate(s["logits"]):
                ref = full[s["n"] - 1 + j]
                assert torch.allclose(lg.float(), ref.float(), atol=1e-4, rtol=1e-4), (s["n"], j)


@pytest.fixture(scope="module")
def builtin(builtin_gguf):
    from dsq.runtime.engine import load

    return load(builtin_gguf, backend="native", ctx=512, cuda_graph=False)


def _run_engine(nm, prompts, max_tokens, ignore_eos: bool = False, warm: bool = False, capture=None,
                capture_chunks=None, piece_costs=None, capture_seqs=None, **kw):
    from dsq.runtime.sampling import SamplingParams
    from dsq.serve.engine import Engine, Request

    eng = Engine(nm, **kw)
    if capture:
        eng.kv.capture(capture, seqs=capture_seqs)
    if capture_chunks:
        eng.kv.capture_chunks(capture_chunks)
    if piece_costs:
        eng.kv.plan_pieces(piece_costs)
    if warm:
        total, had = eng.pool.available(), eng.kv.scratch is not None
        eng.warmed = eng.warm_up()
        # every block back, nothing cached, but the padding block a first capture takes and holds for good
        held = int(eng.kv.scratch is not None and not had)
        assert eng.pool.available() == total - held and not eng.pool.hash_of
    done, texts, usages = threading.Event(), {}, {}
    reqs = []
    for i, p in enumerate(prompts):
        def emit(ev, i=i):
            if ev.kind == "text":
                texts[i] = texts.get(i, "") + ev.text
            else:
                usages[i] = ev.usage if ev.kind == "done" else ev.text
                if len(usages) == len(prompts):
                    done.set()
        reqs.append(Request(p, SamplingParams(temperature=0), max_tokens, emit, ignore_eos=ignore_eos))
    eng.start()
    try:
        for r in reqs:
            eng.submit(r)
        assert done.wait(300), "the engine did not finish in time"
    finally:
        eng.stop()
    return [texts.get(i, "") for i in range(len(prompts))], usages, eng, reqs


PROMPTS = ["The history of the Roman Empire", "Why is the sky blue?", "def fibonacci(n):",
           "Once upon a time, in a land far away"]


@pytest.mark.parametrize("captured", [False, True])
def test_engine_batches_preempts_and_matches_generate(builtin, captured, monkeypatch):
    """captured: decode steps of 2 and 4 rows and prompt chunks of 8-32 tokens replay captured graphs
    (the CPU standing in for the GPU's), their scratch block one of the small pool's."""
    from dsq.runtime.engine import encode_prompt, generate

    ref = [generate(builtin, p, max_tokens=20, temperature=0).text for p in PROMPTS]
    ids = [encode_prompt(builtin, p) for p in PROMPTS]
    kw = {}
    if captured:
        stand_in_graphs(monkeypatch)
        kw = {"capture": [2, 4], "capture_chunks": [8, 16, 32]}
    # a pool of 11 blocks of 4 tokens cannot hold four sequences of ~28 tokens: requests wait and are preempted
    texts, usages, eng, reqs = _run_engine(builtin, ids, 20, kv_tokens=44, block_size=4, max_seqs=4, prefix_cache=False,
                                           n_ctx=40, **kw)
    assert eng.counters["preempted"] > 0
    # a preempted request is recomputed by a prefill, whose rounding differs from the decode steps'
    # (greedy may then part ways at a near-tie): the others must match exactly
    kept = [i for i, r in enumerate(reqs) if r.preemptions == 0]
    assert kept and len(kept) < len(reqs)
    assert [texts[i] for i in kept] == [ref[i] for i in kept]
    assert all(u["completion_tokens"] == 20 or u["completion_tokens"] > 0 for u in usages.values())
    ample, _, _, _ = _run_engine(builtin, ids, 20, kv_tokens=4096, max_seqs=4)
    assert ample == ref
    assert all(u["completion_tokens"] > 0 and u["prompt_tokens"] == len(i) for u, i in zip(usages.values(), ids))
    assert eng.metrics()["kv_blocks_held"] == 0


def test_warm_up_runs_each_row_bucket_and_changes_no_reply(builtin):
    """dsq serve on a GPU warms up before the first request (each batch size bucket and a few
    prompt chunk lengths autotune there): the warm-up gives every block back and the replies stay
    dsq run's."""
    from dsq.runtime.engine import encode_prompt, generate

    ref = [generate(builtin, p, max_tokens=12, temperature=0).text for p in PROMPTS]
    ids = [encode_prompt(builtin, p) for p in PROMPTS]
    texts, _, eng, _ = _run_engine(builtin, ids, 12, warm=True, kv_tokens=4096, max_seqs=5, prefill_chunk=100)
    assert eng.warmed == {"decode": [1, 2, 4, 5], "prefill": [2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 100],
                          "graphs": [], "chunk_graphs": [], "seconds": {}}  # CPU: none captured
    assert texts == ref


def test_prompt_tokens_as_rows_of_one_step_equal_a_prefill(tmp_path):
    """Engine.decode_plain's packing: a sequence's next tokens as rows of one step (each at its own
    position, beside another sequence's decode row) give the logits and keys/values a prompt chunk
    of those tokens gives: every row's keys/values are written before any row attends."""
    from tests.tiny import build_tiny_model

    from dsq.runtime.native import NativeModel

    nm = NativeModel(build_tiny_model("gemma3", tmp_path / "g"), "hf", n_ctx=128, cuda_graph=False, dtype="float32")
    g = torch.Generator().manual_seed(4)
    a, b = (torch.randint(0, nm.model.args.vocab_size, (n,), generator=g).tolist() for n in (30, 12))
    ta, tb = list(range(0, 10)), list(range(10, 20))
    out, kvs = {}, {}
    for rows in (False, True):
        kv = kvs[rows] = PagedKV(nm.model, 24, 4, 128)
        kv.forward([a[:25]], [0], [ta])
        kv.forward([b[:-1]], [0], [tb])
        if rows:  # b's decode row, then a's last five tokens a row each
            got = kv.forward([[b[-1]]] + [[t] for t in a[25:]], [11] + list(range(25, 30)), [tb] + [ta] * 5)
            out[rows] = got[[0, 5]]
        else:
            out[rows] = torch.cat([kv.forward([[b[-1]]], [11], [tb]), kv.forward([a[25:]], [25], [ta])])
    assert torch.allclose(out[True], out[False], atol=1e-5, rtol=1e-5)
    for layer in range(nm.model.args.num_hidden_layers):
        assert torch.allclose(kvs[True].k[layer][:20], kvs[False].k[layer][:20], atol=1e-5)
        assert torch.allclose(kvs[True].v[layer][:20], kvs[False].v[layer][:20], atol=1e-5)


def test_captured_prompt_chunks_equal_the_eager_chunks(tmp_path, monkeypatch):
    """PagedKV.capture_chunks, the CPU standing in for the GPU's graphs: chunks of 3 to 30 tokens
    (padded to 8 or 32), starting mid-block, over spans of 16, 64 and the whole context, replay the
    graph of the shortest length and span that hold them. Their logits equal the eager chunks', every
    sequence's blocks hold the same keys/values, and the padding wrote only into the scratch block."""
    from tests.tiny import build_tiny_model

    from dsq.runtime.native import NativeModel
    from dsq.serve import paged

    stand_in_graphs(monkeypatch)
    monkeypatch.setattr(paged, "CHUNK_SPANS", (16, 64))
    nm = NativeModel(build_tiny_model("gemma3", tmp_path / "g"), "hf", n_ctx=128, cuda_graph=False, dtype="float32")
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, nm.model.args.vocab_size, (n,), generator=g).tolist() for n in (70, 13)]
    tables = [list(range(1, 19)), list(range(19, 23))]
    plan = [(0, 0, 30), (1, 0, 5), (0, 30, 33), (1, 5, 13), (0, 33, 62), (0, 62, 70)]  # (seq, start, end)
    out, kvs, used = {}, {}, []
    for graphs in (False, True):
        kv = kvs[graphs] = PagedKV(nm.model, 24, 4, 128)
        if graphs:
            kv.scratch = 0
            assert kv.capture_chunks([8, 32]) == [(8, 16), (8, 64), (8, 128), (32, 32), (32, 64), (32, 128)]
            for k, cg in kv.chunk_graphs.items():
                real = cg.graph.replay
                monkeypatch.setattr(cg.graph, "replay", lambda r=real, k=k: used.append(k) or r())
        out[graphs] = [kv.forward([seqs[i][a:b]], [a], [tables[i]]).clone() for i, a, b in plan]
    assert used == [(32, 32), (8, 16), (8, 64), (8, 16), (32, 64), (8, 128)]
    for x, y in zip(out[False], out[True]):
        assert torch.allclose(x, y, atol=1e-5, rtol=1e-5)
    before = [t.clone() for t in kvs[True].k]
    del used[:]
    cost = kvs[True].time_chunks(repeat=1)  # each length's shortest span, writing only into the scratch block
    assert sorted(cost) == [8, 32] and all(c > 0 for c in cost.values()) and used == [(8, 16), (32, 32)]
    assert len(kvs[True].first_piece) == 33
    # tokens a chunk computes: the captured length that replays it, or its own length when none holds it
    assert [kvs[True].chunk_length(t) for t in (1, 8, 9, 32, 33)] == [8, 8, 32, 32, 33]
    assert kvs[False].chunk_length(5) == 5
    assert all(torch.equal(a[1:], b[1:]) for a, b in zip(before, kvs[True].k))
    for layer in range(nm.model.args.num_hidden_layers):
        for pool in ("k", "v"):
            e, c = getattr(kvs[False], pool)[layer], getattr(kvs[True], pool)[layer]
            assert torch.allclose(e[1:], c[1:], atol=1e-5)  # block 0, the scratch, holds the padding
            assert e[0].abs().sum() == 0 and c[0].abs().sum() > 0


def test_short_prompt_remainders_ride_in_the_captured_decode_step(builtin, monkeypatch):
    """With captured decode steps (the CPU standing in for a GPU's graphs), what the prefix cache
    leaves of a shared system prompt and short prompts run as rows of the decode step instead of a
    prefill pass of their own (PACK_TOKENS): the replies stay dsq run's."""
    from dsq.runtime.engine import encode_prompt, generate
    from dsq.serve.engine import PACK_TOKENS

    stand_in_graphs(monkeypatch)
    system = "You are a careful assistant. Answer in one short sentence. " * 2
    prompts = [system + q for q in ("What is rain?", "What is snow?")] + PROMPTS[1:3]
    ref = [generate(builtin, p, max_tokens=8, temperature=0).text for p in prompts]
    ids = [encode_prompt(builtin, p) for p in prompts]
    assert any(len(i) <= PACK_TOKENS for i in ids)
    # one at a time (the second request finds the first one's system prompt blocks), then together
    for seqs in (1, 4):
        texts, _, eng, _ = _run_engine(builtin, ids, 8, kv_tokens=2048, max_seqs=seqs, capture=[16])
        m = eng.metrics()
        assert m["packed_prompt_tokens"] > 0 and m["failed"] == 0
        assert texts == ref
        if seqs == 1:
            assert m["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("pieces", [False, True])
def test_engine_with_captured_chunks_and_steps_replies_as_dsq_run(builtin, monkeypatch, pieces):
    """The engine with its decode steps and prompt chunks captured (the CPU standing in for the
    GPU's graphs): prompts of 4 to ~40 tokens in chunks of up to 32, two at a time, reply as
    `dsq.generate` does, and every prompt chunk replayed a graph. With piece costs that make a
    17-32-token chunk cheaper as 16 + the rest (plan_pieces), chunks split so and the replies
    stay the same."""
    from dsq.runtime.engine import encode_prompt, generate
    from dsq.serve import paged

    stand_in_graphs(monkeypatch)
    monkeypatch.setattr(paged, "CHUNK_SPANS", (64,))
    calls = []
    real = paged._ChunkGraph.__call__
    monkeypatch.setattr(paged._ChunkGraph, "__call__", lambda self, *a: calls.append(self.T) or real(self, *a))
    prompts = PROMPTS + ["Explain, step by step and in plain words, how a bicycle's gears let a rider climb a "
                         "steep hill without standing up on the pedals."]
    ref = [generate(builtin, p, max_tokens=6, temperature=0).text for p in prompts]
    ids = [encode_prompt(builtin, p) for p in prompts]
    costs = {8: 1.0, 16: 1.1, 32: 3.0} if pieces else None
    texts, _, eng, _ = _run_engine(builtin, ids, 6, kv_tokens=1024, max_seqs=2, prefill_chunk=32, n_ctx=256,
                                   prefix_cache=False, capture=[2], capture_chunks=[8, 16, 32], piece_costs=costs)
    assert texts == ref
    assert len(calls) >= len(prompts) and eng.metrics()["failed"] == 0
    assert (32 in calls) != pieces  # split into 16 + 8 pieces, no 32-token graph ran


def test_mixed_steps_carry_every_prompt_token_and_reply_as_dsq_run(builtin, monkeypatch):
    """With captured steps of more rows than sequences (Engine.mixed_sizes; the CPU standing in
    for the GPU's graphs), prompts of ~5 to ~40 tokens enter as rows of the decode steps, up to
    prefill_chunk tokens a step and the largest graph's rows, two requests at a time: no prompt
    chunk runs, the mixed graphs replay, a long prompt spreads over steps, and every reply is
    dsq run's."""
    from dsq.runtime.engine import encode_prompt, generate
    from dsq.serve import paged

    stand_in_graphs(monkeypatch)
    used = []
    real = paged._PagedGraph.__call__
    monkeypatch.setattr(paged._PagedGraph, "__call__",
                        lambda self, ids, *a: used.append((self.rows, len(ids))) or real(self, ids, *a))
    prompts = PROMPTS + ["Explain, step by step and in plain words, how a bicycle's gears let a rider climb a "
                         "steep hill without standing up on the pedals."]
    ref = [generate(builtin, p, max_tokens=6, temperature=0).text for p in prompts]
    ids = [encode_prompt(builtin, p) for p in prompts]
    assert max(len(i) for i in ids) > 24  # the long prompt needs two steps' budget
    texts, _, eng, _ = _run_engine(builtin, ids, 6, kv_tokens=1024, max_seqs=2, prefill_chunk=24, n_ctx=256,
                                   prefix_cache=False, capture=[1, 2, 8, 16, 26], capture_seqs=2)
    m = eng.metrics()
    assert texts == ref and m["failed"] == 0
    assert m["chunks"] == 0 and m["packed_prompt_tokens"] == sum(len(i) for i in ids)
    assert all(n <= rows for rows, n in used) and max(n for _, n in used) <= 26
    assert any(rows > 2 for rows, _ in used)  # mixed graphs ran
    assert [eng.kv.graphs[b].seqs for b in sorted(eng.kv.graphs)] == [1, 2, 2, 2, 2]


@pytest.mark.parametrize("mixed", [False, True])
def test_a_prompt_one_token_short_is_decoded_once(builtin, monkeypatch, mixed):
    """A request whose prompt has one token left to compute (here: the prefix cache holds all but
    its last token; also what a chunk boundary can leave) looks like a decoding row: its last
    token is the next step's input. With captured steps it was also packed as a prompt remainder,
    so one step ran and sampled it twice, left it with two tokens and one computed, neither
    prefilling nor decoding: it never finished and the loop spun. It must be run once."""
    from dsq.runtime.engine import encode_prompt, generate
    from dsq.serve.engine import _decoding

    stand_in_graphs(monkeypatch)
    bs = 16
    words = ("The history of the Roman Empire runs from the founding of the city to the fall of the east, "
             "through republic, empire and the long decline that followed the reign of the last emperors").split()
    text = next(t for t in (" ".join(words[:k]) for k in range(len(words)))
                if len(encode_prompt(builtin, t)) == 2 * bs + 1)
    prompt = encode_prompt(builtin, text)
    ref = generate(builtin, text, max_tokens=6, temperature=0).text
    texts, _, eng, reqs = _run_engine(builtin, [prompt, prompt], 6, kv_tokens=1024, max_seqs=1, block_size=bs,
                                      capture=[1, 2, 4] + ([8, 16] if mixed else []), capture_seqs=1 if mixed else None)
    m = eng.metrics()
    assert texts == [ref, ref] and m["prefix_cache_hit_tokens"] == 2 * bs  # the second found all but its last token
    assert [u["completion_tokens"] for u in _.values()] == [6, 6] and not any(_decoding(r) for r in reqs)


def test_a_request_that_cannot_progress_fails_instead_of_stalling(builtin):
    """A running request neither prefilling nor decoding (the state the double decode above left)
    gets an error event at the end of the step and leaves; the others carry on."""
    from dsq.runtime.sampling import Sampler, SamplingParams
    from dsq.serve.engine import Engine, Request

    eng = Engine(builtin, kv_tokens=256)
    events = []
    bad = Request([1, 2, 3], SamplingParams(temperature=0), 4, events.append)
    bad.tokens, bad.computed, bad.target, bad.sampler = [1, 2, 3, 7, 8], 3, 3, Sampler(SamplingParams())
    bad.blocks = [eng.pool.allocate()]
    eng.running.append(bad)
    eng.step()
    assert not eng.running and bad.finished and not bad.blocks and eng.metrics()["failed"] == 1
    assert [e.kind for e in events] == ["error"] and "stalled" in events[0].text


def test_a_captured_step_dearer_than_a_larger_one_is_dropped(tmp_path, monkeypatch):
    """PagedKV.time_graphs: each captured step's replay is timed and a step that costs more than one
    of more rows goes (its steps take that one); the largest stays. Steps of 96 rows of an 8B
    Q4_K_M model took the slow tl.dot GEMM and cost more than 128-row ones. Every row of a timed
    replay is a different token (a MoE step's cost follows the experts its rows choose) at position
    0 of the scratch block, as padding is: no sequence's block is written."""
    from dsq.serve import paged

    nm = _tiny_float_model(tmp_path, monkeypatch, True)
    kv = PagedKV(nm.model, 32, 4, 64)
    assert kv.capture([1, 2, 4, 6, 8, 12, 16], seqs=4) == [1, 2, 4, 6, 8, 12, 16]
    cost = {1: 1.0, 2: 1.1, 4: 1.5, 6: 2.5, 8: 2.0, 12: 3.0, 16: 2.9}
    replayed = []  # the rows of each graph replayed, and the values it was given
    for rows, g in kv.graphs.items():
        g.replay = lambda values, rows=rows, real=g.replay: (replayed.append((rows, values)), real(values))[1]

    def fake_timed(run, device):  # the replayed graph's cost
        run()
        return cost[replayed[-1][0]]

    monkeypatch.setattr(paged, "_timed", fake_timed)
    before = [t.clone() for t in kv.k]
    kept = kv.time_graphs(repeat=2)
    assert sorted(r for r, _ in replayed) == sorted(list(cost) * 2)  # every step, twice
    V = nm.model.args.vocab_size
    for rows, values in replayed:
        ids, pos, seq = values[:rows], values[rows:2 * rows], values[2 * rows:3 * rows]
        K = min(rows, 4)  # the sequences a graph takes (capture's seqs)
        assert len(set(ids)) == rows and all(0 <= t < V for t in ids) and pos == [0] * rows and seq == [K] * rows
        assert set(values[3 * rows + K:]) == {kv.scratch}  # every table the scratch block's
    assert all(torch.equal(a[:kv.scratch], b[:kv.scratch]) and torch.equal(a[kv.scratch + 1:], b[kv.scratch + 1:])
               for a, b in zip(before, kv.k))
    assert sorted(kv.graphs) == sorted(kept) == [1, 2, 4, 8, 16]  # 6 cost more than 8, 12 more than 16
    # a step of 5-6 rows now replays the 8-row graph, of 9-12 rows the 16-row one
    assert kv._decode_graph(6, 4).rows == 8 and kv._decode_graph(10, 4).rows == 16


def test_plan_pieces_takes_the_cheapest_first_piece():
    """PagedKV.plan_pieces over replay costs by captured length: a chunk runs whole (padded to the
    next captured length) unless pieces cost less in all."""
    from types import SimpleNamespace

    kv = SimpleNamespace()
    cost = {16: 2.0, 32: 2.5, 64: 4.0, 128: 7.0, 256: 13.0, 512: 25.0}
    PagedKV.plan_pieces(kv, cost)
    first = kv.first_piece
    assert len(first) == 513 and first[512] == 512 and first[256] == 256 and first[10] == 10
    assert first[300] == 256  # 256 + 44 (13 + 4) against 512 (25)
    assert first[500] == 500  # 256 + 244 would cost 26
    assert first[40] == 40  # 64 (4) against 32 + 16 (4.5)
    assert first[130] == 128  # 128 + 2 (7 + 2) against 256 (13)
    kv.chunk_end = lambda a, b: PagedKV.chunk_end(kv, a, b)
    assert kv.chunk_end(100, 400) == 356 and kv.chunk_end(0, 600) == 600 and kv.chunk_end(5, 5) == 5


def _tiny_float_model(tmp_path, monkeypatch, stand_in: bool):
    """A tiny gemma3 in float32: on the CPU with stand-in graphs (stand_in), else every layer on the GPU."""
    from tests.tiny import build_tiny_model

    from dsq.runtime.native import NativeModel

    if stand_in:
        stand_in_graphs(monkeypatch)
    return NativeModel(build_tiny_model("gemma3", tmp_path / "g"), "hf", n_ctx=128, cuda_graph=False,
                       gpu_layers=0 if stand_in else "all", dtype="float32")


@pytest.mark.parametrize("stand_in", [True, pytest.param(False, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="a real CUDA graph needs a GPU (run on the device)"))])
def test_captured_decode_step_equals_the_eager_step(tmp_path, monkeypatch, stand_in):
    """PagedKV.capture: decode steps of 3, then 2, then 1 sequences replay the graphs of 4, 2 and 2
    rows (the smallest of >= B rows), with their inputs refilled each step and the padding rows
    writing into a block of their own. Their logits equal the eager step's, and every sequence's
    blocks hold the same keys/values after. On the CPU (stand_in) a stand-in 'graph' reruns the
    captured function over its static inputs, which checks that protocol; on a GPU the real capture
    (float32, the Triton paged attention in both)."""
    nm = _tiny_float_model(tmp_path, monkeypatch, stand_in)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, nm.model.args.vocab_size, (n,), generator=g).tolist() for n in (40, 9, 23)]
    tables = [list(range(1 + i * 12, 13 + i * 12)) for i in range(3)]
    out, kvs = {}, {}
    for graphs in (False, True):
        kv = kvs[graphs] = PagedKV(nm.model, 40, 4, 128)
        if graphs:
            kv.scratch = 0  # the padding rows' block: no table holds it
            assert kv.capture([4, 2]) == [2, 4]
        for s, t in zip(seqs, tables):
            kv.forward([s[:-3]], [0], [t])
        steps, calls = [], []
        for b in kv.graphs:
            real = kv.graphs[b].graph.replay
            monkeypatch.setattr(kv.graphs[b].graph, "replay", lambda r=real, b=b: calls.append(b) or r())
        for j, rows in enumerate((3, 2, 1)):
            calls.clear()
            steps.append(kv.forward([[s[-3 + j]] for s in seqs[:rows]], [len(s) - 3 + j for s in seqs[:rows]],
                                    tables[:rows]).clone())
            assert calls == ([4 if rows == 3 else 2] if graphs else [])  # 3 rows: the graph of 4
        out[graphs] = steps
    for a, b in zip(out[False], out[True]):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    used = [b for t in tables for b in t]
    for layer in range(nm.model.args.num_hidden_layers):
        for pool in ("k", "v"):
            ea, ga = getattr(kvs[False], pool)[layer][used], getattr(kvs[True], pool)[layer][used]
            assert torch.allclose(ea, ga, atol=1e-5)  # a step of 4 rows rounds as one of 3 does, to ~2e-6


@pytest.mark.parametrize("stand_in", [True, pytest.param(False, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="a real CUDA graph needs a GPU (run on the device)"))])
def test_mixed_step_equals_the_eager_rows(tmp_path, monkeypatch, stand_in):
    """PagedKV.forward_rows replaying a graph of 8 rows and 3 sequences (a mixed step: two
    decode rows and five prompt tokens of a third sequence, then one decode row and two prompt
    tokens): the kept rows' logits equal the eager pass's, and the blocks hold the same
    keys/values; the padding rows wrote only into the scratch block."""
    nm = _tiny_float_model(tmp_path, monkeypatch, stand_in)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, nm.model.args.vocab_size, (n,), generator=g).tolist() for n in (30, 12, 9)]
    tables = [list(range(1 + i * 10, 11 + i * 10)) for i in range(3)]
    out, kvs = {}, {}
    for graphs in (False, True):
        kv = kvs[graphs] = PagedKV(nm.model, 32, 4, 128)
        if graphs:
            kv.scratch = 0
            assert kv.capture([8], seqs=3) == [8] and kv.graphs[8].seqs == 3
        kv.forward([seqs[0][:-2]], [0], [tables[0]])
        kv.forward([seqs[1][:-2]], [0], [tables[1]])
        steps = []
        # rows: seq 0 and 1 decode, seq 2's first five prompt tokens; logits of the decode rows only
        steps.append(kv.forward_rows([seqs[0][-2], seqs[1][-2]] + seqs[2][:5], [28, 10, 0, 1, 2, 3, 4],
                                     [0, 1, 2, 2, 2, 2, 2], tables, [0, 1]).clone())
        # seq 0 decodes, seq 2's last four prompt tokens: its last row's logits too
        steps.append(kv.forward_rows([seqs[0][-1]] + seqs[2][5:], [29, 5, 6, 7, 8], [0, 1, 1, 1, 1],
                                     [tables[0], tables[2]], [0, 4]).clone())
        out[graphs] = steps
    for a, b in zip(out[False], out[True]):
        assert a.shape == b.shape == (2, nm.model.args.vocab_size) and torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    used = [b for t in tables for b in t]
    for layer in range(nm.model.args.num_hidden_layers):
        for pool in ("k", "v"):
            ea, ga = getattr(kvs[False], pool)[layer], getattr(kvs[True], pool)[layer]
            assert torch.allclose(ea[used], ga[used], atol=1e-5)
            assert ea[0].abs().sum() == 0  # (eager: no padding rows)
    # the prompt's rows equal a plain prefill of it
    kv = PagedKV(nm.model, 32, 4, 128)
    ref = kv.forward([seqs[2]], [0], [tables[2]])
    assert torch.allclose(ref, out[True][1][1:], atol=1e-4, rtol=1e-4)


def test_batched_sampling_draws_what_each_rows_sampler_draws(builtin):
    """Engine._sample filters the rows of one setting in one call and draws a row on its own
    generator: over three steps, six rows (two settings, greedy, a repeat penalty) get the
    tokens their samplers alone give from the same seeds."""
    from dsq.runtime.sampling import Sampler, SamplingParams
    from dsq.serve.engine import Engine, Request

    eng = Engine(builtin, kv_tokens=256)
    V = builtin.model.args.vocab_size
    settings = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.0, top_k=0, top_p=0.9, seed=2),
                SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=0),
                SamplingParams(temperature=0.7, repeat_penalty=1.3, seed=5), SamplingParams(temperature=0.8, seed=6)]
    rows = []
    for sp in settings:
        r = Request([1, 2, 3], sp, 4, lambda e: None)
        r.tokens, r.sampler = [1, 2, 3], Sampler(sp)
        rows.append(r)
    alone = [Sampler(sp) for sp in settings]
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        logits = torch.randn(len(rows), V, generator=g) * 3
        want = [int(s(logits[i:i + 1], torch.tensor([[1, 2, 3]]))[0]) for i, s in enumerate(alone)]
        assert eng._sample(rows, logits) == want


def test_engine_prefix_cache_hits_on_a_shared_system_prompt(builtin):
    from dsq.runtime.engine import encode_prompt

    system = "You are a careful assistant. Answer in one short sentence, in plain English, without lists. " * 3
    ids = [encode_prompt(builtin, system + q) for q in ("What is rain?", "What is snow?", "What is hail?")]
    # one at a time: the first one's prompt blocks are indexed when the second arrives
    texts, usages, eng, reqs = _run_engine(builtin, ids, 4, kv_tokens=2048, block_size=16, max_seqs=1)
    m = eng.metrics()
    shared = len(ids[0]) - 8
    assert m["prefix_cache_hit_tokens"] >= 2 * (shared // 16) * 16 > 0
    assert max(u["prompt_tokens_details"]["cached_tokens"] for u in usages.values()) >= (shared // 16) * 16


def test_fp8_kv_holds_twice_the_tokens_at_a_small_quality_cost(builtin):
    """FP8 (e4m3, a scale per token and head) against float32 KV on held-out text: the prompt
    goes in four chunks, so later chunks attend over stored (rounded) keys/values. Measured on the
    built-in model: mean KLD 0.006, top-1 agreement 96%, ppl 24.32 against 24.23 (bf16: KLD 3e-5)."""
    from tests.tiny import held_out_text

    from dsq.runtime.engine import encode_prompt
    from dsq.serve.engine import Engine
    from dsq.serve.paged import FP8

    ratio = PagedKV.bytes_per_block(builtin.model, 16, torch.bfloat16) / PagedKV.bytes_per_block(builtin.model, 16, FP8)
    assert ratio >= 1.95
    mem = 64 << 20
    assert Engine(builtin, kv_bytes=mem, kv_dtype=FP8).pool.num_blocks >= \
        1.95 * Engine(builtin, kv_bytes=mem, kv_dtype=torch.bfloat16).pool.num_blocks
    ids = encode_prompt(builtin, held_out_text(3000))[:256]
    logp = {}
    for dt in (torch.float32, FP8):
        kv = PagedKV(builtin.model, 32, 16, 512, dt)
        table = list(range(17))
        out = [kv.forward([ids[i:i + 64]], [i], [table], every_position=True)[0] for i in range(0, 256, 64)]
        logp[dt] = torch.cat(out).float().log_softmax(-1)
    ref, q = logp[torch.float32], logp[FP8]
    kld = (ref.exp() * (ref - q)).sum(-1)
    assert kld.mean() < 0.02
    assert (ref.argmax(-1) == q.argmax(-1)).float().mean() >= 0.9
    nll = [-lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).mean() for lp in (ref, q)]
    assert nll[1] - nll[0] < 0.02  # perplexity within 2%
    texts, usages, _, _ = _run_engine(builtin, [encode_prompt(builtin, p) for p in PROMPTS], 8, kv_dtype=FP8)
    assert all(t.strip() for t in texts) and all(u["completion_tokens"] == 8 for u in usages.values())


def test_speculative_prompt_lookup_keeps_greedy_output(builtin):
    from dsq.runtime.engine import encode_prompt

    # prompts that repeat themselves, so the lookup finds drafts
    prompts = ["one two three four five six seven eight nine ten one two three four five six seven",
               "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return", PROMPTS[0]]
    ids = [encode_prompt(builtin, p) for p in prompts]
    off, _, _, _ = _run_engine(builtin, ids, 24)
    on, usages, eng, _ = _run_engine(builtin, ids, 24, spec_tokens=4, spec_max_rows=8)
    assert on == off
    c = eng.counters
    assert c["spec_draft_tokens"] > 0 and 0 < c["spec_accepted_tokens"] <= c["spec_draft_tokens"]
    assert eng.metrics()["kv_blocks_held"] == 0


def test_chunked_prefill_interleaves_a_long_prompt_with_decode_steps(builtin):
    """A 300-token prompt in 32-token chunks: the request already decoding gets a token every step
    while the long prompt goes in, instead of waiting for all of it."""
    from tests.tiny import held_out_text

    from dsq.runtime.engine import encode_prompt
    from dsq.runtime.sampling import SamplingParams
    from dsq.serve.engine import Engine, Request

    eng = Engine(builtin, kv_tokens=2048, prefill_chunk=32)
    log = []
    short = Request(encode_prompt(builtin, PROMPTS[0]), SamplingParams(temperature=0), 30,
                    lambda ev: log.append(("short", ev.kind, eng.counters["steps"])))
    long = Request(encode_prompt(builtin, held_out_text(2000))[:300], SamplingParams(temperature=0), 4,
                   lambda ev: log.append(("long", ev.kind, eng.counters["steps"])))
    eng.submit(short)
    eng.waiting.append(eng.inbox.popleft())
    eng.step()  # the short prompt is prefilled and decodes from here on
    eng.submit(long)
    eng.waiting.append(eng.inbox.popleft())
    while not (short.finished and long.finished):
        eng.step()
    first_long = min(s for who, kind, s in log if who == "long")
    during = {s for who, kind, s in log if who == "short" and kind == "text" and s < first_long}
    assert first_long >= 300 // 32  # the long prompt took ten steps to go in...
    assert len(during) >= first_long - 1  # ...and the short request got a token in (nearly) every one of them
    assert short.generated == 30 and long.generated == 4 and eng.metrics()["kv_blocks_held"] == 0


def test_a_reply_is_cached_for_the_next_turn(builtin):
    """The blocks of a finished request's prompt and reply are indexed: a prompt that continues
    the conversation finds them."""
    from dsq.runtime.engine import encode_prompt
    from dsq.runtime.sampling import SamplingParams
    from dsq.serve.engine import Request

    first = encode_prompt(builtin, PROMPTS[0])
    _, _, eng, reqs = _run_engine(builtin, [first], 40, block_size=16)
    done = reqs[0].tokens  # prompt and reply
    got = threading.Event()
    usage = {}
    follow = Request(done + builtin.tokenize(" And then?", add_bos=False), SamplingParams(temperature=0), 2,
                     lambda ev: ev.kind == "done" and (usage.update(ev.usage) or got.set()))
    eng.start()
    try:
        eng.submit(follow)
        assert got.wait(120)
    finally:
        eng.stop()
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > len(first) and cached >= (len(done) - 1) // 16 * 16 - 16


def test_gpu_clock_is_inert_off_a_gpu():
    from dsq.serve.engine import GpuClock

    clock = GpuClock(torch.device("cpu"))
    mark = clock.mark()
    clock.span("decode", mark)
    assert mark is None and clock.seconds == {"prefill": 0.0, "decode": 0.0} and not clock.pending


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU (run on the device)")
def test_gpu_clock_counts_the_gpu_time_of_each_kind_of_work():
    """GpuClock reads its events only once the GPU has passed them (no host sync): a matmul loop
    counted as prefill, a shorter one as decode; after a sync and one more span, both are in, in
    proportion, within the wall time."""
    from dsq.serve.engine import GpuClock

    clock = GpuClock(torch.device("cuda"))
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    for kind, n in (("prefill", 40), ("decode", 10)):
        mark = clock.mark()
        for _ in range(n):
            a = a @ a * 1e-3
        clock.span(kind, mark)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    clock.span("decode", clock.mark())  # an empty span: reads the finished ones
    p, d = clock.seconds["prefill"], clock.seconds["decode"]
    assert 0 < d < p < wall and 2.5 < p / d < 6 and len(clock.free) >= 4


def test_default_kv_cache_on_a_gpu_holds_every_sequence_as_far_as_memory_allows(tmp_path, monkeypatch):
    """dsq serve without --kv-tokens or --kv-memory: on a GPU the pool holds --max-seqs sequences of
    the whole context where KV_SHARE of the free memory holds them, else that share, never less than
    the CPU's 4 x --ctx tokens; on the CPU it leaves the engine's default (None)."""
    from types import SimpleNamespace

    from tests.tiny import build_tiny_model

    from dsq.runtime.native import NativeModel
    from dsq.serve import server

    nm = NativeModel(build_tiny_model("gemma3", tmp_path / "g"), "hf", n_ctx=128, cuda_graph=False, dtype="float32")
    assert server.default_kv_bytes(nm, 8, 16, None) is None
    gpu = SimpleNamespace(model=nm.model, n_ctx=128, head_device=torch.device("cuda"))
    per_block = PagedKV.bytes_per_block(nm.model, 16, torch.float32)
    need, floor = 8 * 9 * per_block, 32 * per_block  # 129 tokens a sequence: 9 blocks; 4 x 128 tokens: 32
    shared = int(need * server.KV_SHARE) // per_block * per_block  # 50 whole blocks
    # with a draft model (here the same model) its pool of as many blocks shares the room: 25 blocks
    # when 50 were left, under the floor
    for free, want, with_draft in ((100 * need, need, need), (need, shared, floor), (floor, floor, floor)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev, free=free: (free, 10 * free))
        assert server.default_kv_bytes(gpu, 8, 16, None) == want
        assert server.default_kv_bytes(gpu, 8, 16, None, draft=gpu) == with_draft
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (100 * need, 100 * need))
    half = PagedKV.bytes_per_block(nm.model, 16, torch.bfloat16)
    assert server.default_kv_bytes(gpu, 8, 16, torch.bfloat16) == 8 * 9 * half == need // 2
