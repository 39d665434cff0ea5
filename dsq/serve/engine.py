"""The serving engine: one loop, on its own thread, over a paged KV cache (continuous batching).

Every step it
1. takes in new requests and drops cancelled ones (a client that went away), freeing their blocks;
2. admits waiting requests, oldest first, while the pool has blocks for their prompt (after the
   prefix cache's share) and fewer than `max_seqs` run;
3. runs up to `prefill_chunk` prompt tokens of admitted requests (chunked prefill: a long prompt
   enters over several steps, between the running requests' decode steps), each request alone
   (B = 1, as `dsq run` prefills). With captured steps of more rows than sequences (a GPU, a
   model whose passes have no host sync: dense, or its routed experts fused; mixed_sizes;
   DSQ_SERVE_MIXED=0 turns them off), every prompt token goes into step 4 instead, a row a
   token, up to prefill_chunk tokens a step: one pass over the weights a step. With captured
   decode steps alone, a remainder of up to PACK_TOKENS tokens (a repeated prompt past the
   prefix cache's blocks, a short prompt) goes so; with captured prompt chunks, a chunk runs as
   the pieces whose replays the warm-up timed cheapest in all (PagedKV.plan_pieces: 300 tokens
   as 256 + 44 rather than padded to 512);
4. runs one decode step for every request past its prompt, together (B = rows), after giving
   each the block its next token needs; when the pool is empty the newest request is preempted
   (its blocks freed, its prompt and generated tokens recomputed when it is admitted again: its
   keys/values then come from a prefill, not from decode steps, so a greedy continuation may
   differ from the one it would have had in rare near-ties).
5. with speculative decoding by prompt lookup (`spec_tokens` > 0), a greedy request whose last
   n tokens (n = 3, 2, 1) occurred earlier in its prompt or reply proposes the up to
   `spec_tokens` tokens that followed them; one forward pass over its last token and the draft
   checks them all: the draft is kept up to the first token the model would not have picked,
   which is replaced by the model's own. Greedy output is the same with it on and off. Only while
   at most `spec_max_rows` requests decode (each draft is checked in a pass of its own).
   With a draft model (`draft`, serve/draft.py) the draft model proposes instead, for every
   greedy request, and the target checks all drafts in one batched pass (no row limit).

A request's state: `tokens` (prompt, then generated), `computed` (tokens whose keys/values are
in its blocks), `target` (len(tokens) when it was admitted). Prefilling while computed < target;
then decoding, with computed == len(tokens) - 1 (the last sampled token is not yet run). Events go
back through the request's `emit`, called on the engine's thread.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from dsq.runtime.generate import StopMatcher
from dsq.runtime.sampling import Sampler, SamplingParams, argmax, filtered
from dsq.serve.draft import greedy, spec_room, verify
from dsq.serve.paged import PagedKV

_RECENT = 64  # tokens the repeat penalty looks back over (as dsq run)
# speculative steps only while at most this many requests decode: a request's draft is checked in a
# pass of its own, which beats one row of the batched step only while the batch is small
# (docs/benchmarks.md#dsq-serve)
SPEC_MAX_ROWS = 2
# prompt remainders up to this many tokens (what the prefix cache leaves of a repeated prompt: under
# a block) run as rows of the captured decode step instead of a prefill pass of their own, whose
# host time (~47 ms of the 71 ms an 8B model's 512-token chunk took eagerly) hardly depends on its
# length (docs/benchmarks.md#dsq-serve); one block, not tuned
PACK_TOKENS = 16


class GpuClock:
    """The GPU's own time in each kind of work the loop queues (prompt chunks, decode steps), from
    CUDA events recorded around it and read once they have passed, so timing adds no host sync.
    The loop's host timers cannot split this: a decode step's sampling waits for the prompt chunks
    queued before it as well as for its own kernels. Off a GPU it does nothing."""

    def __init__(self, device: torch.device):
        self.on = device.type == "cuda"
        self.seconds = {"prefill": 0.0, "decode": 0.0}
        self.pending: deque = deque()
        self.free: list = []

    def mark(self):
        """An event recorded on the current stream now (None off a GPU)."""
        if not self.on:
            return None
        e = self.free.pop() if self.free else torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def span(self, kind: str, start) -> None:
        """The work queued since `start` (a mark) counts as `kind` once the GPU has run it."""
        if start is None:
            return
        self.pending.append((kind, start, self.mark()))
        while self.pending and self.pending[0][2].query():
            k, a, b = self.pending.popleft()
            self.seconds[k] += a.elapsed_time(b) / 1e3
            self.free += (a, b)


@dataclass
class Event:
    kind: str  # "text", "done" or "error" (and the API's own "gone": its client left)
    text: str = ""
    finish_reason: str | None = None
    usage: dict | None = None


@dataclass(eq=False)
class Request:
    prompt: list[int]
    sampling: SamplingParams
    max_tokens: int
    emit: Callable[[Event], None]
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    id: int = field(default_factory=itertools.count().__next__)
    # engine state
    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    target: int = 0  # tokens to prefill since admission (prompt, and generated ones after a preemption)
    generated: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    cancelled: bool = False
    finished: bool = False
    sampler: Sampler | None = None
    detok: object = None
    stopper: StopMatcher | None = None
    t_submit: float = 0.0


def _decoding(r: Request) -> bool:
    """r's prompt is in and its last sampled token waits for the next decode step."""
    return not r.finished and r.computed == len(r.tokens) - 1


