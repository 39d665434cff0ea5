"""Speculative decoding with a draft model in `dsq serve` (`--draft MODEL`).

A second, small model that shares the target's vocabulary proposes the next `spec_tokens` tokens
of every greedy request, one batched step per token over its own paged KV pool (the target's
block size, its own blocks per request); the target then checks every request's draft in one
batched pass per draft length (`verify`): each row is the request's last token and its draft, run
at the request's position with every position's logits kept. A request keeps its draft up to the
first token the target would not have picked, then the target's own token, so greedy output is
the same as without speculation (the target's keys/values past the kept tokens are overwritten by
the next step, which starts at the request's `computed`).

The draft's cache follows each request: `Drafter.propose` first runs the request's tokens the
draft has not seen (the whole prompt the first time, in chunks; afterwards the one or two tokens
the last verification kept past the draft's own), then proposes. What the draft holds past the
tokens the target kept is forgotten by setting its computed count back (`_Seq.catch_up`), and
overwritten when the draft runs there again. Rows whose catch-up is short run together, padded to
the longest by starting earlier (re-running tokens the draft already holds: the draft's rounding
only changes what it proposes, never what the target outputs). Full blocks of a prompt the draft
ran are indexed by prefix hash in its pool, so a later request with the same prefix (a shared
system prompt) takes them instead of running them again.

Non-greedy requests (temperature > 0, or a repeat penalty) decode plainly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsq.errors import DsqError
from dsq.serve.paged import PagedKV

# a draft and target whose logit widths differ by at most this share a tokenizer whose embedding
# table one of them padded (llama.cpp's speculative decoding allows the same difference)
VOCAB_SLACK = 128
# text both tokenizers must split into the same ids: words, code, digits, accents, CJK, emoji
PROBES = ("Hello, world! The quick brown fox jumps over the lazy dog.",
          "def f(x):\n    return x ** 2  # 1234567890",
          "café naïve Straße 東京 Привет 🙂")


@dataclass(eq=False)
class _Seq:
    """One request's place in the draft's pool."""

    blocks: list[int] = field(default_factory=list)
    base: int = 0  # the draft holds keys/values of the request's tokens[:base]...
    fed: list[int] = field(default_factory=list)  # ...and then of these (its own proposals)

    def catch_up(self, tokens: list[int]) -> int:
        """How many of `tokens` the draft's cache holds: the ones it ran before, then its own
        proposals as far as the request kept them; never its last one (the draft runs it to
        propose what follows)."""
        n = min(self.base, len(tokens) - 1)
        for t in self.fed:
            if n >= len(tokens) - 1 or tokens[n] != t:
                break
            n += 1
        return n


def vocab_mismatch(target, draft) -> str | None:
    """Why `draft` (a NativeModel) cannot propose tokens for `target`, or None: their logit
    widths, special tokens, how they tokenize a few texts, and a handful of tokens spread over
    the vocabulary must agree."""
    vt, vd = target.model.args.vocab_size, draft.model.args.vocab_size
    if abs(vt - vd) > VOCAB_SLACK:
        return f"its vocabulary has {vd} tokens, the target's {vt}"
    for name in ("bos_token", "eos_token"):
        a, b = getattr(target, name), getattr(draft, name)
        if a != b:
            return f"its {name.replace('_token', '')} token is {b!r}, the target's {a!r}"
    for text in PROBES:
        a, b = target.tokenize(text, add_bos=False), draft.tokenize(text, add_bos=False)
        if a != b:
            return f"it splits {text!r} into tokens {b[:8]}..., the target into {a[:8]}..."
    n = min(vt, vd)
    for i in (n * k // 9 for k in range(1, 9)):
        a, b = target.detokenize([i]), draft.detokenize([i])
        if a and b and not (target.is_eog(i) or draft.is_eog(i)) and a != b:
            return f"its token {i} is {b!r}, the target's {a!r}"
    return None


def check_draft(target, draft, label: str) -> None:
    """Refuse a draft model that does not share the target's vocabulary (DsqError)."""
    why = vocab_mismatch(target, draft)
    if why:
        raise DsqError(f"--draft {label} does not share the target's vocabulary: {why}",
                       "pick a draft from the target's own family (the same tokenizer), e.g. a smaller or more "
                       "quantized sibling, or drop --draft")


