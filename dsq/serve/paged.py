"""The paged KV cache of `dsq serve`: keys and values in fixed-size blocks from one pool, a block
table per sequence, full blocks shared between sequences by hash of their token prefix.

- `BlockPool` hands out block ids: free blocks first, then cached blocks no sequence holds
  (least recently freed first, forgetting their hash). A block a sequence holds has a reference
  count; a full prompt block is registered under the hash of (its parent's hash, its tokens), so a
  later prompt with the same prefix takes it instead of recomputing it.
- `PagedKV` holds the pool's tensors, (num_blocks, Hk, block, D) per layer, and runs a step of
  several sequences (each at its own position, all with the same number of new tokens) through a
  llama-family model's decoder layers: each layer's `cache.update` writes the new keys/values into
  the sequences' blocks and returns every sequence's keys/values gathered over its block table
  (padded to the longest, the padding masked), which the model's own attention reads: the CPU
  path. On a GPU a decode step's attention reads the blocks in place instead (`attend`: the
  Triton paged kernel, kernels/triton_attn.py paged_attn_decode).
- FP8 (`dtype=FP8`): keys and values stored as float8 e4m3, each token's head scaled by its own
  absmax / 448 (a float32 scale per token and head, D / 4 + 1 bytes against 2 D for bf16 when D is
  the head width: twice the tokens in the same memory, bytes_per_block); dequantized when gathered.
- DeepSeek's MLA (the model's Cache is MLACache): the blocks hold its latent rows instead,
  (num_blocks, 1, block, kv_lora_rank + qk_rope_head_dim) per layer and no values (the pool's
  widths are the model cache's `slot_shapes`), which the model's MLAttention reads as it reads its
  own cache (absorbed or plain by its token and cache counts): 576 values a token and layer for
  V3, where its 128 heads' keys and values would be 40,960. FP8 scales each latent row by its
  absmax, as a key head.
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict

import torch

from dsq.kernels import dispatch
from dsq.models.base import KVCache, Transformer, rope_tables

FP8 = torch.float8_e4m3fn
FP8_NAMES = ("fp8", "fp8_e4m3", "e4m3")  # --kv-dtype's names for it
FP8_MAX = 448.0  # the largest finite e4m3 value
# cache spans a captured prompt chunk attends over (and the longest context): a chunk attends over a
# span padded up to one of these, each doubling the last, so a short prompt never pays for the
# longest context's attention, at one graph a span; chosen, not yet timed (docs/benchmarks.md#dsq-serve)
CHUNK_SPANS = (512, 1024, 2048)


class BlockPool:
    """Block ids with reference counts and a prefix-hash index of full blocks."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() takes block 0 first
        self.ref = [0] * num_blocks
        self.hash_of: dict[int, int] = {}  # block -> its prefix hash (registered blocks only)
        self.by_hash: dict[int, int] = {}  # prefix hash -> block
        self.evictable: OrderedDict[int, None] = OrderedDict()  # registered blocks nobody holds, oldest first
        self.lookups = 0  # prompt tokens looked up in the prefix index
        self.hits = 0  # of which found in cached blocks

    def available(self) -> int:
        """Blocks an allocation can take now (free, or cached and unheld)."""
        return len(self.free) + len(self.evictable)

    def used(self) -> int:
        return self.num_blocks - self.available()

    def allocate(self) -> int:
        if self.free:
            b = self.free.pop()
        elif self.evictable:
            b, _ = self.evictable.popitem(last=False)
            del self.by_hash[self.hash_of.pop(b)]
        else:
            raise MemoryError("no free KV block")
        self.ref[b] = 1
        return b

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self.hash_of:
                    self.evictable[b] = None
                else:
                    self.free.append(b)

    @staticmethod
    def chain(parent: int | None, tokens: list[int]) -> int:
        return hash((parent, tuple(tokens)))

    def match(self, tokens: list[int], limit: int) -> list[int]:
        """The cached blocks holding the longest run of full blocks of `tokens`' prefix, at most
        `limit` tokens' worth, each now held once more by the caller."""
        bs, out, parent = self.block_size, [], None
        for i in range(min(limit, len(tokens)) // bs):
            h = self.chain(parent, tokens[i * bs:(i + 1) * bs])
            b = self.by_hash.get(h)
            if b is None:
                break
            out.append(b)
            parent = h
        for b in out:
            if self.ref[b] == 0:
                del self.evictable[b]
            self.ref[b] += 1
        self.lookups += len(tokens)
        self.hits += len(out) * bs
        return out

    def register(self, tokens: list[int], blocks: list[int]) -> None:
        """Index the full blocks of a sequence's tokens (their keys/values are written)."""
        bs, parent = self.block_size, None
        for i in range(len(tokens) // bs):
            h = self.chain(parent, tokens[i * bs:(i + 1) * bs])
            b = blocks[i]
            if h not in self.by_hash and b not in self.hash_of:
                self.by_hash[h], self.hash_of[b] = b, h
            parent = h

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


def _padded(table: list[int], n: int) -> list[int]:
    """A sequence's block table cut or padded to n blocks (the padding repeats its first block: any
    block serves, the mask hides it)."""
    return table[:n] + [table[0]] * (n - len(table[:n]))


def supported(model) -> bool:
    """Whether `model` is one whose layers PagedKV can drive: the llama-family attention over a
    plain KV cache, or DeepSeek's MLA over its latent cache (both write and read their cache
    through `update` only)."""
    from dsq.models.deepseek_model import MLACache

    return isinstance(model, Transformer) and model.Cache in (KVCache, MLACache)


class _StepCache:
    """What one step's layers see as their cache (`update`), over the pool's blocks."""

    def __init__(self, kv: "PagedKV", write_at: torch.Tensor, gather: torch.Tensor, kv_len: int,
                 lens: torch.Tensor, seq: torch.Tensor | None = None):
        self.kv, self.write_at, self.gather, self.kv_len, self.lens = kv, write_at, gather, kv_len, lens
        self.seq = seq  # each row's sequence, where rows of one sequence share a step (mixed steps)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
               softcap: float | None):
        """On a GPU, a decode step's attention straight over the blocks (the Triton paged
        kernel: no gathered copy), after writing k, v (B, Hk, 1, D); None elsewhere (the layer
        then calls update and its own attention)."""
        kp, vp = self.kv.k[layer], self.kv.v[layer]
        if not (self.kv.paged_kernel and q.shape[1] == 1 and not softcap and kp.dtype == q.dtype):
            return None
        from dsq.kernels import triton_attn

        B, Hk, T, D = k.shape
        bs = kp.shape[2]
        blk, off = self.write_at // bs, self.write_at % bs
        kp[blk, :, off] = k.permute(0, 2, 1, 3).reshape(B * T, Hk, D)
        vp[blk, :, off] = v.permute(0, 2, 1, 3).reshape(B * T, Hk, D)
        return triton_attn.paged_attn_decode(q.transpose(1, 2), kp, vp, self.gather, mask, scale, lens=self.lens,
                                             seq=self.seq)

    def attends_latent(self, layer: int, dtype: torch.dtype) -> bool:
        """Whether attend_latent can run for MLA queries of `dtype` (the Triton paged kernels on)."""
        return self.kv.paged_kernel and self.kv.k[layer].dtype == dtype

    def attend_latent(self, layer: int, latent: torch.Tensor, q_lat: torch.Tensor, q_rope: torch.Tensor,
                      mask: torch.Tensor, scale: float) -> torch.Tensor | None:
        """MLA's absorbed decode attention straight over the latent blocks (no gathered copy of the
        step's span), after writing latent (B, 1, 1, R + P): (B, 1, H, R), or None where the
        kernel does not take these shapes (the layer then calls update)."""
        kp = self.kv.k[layer]
        bs = kp.shape[2]
        blk, off = self.write_at // bs, self.write_at % bs
        kp[blk, :, off] = latent.permute(0, 2, 1, 3).reshape(-1, 1, latent.shape[-1])
        return dispatch.mla_decode(q_lat, q_rope, kp, mask, scale, table=self.gather, lens=self.lens)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots):
        """k, v (B, Hk, T, D): written at the step's flat slots; returns (B, Hk, S, D) gathered
        (values of width 0, MLA's: nothing stored, an empty (B, Hv, S, 0) back)."""
        kp, vp = self.kv.k[layer], self.kv.v[layer]
        bs = kp.shape[2]
        blk, off = self.write_at // bs, self.write_at % bs
        g = self.gather  # (B, n) block ids
        idx = g.reshape(-1)  # (index_select: advanced indexing with a 2-D index is ~1000x slower on the CPU)
        out = []
        for new, pool, scales in ((k, kp, self.kv.k_scale), (v, vp, self.kv.v_scale)):
            B, Hk, T, D = new.shape
            if D == 0:
                out.append(new.new_empty(B, Hk, self.kv_len, 0))
                continue
            rows = new.permute(0, 2, 1, 3).reshape(B * T, Hk, D)
            if scales is None:
                pool[blk, :, off] = rows.to(pool.dtype)
                c = pool.index_select(0, idx)
            else:
                rows = rows.float()
                sc = (rows.abs().amax(-1) / FP8_MAX).clamp_min(1e-12)  # (B*T, Hk)
                pool[blk, :, off] = (rows / sc[..., None]).to(FP8)
                scales[layer][blk, :, off] = sc
                c = pool.index_select(0, idx).float() * scales[layer].index_select(0, idx)[..., None]
            c = c.view(B, g.shape[1], Hk, bs, D).transpose(1, 2).reshape(B, Hk, -1, D)[:, :, :self.kv_len]
            out.append(c.to(new.dtype).contiguous())
        return out[0], out[1]