class Engine:
    def __init__(self, nm, *, kv_tokens: int | None = None, kv_bytes: int | None = None, block_size: int = 16,
                 max_seqs: int = 32, prefill_chunk: int = 512,
                 prefix_cache: bool = True, kv_dtype: torch.dtype | None = None, n_ctx: int | None = None,
                 spec_tokens: int = 0, spec_ngram: int = 3, spec_max_rows: int = SPEC_MAX_ROWS, draft=None,
                 ranks=None):
        """ranks: the other ranks of a model split over several (serve/tp.py Ranks), which run
        every step with this one."""
        self.nm, self.model, self.tok = nm, nm.model, nm.tokenizer
        self.n_ctx = min(n_ctx or nm.n_ctx, nm.n_ctx)  # the pool always holds one sequence this long
        self.block_size, self.max_seqs = block_size, max_seqs
        self.prefill_chunk, self.prefix_cache = prefill_chunk, prefix_cache
        self.spec_tokens, self.spec_ngram, self.spec_max_rows = spec_tokens, spec_ngram, spec_max_rows
        dt = kv_dtype or self.model.dtype
        if kv_bytes is not None:  # as many blocks as the memory holds in this dtype
            num_blocks = kv_bytes // PagedKV.bytes_per_block(self.model, block_size, dt)
        else:
            num_blocks = -(-(kv_tokens or 4 * self.n_ctx) // block_size)
        num_blocks = max(num_blocks, -(-self.n_ctx // block_size) + 1)
        self.ranks = ranks
        make = ranks.leader if ranks is not None else PagedKV
        self.kv = make(self.model, num_blocks, block_size, self.n_ctx + block_size, kv_dtype)
        self.pool = self.kv.pool
        self.device = nm.head_device
        self.drafter = self._drafter(draft, num_blocks, kv_dtype) if draft is not None else None
        # prompt tokens (request, up to an end) _prefill left to this step's decode pass
        self.packed: list[tuple[Request, int]] = []
        self.inbox: deque[Request] = deque()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.cv = threading.Condition()
        self.stopping = False
        self.thread: threading.Thread | None = None
        self.counters = {"requests": 0, "finished": 0, "cancelled": 0, "preempted": 0, "prompt_tokens": 0,
                         "generated_tokens": 0, "steps": 0, "failed": 0, "spec_draft_tokens": 0,
                         "spec_accepted_tokens": 0, "packed_prompt_tokens": 0, "chunk_tokens": 0,
                         "chunk_padded_tokens": 0, "chunks": 0}
        # seconds of the loop's time: whole steps, their prompt chunks, decode steps, and inside those
        # the sampling (which waits for the GPU's step) and handing tokens on (detokenize, stops, emit)
        self.timing = dict.fromkeys(("step", "prefill", "decode", "sync", "emit"), 0.0)
        self.gpu = GpuClock(self.device)

    def _drafter(self, draft, num_blocks: int, kv_dtype):
        """The draft model's pool: as many blocks as the target's, in the draft's own dtype
        unless kv_dtype says otherwise (a small draft's blocks are a fraction of the target's;
        its bytes come on top of --kv-memory, the startup line and /metrics give them)."""
        from dsq.serve.draft import Drafter

        vocab = min(self.model.args.vocab_size, draft.model.args.vocab_size)
        return Drafter(draft, num_blocks=num_blocks, block_size=self.block_size, max_len=self.n_ctx + self.block_size,
                       vocab=vocab, prefill_chunk=self.prefill_chunk, kv_dtype=kv_dtype)

    # -- outside the loop (any thread) ----------------------------------------------------
    def warm_up(self) -> dict:
        """Run the decode step once at each batch size of the kernels' row buckets (1, 2, 4, ...
        up to max_seqs) and prompt chunks of lengths 2^i and 2^i + 1 up to prefill_chunk, on blocks
        taken from the pool and given back, before the first request; then, where it can
        (graphable), capture the decode step of each batch size and, for a model whose passes of
        any length have no host sync (model.prefill_graph_safe), steps of more rows that carry
        prompt tokens too (mixed_sizes; DSQ_SERVE_MIXED=0: not) and prompt chunks of 16, 32, ...
        tokens up to prefill_chunk, each length's replay timed to plan how chunks split
        (PagedKV.time_chunks); each captured step's replay is timed too, and a step that costs
        more than one of more rows is dropped (PagedKV.time_graphs). On a GPU each new row bucket
        autotunes its Triton kernels, compiling every candidate on a cold cache: inside the first
        requests that took minutes, so every request timed out or waited
        (docs/benchmarks.md#dsq-serve). Returns the batch sizes and chunk lengths run, and the
        sizes captured (those kept). Call before start()."""
        sizes = sorted({1 << i for i in range(self.max_seqs.bit_length()) if 1 << i < self.max_seqs} | {self.max_seqs})
        sizes = [b for b in sizes if b <= self.pool.available()]
        top = min(self.prefill_chunk, self.n_ctx - 1)
        # a length at each end of every power-of-two bucket: the kernels' autotune keys bucket the rows so
        chunks = sorted({t for i in range(1, top.bit_length()) for t in (1 << i, (1 << i) + 1) if t < top} | {top})
        chunks = [t for t in chunks if -(-t // self.block_size) <= self.pool.available()]
        clock = [time.perf_counter()]

        def lap() -> float:  # seconds since the last lap
            clock.append(time.perf_counter())
            return round(clock[-1] - clock[-2], 2)

        seconds = {}
        with torch.inference_mode():
            for b in sizes:  # one token a sequence at position 0, a block each
                blocks = [self.pool.allocate() for _ in range(b)]
                try:
                    self.kv.forward([[t] for t in self.kv.filler_ids(b)], [0] * b, [[blk] for blk in blocks])
                finally:
                    self.pool.release(blocks)
            for t in chunks:
                blocks = [self.pool.allocate() for _ in range(-(-t // self.block_size))]
                try:
                    self.kv.forward([self.kv.filler_ids(t)], [0], [blocks])
                finally:
                    self.pool.release(blocks)
        graphs, chunk_graphs = [], []
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            seconds["kernels"] = lap()
            if self.graphable():
                # steps of more rows than PAIRS_ROWS and prompt chunks are captured only where they
                # have no host sync: dense models, and MoE models whose experts' grouped GEMMs are
                # fused (model.prefill_graph_safe: the experts' counts stay on the device)
                chunked = self.model.prefill_graph_safe
                # mixed steps: 2.4x llama-server's output at 32 requests, against 1.9x without
                # (docs/benchmarks.md#dsq-serve)
                mixed = chunked and os.environ.get("DSQ_SERVE_MIXED", "1") != "0"
                self.kv.capture(sizes + (self.mixed_sizes(top) if mixed else []), seqs=self.max_seqs)
                seconds["decode graphs"] = lap()
                graphs = sorted(self.kv.time_graphs())
                seconds["timing steps"] = lap()
                if chunked:
                    lengths = sorted({1 << i for i in range(4, top.bit_length()) if 1 << i < top} | {top})
                    chunk_graphs = self.kv.capture_chunks(lengths)
                    seconds["chunk graphs"] = lap()
                    if chunk_graphs:
                        self.kv.time_chunks()
                        seconds["timing chunks"] = lap()
        return {"decode": sizes, "prefill": chunks, "graphs": graphs, "chunk_graphs": chunk_graphs,
                "seconds": seconds}

    def mixed_sizes(self, top: int) -> list[int]:
        """Rows of the captured steps that carry prompt tokens beside up to max_seqs decode rows
        (Engine._prefill packs up to `top` a step): powers of two and their halfway points past
        max_seqs, up to max_seqs + top. One pass over the weights a step instead of a decode pass
        plus a prompt chunk's: each pass costs ~11 ms on an 8B Q4_K_M model however few its
        tokens (docs/benchmarks.md#dsq-serve)."""
        hi = self.max_seqs + top
        cands = {m for i in range(1, hi.bit_length() + 1) for m in (1 << i, 3 << (i - 1))}
        return sorted({m for m in cands if self.max_seqs < m < hi} | {hi})

    def graphable(self) -> bool:
        """Whether the decode step can be captured (PagedKV.capture): every layer and the head on
        one GPU, a step the same kernels whatever the tokens (model.graph_safe), routed experts
        not in RAM, one rank (--tp: every rank would have to capture and keep the same steps);
        DSQ_SERVE_GRAPHS=0 keeps it eager."""
        if self.ranks is not None:
            return False
        devs = {str(d) for d in self.model.layer_devices()} | {str(self.device)}
        return (os.environ.get("DSQ_SERVE_GRAPHS", "1") != "0" and self.device.type == "cuda" and len(devs) == 1
                and self.model.graph_safe and getattr(self.nm, "experts", None) != "cpu")

    def start(self) -> None:
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="dsq-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify()
        if self.thread is not None:
            self.thread.join(timeout=30)

    def submit(self, req: Request) -> None:
        req.tokens = list(req.prompt)
        req.t_submit = time.perf_counter()
        with self.cv:
            self.inbox.append(req)
            self.cv.notify()

    def cancel(self, req: Request) -> None:
        with self.cv:
            req.cancelled = True
            self.cv.notify()

    def metrics(self) -> dict:
        p = self.pool
        own = int(self.kv.scratch is not None)  # the captured steps' padding block: never a sequence's
        held = sum(1 for r in p.ref if r > 0) - own
        return {**self.counters, "running": len(self.running), "waiting": len(self.waiting) + len(self.inbox),
                "kv_blocks_total": p.num_blocks - own, "kv_blocks_held": held, "kv_blocks_cached": len(p.evictable),
                "kv_block_size": self.block_size, "kv_dtype": str(self.kv.dtype).removeprefix("torch."),
                "kv_bytes": p.num_blocks * PagedKV.bytes_per_block(self.model, self.block_size, self.kv.dtype),
                "prefix_cache_lookup_tokens": p.lookups,
                "prefix_cache_hit_tokens": p.hits, "prefix_cache_hit_rate": round(p.hit_rate, 4),
                "spec_acceptance_rate": round(self.counters["spec_accepted_tokens"]
                                              / max(1, self.counters["spec_draft_tokens"]), 4),
                "spec_method": "off" if not self.spec_tokens else "draft" if self.drafter else "lookup",
                **{f"time_{k}_s": round(v, 4) for k, v in self.timing.items()},
                **{f"gpu_time_{k}_s": round(v, 4) for k, v in self.gpu.seconds.items() if self.gpu.on},
                **(self.drafter.metrics() if self.drafter else {})}

    # -- the loop -------------------------------------------------------------------------
    def _loop(self) -> None:
        from dsq.kernels import cpu

        torch.set_grad_enabled(False)
        # torch's (OpenMP's) and the C kernels' thread counts are per OS thread: this one gets the
        # model's, so each op splits its work (and rounds) as in dsq run
        torch.set_num_threads(self.nm.n_threads)
        if cpu.available():
            cpu.set_threads(self.nm.n_threads)
        while True:
            with self.cv:
                while not (self.stopping or self.inbox or self.waiting or self.running):
                    self.cv.wait()
                if self.stopping:
                    break
                while self.inbox:
                    self.waiting.append(self.inbox.popleft())
                    self.counters["requests"] += 1
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - a bug in a step fails its requests, not the server
                traceback.print_exc()
                for r in list(self.running) + list(self.waiting):
                    self._fail(r, f"internal error: {type(e).__name__}: {e}")
                self.running, self.waiting = [], deque()
        for r in list(self.running) + list(self.waiting) + list(self.inbox):
            self._fail(r, "the server is shutting down")

    def step(self) -> None:
        clock, tm = time.perf_counter, self.timing
        t0 = clock()
        self._drop_cancelled()
        self._admit()
        t1 = clock()
        mark = self.gpu.mark()
        self._prefill()
        self.gpu.span("prefill", mark)
        t2 = clock()
        mark = self.gpu.mark()
        self._decode()
        self.gpu.span("decode", mark)
        t3 = clock()
        if self.drafter is not None:  # preempted requests' draft blocks go back too
            self.drafter.sync(self.running)
        for r in [r for r in self.running if not (r.computed < r.target or _decoding(r))]:
            # neither prefilling nor decoding, it could never progress (a bug's state): fail it
            # rather than keep its client waiting and the loop spinning
            self._fail(r, f"internal error: request {r.id} stalled ({r.computed} of {len(r.tokens)} tokens computed)")
        self.counters["steps"] += 1
        tm["prefill"] += t2 - t1
        tm["decode"] += t3 - t2
        tm["step"] += clock() - t0

    def _drop_cancelled(self) -> None:
        for r in [r for r in self.running if r.cancelled]:
            self._retire(r)
            self.counters["cancelled"] += 1
        for r in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(r)
            self.counters["cancelled"] += 1

    def _admit(self) -> None:
        bs = self.block_size
        while self.waiting and len(self.running) < self.max_seqs:
            r = self.waiting[0]
            n = len(r.tokens)
            matched = self.pool.match(r.tokens, n - 1) if self.prefix_cache else []
            need = -(-(n + 1) // bs) - len(matched)
            # keep a block per running sequence in reserve, so admitting does not force preemption at once
            if need > self.pool.available() - len(self.running):
                self.pool.release(matched)
                if not self.running:  # nothing will free blocks: cannot happen with a pool >= the context
                    self.waiting.popleft()
                    self._fail(r, "the KV cache cannot hold this request")
                    continue
                break
            self.waiting.popleft()
            r.blocks = matched + [self.pool.allocate() for _ in range(-(-n // bs) - len(matched))]
            r.computed, r.target = len(matched) * bs, n
            r.cached_tokens = max(r.cached_tokens, r.computed) if r.generated == 0 else r.cached_tokens
            if r.sampler is None:
                r.sampler = Sampler(r.sampling, self.device)
                r.detok = self.tok.stream()
                r.stopper = StopMatcher(r.stop)
                self.counters["prompt_tokens"] += len(r.prompt)
            self.running.append(r)

    def _prefill(self) -> None:
        budget = self.prefill_chunk
        # with captured decode steps, prompt tokens ride in this step's decode pass as rows of
        # their own while the largest graph has rows to spare (_decode): all of them, up to the
        # budget, where the warm-up captured graphs of more rows than sequences (mixed steps);
        # else a remainder of up to PACK_TOKENS tokens
        cap = max(self.kv.graphs) if self.kv.graphs and not self.spec_tokens else 0
        mixed = cap > self.max_seqs
        rows = sum(1 for r in self.running if _decoding(r))
        for r in list(self.running):
            n = r.target
            while r.computed < n and not r.finished:
                take = min(n - r.computed, cap - rows, budget) if mixed else n - r.computed
                if take > 0 and (mixed or (take <= PACK_TOKENS and rows + take <= cap)):
                    self.packed.append((r, r.computed + take))
                    rows += take
                    budget -= take
                    break
                if budget <= 0 or mixed:
                    break
                # chunk boundaries at multiples of prefill_chunk, as dsq run's prefill has them; with
                # captured chunks, the cheapest first piece of that (PagedKV.plan_pieces)
                end = min(n, (r.computed // self.prefill_chunk + 1) * self.prefill_chunk, r.computed + budget)
                end = self.kv.chunk_end(r.computed, end)
                logits = self.kv.forward([r.tokens[r.computed:end]], [r.computed], [r.blocks])
                self.counters["chunks"] += 1
                self.counters["chunk_tokens"] += end - r.computed
                self.counters["chunk_padded_tokens"] += self.kv.chunk_length(end - r.computed)
                budget -= end - r.computed
                r.computed = end
                if end == n:
                    if self.prefix_cache:
                        self.pool.register(r.tokens[:n], r.blocks)
                    self._take(r, logits[0:1])

    def _decode(self) -> None:
        # a prompt with one token left looks like a decoding row (that token is the step's input);
        # when _prefill packed it, the packed rows run it, and it must not be sampled twice
        packing = {id(r) for r, _ in self.packed}
        rows = [r for r in self.running if _decoding(r) and id(r) not in packing]
        if not rows and not self.packed:
            return
        bs = self.block_size
        for r in list(rows):
            if r not in self.running:  # preempted below for an older row
                continue
            while r.computed // bs >= len(r.blocks):
                if self.pool.available() == 0 and not self._preempt(exclude=r):
                    break
                r.blocks.append(self.pool.allocate())
        rows = [r for r in rows if r in self.running and r.computed // bs < len(r.blocks)]
        packed, self.packed = [(r, e) for r, e in self.packed if r in self.running and r.computed < e], []
        if packed:  # (no speculation then: _prefill packs only without it)
            return self.decode_plain(rows, packed)
        if self.drafter is not None and self.spec_tokens:
            from dsq.serve.draft import decode_with_draft

            return decode_with_draft(self, rows)
        drafts = {r: self._draft(r) for r in rows} if self.spec_tokens and len(rows) <= self.spec_max_rows else {}
        drafts = {r: d for r, d in drafts.items() if d}
        self.decode_plain([r for r in rows if r not in drafts])
        for r, draft in drafts.items():  # a pass each (SPEC_MAX_ROWS)
            verify(self, {r: draft})

    def decode_plain(self, rows: list[Request], packed: list[tuple[Request, int]] | None = None) -> None:
        """One decode step of each row's last token, batched, without speculation; `packed`
        (request, end) pairs' prompt tokens up to `end` ride along as a row each (a row attends
        over its sequence up to its own position, and every row's keys/values are written before
        any row's attention reads them: the causal prefill), the logits of a prompt's last row
        sampled."""
        packed = packed or []
        if not rows and not packed:
            return
        ids, starts = [r.tokens[-1] for r in rows], [r.computed for r in rows]
        seq, tables = list(range(len(rows))), [r.blocks for r in rows]
        keep, done = list(range(len(rows))), []
        for r, end in packed:
            ids += r.tokens[r.computed:end]
            starts += range(r.computed, end)
            seq += [len(tables)] * (end - r.computed)
            tables.append(r.blocks)
            if end == r.target:
                keep.append(len(ids) - 1)
                done.append(r)
            self.counters["packed_prompt_tokens"] += end - r.computed
        logits = self.kv.forward_rows(ids, starts, seq, tables, keep)
        for r in rows:
            r.computed += 1
        for r, end in packed:
            r.computed = end
            if end == r.target and self.prefix_cache:
                self.pool.register(r.tokens[:r.target], r.blocks)
        t0 = time.perf_counter()
        picks = self._sample(rows + done, logits)
        t1 = time.perf_counter()
        for r, t in zip(rows + done, picks):
            self._accept(r, t)
        self.timing["sync"] += t1 - t0
        self.timing["emit"] += time.perf_counter() - t1

    def _draft(self, r: Request) -> list[int]:
        """Prompt lookup: the tokens that followed the latest earlier occurrence of r's last n
        tokens (longest n first), for a greedy request, as many as its blocks can take."""
        if not greedy(r):
            return []
        t, bs = r.tokens, self.block_size
        room = spec_room(self, r)
        if room <= 0:
            return []
        for n in range(min(self.spec_ngram, len(t) - 1), 0, -1):
            tail = t[-n:]
            for i in range(len(t) - n - 1, -1, -1):
                if t[i:i + n] == tail:
                    draft = t[i + n:i + n + room]
                    while (r.computed + len(draft)) // bs >= len(r.blocks):
                        r.blocks.append(self.pool.allocate())
                    return draft
        return []

    def _preempt(self, exclude: Request) -> bool:
        """Free the newest running request's blocks (it is prefilled again later); False when
        nothing else runs."""
        for victim in reversed(self.running):
            if victim is not exclude:
                self.running.remove(victim)
                self.pool.release(victim.blocks)
                victim.blocks, victim.computed = [], 0
                victim.preemptions += 1
                self.waiting.appendleft(victim)
                self.counters["preempted"] += 1
                return True
        return False

    def _sample(self, rows: list[Request], logits: torch.Tensor) -> list[int]:
        """Row i's next token from logits[i] (B, V), with one host sync for the step: the greedy
        rows' argmax in one call, the rows of each sampling setting filtered in one call, then a
        draw a row on its own generator (the engine's own time beside the forward pass, mostly a
        sampler call and a sync a row, was ~0.6 ms a row on a GPU: docs/benchmarks.md#dsq-serve); rows with a repeat penalty through their samplers."""
        order: list[int] = []
        parts: list[torch.Tensor] = []
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(rows):
            sp = r.sampling
            if sp.repeat_penalty == 1.0:
                key = () if sp.temperature == 0 else (sp.temperature, sp.top_k, sp.top_p, sp.min_p)
                groups.setdefault(key, []).append(i)
        for key, idx in groups.items():
            sel = logits if len(idx) == len(rows) else logits[idx]
            if not key:
                parts.append(argmax(sel))
            else:
                probs, ids = filtered(rows[idx[0]].sampling, sel.float())
                parts += [rows[i].sampler.draw(probs[j:j + 1], None if ids is None else ids[j:j + 1]).view(1)
                          for j, i in enumerate(idx)]
            order += idx
        for i, r in enumerate(rows):
            if r.sampling.repeat_penalty != 1.0:
                recent = torch.tensor([r.tokens[-_RECENT:]], device=logits.device)
                parts.append(r.sampler(logits[i:i + 1], recent).view(1))
                order.append(i)
        picks = [0] * len(rows)
        for i, t in zip(order, torch.cat(parts).tolist() if parts else []):
            picks[i] = t
        return picks

    def _take(self, r: Request, logits: torch.Tensor) -> None:
        """Sample r's next token from its logits (1, V) and hand its text on."""
        self._accept(r, self._sample([r], logits)[0])

    def _accept(self, r: Request, t: int) -> None:
        """r's next token t: appended, its text handed on, r finished at a stop or its limit."""
        if not r.ignore_eos and self.tok.is_eog(t):
            return self._finish(r, "stop")
        r.tokens.append(t)
        r.generated += 1
        self.counters["generated_tokens"] += 1
        text, stopped = r.stopper.feed(r.detok.push(t))
        if text:
            r.emit(Event("text", text))
        if stopped:
            return self._finish(r, "stop", flush=False)
        if r.generated >= r.max_tokens or len(r.tokens) >= self.n_ctx:
            self._finish(r, "length")

    def _finish(self, r: Request, reason: str, flush: bool = True) -> None:
        if flush:
            text, stopped = r.stopper.feed(r.detok.flush())
            text += "" if stopped else r.stopper.flush()
            if text:
                r.emit(Event("text", text))
            if stopped:
                reason = "stop"
        if self.prefix_cache:  # the reply's full blocks too: the next turn of a chat starts with it
            self.pool.register(r.tokens[:r.computed], r.blocks)
        usage = {"prompt_tokens": len(r.prompt), "completion_tokens": r.generated,
                 "total_tokens": len(r.prompt) + r.generated,
                 "prompt_tokens_details": {"cached_tokens": r.cached_tokens}}
        self._retire(r)
        self.counters["finished"] += 1
        r.emit(Event("done", finish_reason=reason, usage=usage))

    def _retire(self, r: Request) -> None:
        r.finished = True
        if r in self.running:
            self.running.remove(r)
        self.pool.release(r.blocks)
        r.blocks = []
        if self.drafter is not None:
            self.drafter.release(r)

    def _fail(self, r: Request, message: str) -> None:
        self._retire(r)
        self.counters["failed"] += 1
        r.emit(Event("error", message))