class Drafter:
    """The draft model, its paged KV pool, and each running request's place in it."""

    def __init__(self, nm, *, num_blocks: int, block_size: int, max_len: int, vocab: int, prefill_chunk: int,
                 kv_dtype: torch.dtype | None = None):
        self.nm, self.block_size, self.prefill_chunk = nm, block_size, prefill_chunk
        self.vocab = vocab  # proposals stay below the target's vocabulary size
        self.kv = PagedKV(nm.model, num_blocks, block_size, max_len, kv_dtype)
        self.pool = self.kv.pool
        self.seqs: dict[object, _Seq] = {}
        # forward passes of the draft; rows whose draft the target checked; rows the draft's pool could not take
        self.counters = {"draft_forwards": 0, "draft_rows": 0, "draft_skipped_rows": 0}

    def metrics(self) -> dict:
        return {**self.counters, "draft_kv_blocks_total": self.pool.num_blocks,
                "draft_kv_blocks_held": sum(1 for r in self.pool.ref if r > 0),
                "draft_prefix_cache_hit_tokens": self.pool.hits,
                "draft_kv_bytes": self.pool.num_blocks * PagedKV.bytes_per_block(self.nm.model, self.block_size,
                                                                                 self.kv.dtype)}

    def sync(self, running) -> None:
        """Forget requests that no longer run (finished, cancelled, preempted): their blocks go
        back to the draft's pool (a preempted request starts over when it is admitted again)."""
        alive = set(running)
        for r in [r for r in self.seqs if r not in alive]:
            self.release(r)

    def release(self, r) -> None:
        """r is done (finished, cancelled, failed): its draft blocks go back to the pool."""
        s = self.seqs.pop(r, None)
        if s is not None:
            self.pool.release(s.blocks)

    def _forward(self, ids, starts, tables) -> list[int]:
        """The draft's greedy next token after each row."""
        self.counters["draft_forwards"] += 1
        return self.kv.forward(ids, starts, tables)[:, :self.vocab].argmax(-1).tolist()

    def _reserve(self, s: _Seq, upto: int) -> bool:
        """Blocks in s for positions < upto; False (nothing taken) when the pool lacks them."""
        need = -(-upto // self.block_size) - len(s.blocks)
        if need > self.pool.available():
            return False
        s.blocks += [self.pool.allocate() for _ in range(need)]
        return True

    @torch.inference_mode()
    def propose(self, rooms: dict) -> dict:
        """{request: draft tokens} for {request: room}: up to `room` tokens each, the draft
        model's greedy continuation of the request's tokens. A request the draft's pool cannot
        take this step gets none (it decodes plainly)."""
        first: dict = {}  # request -> the draft's next token after its tokens
        short: list = []  # (request, seq, how many of its last tokens the draft has yet to run)
        for r, room in rooms.items():
            s = self.seqs.get(r)
            t = r.tokens
            if s is None:  # full blocks of a prompt prefix the draft ran before are shared, as in the target's pool
                s = self.seqs[r] = _Seq()
                s.blocks = self.pool.match(t, len(t) - 1)
                s.base = len(s.blocks) * self.block_size
            have = s.catch_up(t)
            if not self._reserve(s, len(t) + room - 1):
                self.counters["draft_skipped_rows"] += 1
                continue
            s.base, s.fed = have, []
            todo = len(t) - have
            if todo <= room + 1:
                short.append((r, s, todo))
                continue
            # the prompt (or a long gap): alone, in chunks at multiples of prefill_chunk
            start = have
            while start < len(t):
                end = min(len(t), (start // self.prefill_chunk + 1) * self.prefill_chunk)
                nxt = self._forward([t[start:end]], [start], [s.blocks])[0]
                start = end
            first[r] = nxt
            self.pool.register(t, s.blocks)
        if short:
            width = max(todo for _, _, todo in short)
            fits = [(r, s) for r, s, _ in short if len(r.tokens) >= width]
            for r, s, todo in short:  # too short to pad back to the widest: alone
                if len(r.tokens) < width:
                    first[r] = self._forward([r.tokens[-todo:]], [len(r.tokens) - todo], [s.blocks])[0]
            if fits:
                out = self._forward([r.tokens[-width:] for r, _ in fits], [len(r.tokens) - width for r, _ in fits],
                                    [s.blocks for _, s in fits])
                first.update({r: tok for (r, _), tok in zip(fits, out)})
        drafts = {r: [tok] for r, tok in first.items()}
        for r in drafts:
            s = self.seqs[r]
            s.base = len(r.tokens)
        for j in range(1, max((rooms[r] for r in drafts), default=0)):
            rows = [r for r in drafts if rooms[r] > j]
            out = self._forward([[drafts[r][-1]] for r in rows], [len(r.tokens) + j - 1 for r in rows],
                                [self.seqs[r].blocks for r in rows])
            for r, tok in zip(rows, out):
                self.seqs[r].fed.append(drafts[r][-1])
                drafts[r].append(tok)
        return drafts


def spec_room(eng, r) -> int:
    """How many draft tokens r can be checked with this step: spec_tokens, within its
    max_tokens, the context, and the target's blocks (its own and the pool's free ones)."""
    bs = eng.block_size
    return min(eng.spec_tokens, r.max_tokens - r.generated - 1, eng.n_ctx - len(r.tokens) - 1,
               len(r.blocks) * bs - r.computed - 1 + bs * eng.pool.available())


def greedy(r) -> bool:
    """Sampling that speculation keeps exact: the argmax, no repeat penalty."""
    sp = r.sampling
    return sp.temperature == 0 and sp.repeat_penalty == 1.0


def decode_with_draft(eng, rows: list) -> None:
    """One decode step of `rows` (requests past their prompt, each with a block for its next
    token): greedy ones with room check the draft model's proposals, the rest decode plainly."""
    rooms = {}
    for r in rows:
        room = spec_room(eng, r) if greedy(r) else 0
        if room > 0:
            rooms[r] = room
            while (r.computed + room) // eng.block_size >= len(r.blocks):
                r.blocks.append(eng.pool.allocate())
    eng.drafter.sync(eng.running)
    drafts = eng.drafter.propose(rooms) if rooms else {}
    eng.decode_plain([r for r in rows if r not in drafts])
    verify(eng, drafts)


def verify(eng, drafts: dict) -> None:
    """Check every request's draft with the target, one batched pass per draft length: a row is
    the request's last token and its draft; it keeps the draft while it is what the target picks,
    then the target's own token."""
    by_len: dict[int, list] = {}
    for r, d in drafts.items():
        by_len.setdefault(len(d), []).append(r)
    c = eng.counters
    for n, rows in sorted(by_len.items()):
        logits = eng.kv.forward([[r.tokens[-1]] + drafts[r] for r in rows], [r.computed for r in rows],
                                [r.blocks for r in rows], every_position=True)
        for i, r in enumerate(rows):
            draft = drafts[r]
            c["spec_draft_tokens"] += n
            if eng.drafter is not None:
                eng.drafter.counters["draft_rows"] += 1
            for j in range(n + 1):
                r.computed += 1
                eng._take(r, logits[i, j:j + 1])
                if r.finished or j == n or r.tokens[-1] != draft[j]:
                    break
                c["spec_accepted_tokens"] += 1