class PagedKV:
    """The pool's keys/values per layer and the step that runs sequences over them."""

    def __init__(self, model, num_blocks: int, block_size: int, max_len: int, dtype: torch.dtype | None = None):
        a = model.args
        self.model, self.args, self.block_size, self.max_len = model, a, block_size, max_len
        dev = model.layer_devices()[0] if a.num_hidden_layers else torch.device("cpu")
        self.device = dev
        self.dtype = dtype or model.dtype
        (hk, dk), (hv, dv) = model.Cache.slot_shapes(a)  # MLA: (1, rank + rope), (1, 0)
        n = a.num_hidden_layers
        self.k = [torch.zeros(num_blocks, hk, block_size, dk, dtype=self.dtype, device=dev) for _ in range(n)]
        self.v = [torch.zeros(num_blocks, hv, block_size, dv, dtype=self.dtype, device=dev) for _ in range(n)]
        self.k_scale = self.v_scale = None
        if self.dtype == FP8:
            self.k_scale = [torch.ones(num_blocks, hk, block_size, device=dev) for _ in range(n)]
            self.v_scale = [torch.ones(num_blocks, hv, block_size, device=dev) for _ in range(n)] if dv else None
        self.pool = BlockPool(num_blocks, block_size)
        # the Triton paged decode attention on a GPU (DSQ_PAGED_ATTN=0: gather the blocks, the model's attention)
        self.paged_kernel = (dev.type == "cuda" and self.dtype != FP8 and os.environ.get("DSQ_PAGED_ATTN", "1") != "0"
                             and dispatch.use_triton(dev))
        self.graphs: dict[int, _PagedGraph] = {}  # captured decode steps by rows (capture)
        self.chunk_graphs: dict[tuple[int, int], _ChunkGraph] = {}  # captured prompt chunks by (length, span)
        self.first_piece: list[int] = []  # tokens -> the cheapest first piece of a chunk that long (plan_pieces)
        self.scratch: int | None = None  # the block padding rows of a captured step write into
        self.graph_pool = None
        self.rope = {"full": rope_tables(a.rope, a.rope_dim, max_len, dev)}
        if a.rope_local is not None:
            self.rope["local"] = rope_tables(a.rope_local, a.rope_dim, max_len, dev)

    @staticmethod
    def bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
        """The pool's bytes for one block of every layer: keys and values (MLA: the latent rows
        only) in `dtype`, plus FP8's float32 scale per token and head."""
        total = 0
        for heads, width in model.Cache.slot_shapes(model.args):
            if width:
                total += heads * (width * dtype.itemsize + (4 if dtype == FP8 else 0))
        return model.args.num_hidden_layers * block_size * total

    @torch.inference_mode()
    def forward(self, ids: list[list[int]], starts: list[int], tables: list[list[int]],
                every_position: bool = False) -> torch.Tensor:
        """Run rows of new tokens (all rows the same length T), row i's first at position
        starts[i], its keys/values into the blocks of tables[i] (which must cover them); returns
        the last position's logits (B, V), or every position's (B, T, V). A decode step (T = 1)
        replays a captured graph where `capture` made one for B rows, a prompt chunk (B = 1) one
        where `capture_chunks` made one as long."""
        B, T = len(ids), len(ids[0])
        if T == 1 and not every_position and self.graphs:
            g = self._decode_graph(B, B)
            if g is not None:
                return g([t for t, in ids], starts, list(range(B)), tables, list(range(B)))
        if B == 1 and T > 1 and not every_position and self.chunk_graphs:
            g = next((self.chunk_graphs[k] for k in sorted(self.chunk_graphs) if k[0] >= T and k[1] >= starts[0] + T),
                     None)
            if g is not None:
                return g(ids[0], starts[0], tables[0])
        dev = self.device
        S = max(starts) + T
        n = -(-S // self.block_size)
        x_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        pos = torch.tensor(starts, dtype=torch.long, device=dev)[:, None] + torch.arange(T, device=dev)  # (B, T)
        gather = torch.tensor([_padded(t, n) for t in tables], dtype=torch.long, device=dev)
        return self._run(x_ids, pos, gather, S, every_position)

    def forward_rows(self, ids: list[int], starts: list[int], seq: list[int], tables: list[list[int]],
                     keep: list[int]) -> torch.Tensor:
        """One token a row, row i at position starts[i] of sequence seq[i] (an index into
        `tables`, its blocks): a decode step and, in the same pass, prompt tokens (several rows of
        one sequence: every row's keys/values are written before any row's attention reads them,
        so each row sees the rows before it, as in a prefill). Returns the logits (len(keep), V)
        of the rows `keep` only. Replays the smallest captured graph of enough rows (`capture`),
        else runs eagerly."""
        g = self._decode_graph(len(ids), len(tables))
        if g is not None:
            return g(ids, starts, seq, tables, keep)
        logits = self.forward([[t] for t in ids], starts, [tables[i] for i in seq])
        return logits[keep]

    def _decode_graph(self, rows: int, seqs: int):
        """The smallest captured step of at least `rows` rows, if it takes `seqs` sequences."""
        g = next((self.graphs[n] for n in sorted(self.graphs) if n >= rows), None)
        return g if g is not None and seqs <= g.seqs else None

    def _run(self, x_ids: torch.Tensor, pos: torch.Tensor, gather: torch.Tensor, S: int,
             every_position: bool = False, write_at: torch.Tensor | None = None,
             last: torch.Tensor | None = None, keep: torch.Tensor | None = None,
             seq: torch.Tensor | None = None) -> torch.Tensor:
        """forward's device part (no host sync: what `capture` records): tokens x_ids (B, T) at
        positions pos (B, T), row b's blocks gather[b] (each covering its positions; after those,
        any block, masked), over cache lengths up to S. write_at (B * T,): the pool slots their
        keys/values go to, if not their blocks' (a captured chunk's padding); last (1,): the
        position whose logits come back, if not the last; keep (K,): the rows whose logits come
        back, if not all; seq (B,): each one-token row's sequence, where several rows are one
        sequence's (their attention then reads the cache once for all of them)."""
        m, a, bs, dev = self.model, self.args, self.block_size, self.device
        B, T = x_ids.shape
        if write_at is None:
            write_at = (gather.gather(1, pos // bs) * bs + pos % bs).reshape(-1)
        s = torch.arange(S, device=dev)
        causal = s[None, None, :] <= pos[:, :, None]  # (B, T, S)
        masks = {False: causal[:, None]}
        if a.sliding_window:
            masks[True] = (causal & (pos[:, :, None] - s[None, None, :] < a.sliding_window))[:, None]
        ropes = {}
        for kind, (cos, sin) in self.rope.items():
            flat = pos.reshape(-1)
            ropes[kind] = (cos.index_select(0, flat).view(B, T, 1, -1), sin.index_select(0, flat).view(B, T, 1, -1))
        step = _StepCache(self, write_at, gather, S, pos.amax(1) + 1, seq)
        x = m.embed(x_ids)
        for i, layer in enumerate(m.model.layers):
            sliding = a.is_sliding(i)
            cos, sin = ropes["local" if sliding and a.rope_local else "full"]
            x = layer(x.to(layer.input_layernorm.weight.dtype), cos, sin, masks[bool(sliding)], step, None, None)
        if every_position:
            return m.head(x)
        if last is not None:
            x = x.index_select(1, last)
        if keep is not None:
            x = x.index_select(0, keep)
        return m.head(x, last_only=True)[:, -1]

    def capture_chunks(self, lengths: list[int]) -> list[tuple[int, int]]:
        """A prompt chunk (one sequence) captured as a CUDA graph for each length in `lengths` and
        each cache span of CHUNK_SPANS at least as long (and the longest context); a chunk then
        replays the graph of the shortest length and span that hold it, its padding tokens at
        position 0 writing into the scratch block. An 8B model's 512-token chunk took 49 ms eager and
        25 ms captured, its GPU time (docs/benchmarks.md#dsq-serve). Returns the (length, span) pairs captured; one whose
        capture fails is left out, with a warning (those chunks run eagerly)."""
        bs = self.block_size
        full = -(-self.max_len // bs) * bs
        keys = [(t, span) for t in sorted(set(lengths), reverse=True)
                for span in sorted({min(full, -(-max(c, t) // bs) * bs) for c in CHUNK_SPANS} | {full}, reverse=True)]
        self._capture_each(self.chunk_graphs, keys, lambda k, pool: _ChunkGraph(self, *k, pool),
                           lambda k: f"prompt chunk of {k[0]} tokens over {k[1]}")
        return sorted(self.chunk_graphs)

    def time_chunks(self, repeat: int = 3) -> dict[int, float]:
        """Seconds a replay of each captured chunk length takes (its shortest span, the tokens
        filler_ids; the least of `repeat`), on the device's clock; then plan_pieces over them.
        Returns the costs."""
        cost: dict[int, float] = {}
        for t in sorted({t for t, _ in self.chunk_graphs}):
            g = self.chunk_graphs[min(k for k in self.chunk_graphs if k[0] == t)]
            table = [self.scratch] * g.n
            best = float("inf")
            ids = self.filler_ids(t)
            for _ in range(repeat):
                best = min(best, _timed(lambda: g(ids, 0, table), self.device))
            cost[t] = best
        self.plan_pieces(cost)
        return cost

    def time_graphs(self, repeat: int = 3) -> dict[int, float]:
        """Seconds a replay of each captured step takes (every row a token of filler_ids at
        position 0 in the scratch block, as padding is; the least of `repeat`), then
        drop_dominated over them. Returns the costs of the steps kept."""
        cost = {}
        for rows, g in self.graphs.items():
            ids = self.filler_ids(rows)
            cost[rows] = min(_timed(lambda: g(ids, [0] * rows, [g.seqs] * rows, [], []), self.device)
                             for _ in range(repeat))
        self.drop_dominated(cost)
        return {rows: cost[rows] for rows in self.graphs}

    def filler_ids(self, n: int) -> list[int]:
        """n different token ids for a pass whose output is thrown away (the warm-up's, a timed
        replay's). A MoE pass costs what its rows' chosen experts read, and rows of one token all
        choose the same few. Timed so on V2-Lite (an H100), the 32- and 64-row decode steps were
        dropped for the 192-row mixed step, which then ran 17-32-row decode steps through every
        expert of every layer, ~37 ms a step
        (docs/benchmarks.md#part-3-again-serve-ahead-of-llama-server-h100-machine-2026-12-07-night).
        Different tokens spread over the experts as a batch of requests does."""
        return [(i * 7919 + 1) % self.args.vocab_size for i in range(n)]

    def drop_dominated(self, cost: dict[int, float]) -> None:
        """Drop each captured step that costs more (seconds by rows) than one of more rows, which
        then takes its steps: a step's cost follows the kernels its row count is routed to, not
        the count alone (an 8B Q4_K_M model's step of 96 rows replayed in 24.9 ms, one of 224 in
        21.8: docs/benchmarks.md#dsq-serve). The largest always stays."""
        best = float("inf")
        for rows in sorted(self.graphs, reverse=True):
            if cost[rows] >= best:
                del self.graphs[rows]
            else:
                best = cost[rows]

    def plan_pieces(self, cost: dict[int, float]) -> None:
        """first_piece[L] for every chunk of L tokens up to the longest captured length: the first
        piece of the cheapest way to run L tokens as captured chunks in turn, each piece padded up
        to the next captured length (cost: seconds by captured length). A 300-token chunk padded
        to a 512-token graph computes 212 tokens for nothing; as 256 + 44 it pays two replays
        instead, whichever the measured costs say is less."""
        lengths = sorted(cost)
        top = lengths[-1]
        best = [0.0] * (top + 1)
        first = list(range(top + 1))  # default: the whole chunk, padded
        for L in range(1, top + 1):
            pad = next(c for c in lengths if c >= L)
            best[L] = cost[pad]
            for c in reversed(lengths):  # the longer first piece where two cost the same
                if c < L and cost[c] + best[L - c] < best[L]:
                    best[L], first[L] = cost[c] + best[L - c], c
        self.first_piece = first

    def chunk_length(self, T: int) -> int:
        """Tokens a prompt chunk of T computes: the captured length that replays it (padding
        included), or T when none holds it (eager)."""
        return min((t for t, _ in self.chunk_graphs if t >= T), default=T)

    def chunk_end(self, start: int, end: int) -> int:
        """Where a prompt chunk over [start, end) should stop: at the end of its cheapest first
        piece (plan_pieces), or at `end` when no plan covers it."""
        L = end - start
        return start + self.first_piece[L] if 0 < L < len(self.first_piece) else end

    def _capture_each(self, into: dict, keys: list, make, what) -> None:
        """into[k] = make(k, pool) for each key, largest first, over one memory pool and the
        scratch block (allocated on first use and held for good: padding writes land there); a
        key whose capture fails is left out, with a warning naming what(k) (it runs eagerly)."""
        if self.scratch is None:
            self.scratch = self.pool.allocate()
        if self.graph_pool is None:  # one pool for every graph: they replay one at a time
            self.graph_pool = torch.cuda.graph_pool_handle()
        for k in keys:
            try:
                into[k] = make(k, self.graph_pool)
            except Exception as e:  # noqa: BLE001 - the eager pass still serves it
                torch.cuda.synchronize()
                warnings.warn(f"capturing the serve {what(k)} failed, it runs eagerly: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}", stacklevel=3)

    def capture(self, sizes: list[int], seqs: int | None = None) -> list[int]:
        """The decode step (one token a row: forward_rows) captured as a CUDA graph for each
        number of rows in `sizes`, largest first, sharing one memory pool; a step of B rows then
        replays the smallest graph of >= B rows, the extra rows writing into a block of their own.
        A graph takes up to `seqs` sequences (and returns as many rows' logits; default: one a
        row), so graphs of more rows than sequences carry prompt tokens beside the decode rows.
        Eager, a step launches ~3,000 kernels for an 8B model at ~20 us of host time each: 55 ms
        whatever B, against ~15 ms of GPU time at 32 rows (docs/benchmarks.md#dsq-serve). Returns
        the sizes captured (a size whose capture fails is left out, with a warning, and runs
        eagerly)."""
        self._capture_each(self.graphs, sorted(set(sizes), reverse=True),
                           lambda b, pool: _PagedGraph(self, b, pool, min(b, seqs or b)),
                           lambda b: f"decode step of {b} rows")
        return sorted(self.graphs)


def _timed(run, device: torch.device) -> float:
    """Seconds `run()` takes: on a GPU between two events around it, else by the wall clock."""
    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1000
    import time

    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


class _Static:
    """A captured step's inputs: one long tensor in pinned host memory (where the device is a GPU)
    and its twin on the device, which the graph reads; `replay` refills both, then replays."""

    def __init__(self, kv: PagedKV, values: list):
        host = torch.tensor(values, dtype=torch.long)
        self.cuda = kv.device.type == "cuda"
        self.host = host.pin_memory() if self.cuda else host
        self.buf = self.host.to(kv.device, copy=True)
        self.sent = torch.cuda.Event() if self.cuda else None  # recorded after each copy out of `host`

    def replay(self, values: list) -> None:
        """The copy to the device does not wait for the GPU's queue (a prompt chunk still running
        when the decode step's inputs go out): only a refill of `host` waits for its last copy."""
        if self.sent is not None:
            self.sent.synchronize()  # (returns at once before the first record)
        self.host.copy_(torch.tensor(values, dtype=torch.long))
        self.buf.copy_(self.host, non_blocking=self.cuda)
        if self.sent is not None:
            self.sent.record()
        self.graph.replay()


class _PagedGraph(_Static):
    """PagedKV._run of `rows` one-token rows over the longest cache (max_len), as a CUDA graph
    over one static tensor: each row's token, position and sequence (an index into the step's
    block tables, up to `seqs` of them), the rows whose logits come back (`seqs` of them), and
    the tables. Rows past the step's point at one more table, all the scratch block."""

    def __init__(self, kv: PagedKV, rows: int, pool, seqs: int):
        from dsq.runtime.native import _graphed

        self.rows, self.seqs = rows, seqs
        self.n = n = -(-kv.max_len // kv.block_size)
        self.scratch_table = [kv.scratch] * n
        R, K = rows, seqs
        super().__init__(kv, [0] * (2 * R) + [K] * R + [0] * K + self.scratch_table * (K + 1))
        ids, pos, seq = (self.buf[i * R:(i + 1) * R] for i in range(3))
        keep, tables = self.buf[3 * R:3 * R + K], self.buf[3 * R + K:].view(K + 1, n)
        shared = seq if R > K else None  # mixed steps: a prompt's rows share their sequence
        self.graph, self.out = _graphed(lambda: kv._run(ids.view(R, 1), pos.view(R, 1), tables.index_select(0, seq),
                                                        n * kv.block_size, keep=keep, seq=shared), pool=pool)

    def __call__(self, ids: list[int], starts: list[int], seq: list[int], tables: list[list[int]],
                 keep: list[int]) -> torch.Tensor:
        pad, K, n = self.rows - len(ids), self.seqs, self.n
        values = ids + [0] * pad + starts + [0] * pad + seq + [K] * pad + keep + [0] * (K - len(keep))
        for tb in tables:
            values += _padded(tb, n)
        self.replay(values + self.scratch_table * (K + 1 - len(tables)))
        return self.out[:len(keep)].clone()  # the next replay (of any graph: one pool) rewrites out


class _ChunkGraph(_Static):
    """PagedKV._run of one sequence's prompt chunk of up to `T` tokens over cache lengths up to
    `S`, as a CUDA graph over one static tensor: the tokens, their positions, their pool slots,
    the index of the chunk's last token and the block table. Tokens past the chunk's end are
    padding: position 0, their keys/values into the scratch block (no table holds it)."""

    def __init__(self, kv: PagedKV, T: int, S: int, pool):
        from dsq.runtime.native import _graphed

        self.bs, self.T, self.n = kv.block_size, T, S // kv.block_size
        self.pad_slots = [kv.scratch * self.bs + j % self.bs for j in range(T)]
        super().__init__(kv, [0] * (2 * T) + self.pad_slots + [0] + [kv.scratch] * self.n)
        ids, pos, slots = (self.buf[i * T:(i + 1) * T].view(1, T) for i in range(3))
        last, table = self.buf[3 * T:3 * T + 1], self.buf[3 * T + 1:].view(1, self.n)
        self.graph, self.out = _graphed(lambda: kv._run(ids, pos, table, S, write_at=slots.view(-1), last=last),
                                        pool=pool)

    def __call__(self, ids: list[int], start: int, table: list[int]) -> torch.Tensor:
        T, bs, L = self.T, self.bs, len(ids)
        pos = list(range(start, start + L))
        slots = [table[p // bs] * bs + p % bs for p in pos]
        self.replay(ids + [0] * (T - L) + pos + [0] * (T - L) + slots + self.pad_slots[L:] + [L - 1]
                    + _padded(table, self.n))
        return self.out.clone()
