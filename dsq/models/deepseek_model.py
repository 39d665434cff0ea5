"""DeepSeek V2 / V3 in plain torch: multi-head latent attention (MLA) over a compressed cache, and
mixture-of-experts blocks (a router, routed experts, shared experts), with HF parameter names.

MLA. Each token's keys and values are stored as one latent row per layer: the normalized
compressed KV c (kv_lora_rank values) followed by the roped shared key k_r (qk_rope_head_dim),
576 values for V3 (MLACache: one "head" of that width, no separate values). Two exact ways read it:
- plain (prefill): kv_b_proj expands c into per-head k_nope and v; keys are [k_nope, k_r];
- absorbed (decode): W_UK (kv_b_proj's key rows) is folded into the query, q_lat = W_UK^T q_nope,
  so scores are [q_lat, q_r] . [c, k_r]: one-KV-head attention straight over the latent rows,
  whose output (a weighted sum of c) meets W_UV (kv_b_proj's value rows) before o_proj.
Each call takes the cheaper of the two for its token and cache counts (MLAttention._absorbs).

MoE. `MoE` = `Router` (scores, group-limited top-k, weights as each version defines them) +
`RoutedExperts` (one MLP per expert, a ModuleList with HF's `experts.N` names) + shared experts.
A token runs only its experts' weights: with GGUF weights each expert's GGUFLinear holds a view
into the stacked `*_exps` blocks. The routed experts are one module with one call, so a runtime
can put them on another device than the rest of the layer and move the hidden state there and back:
`CPURoutedExperts` keeps the stacked blocks in RAM and runs them with one C call per layer while
the rest of the layer runs on a GPU; `GPUStackedExperts` keeps every expert's weights stacked on the
GPU and runs a decode step's (token, expert) pairs with the expert ids read on the device (no host
sync, so the step is one CUDA graph).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsq.kernels import dispatch, packed
from dsq.models.base import (MLP, DecoderLayer, KVCache, ModelArgs, RMSNorm, Transformer, act_mul, apply_rope,
                             apply_rope_interleaved)

# transformers builds the q_a / kv_a latent norms with its RMSNorm default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6
# V3 normalizes the chosen experts' weights by their sum plus this (transformers' DeepseekV3TopkRouter)
NORM_EPS = 1e-20


@dataclass
class DeepseekArgs(ModelArgs):
    q_lora_rank: int | None = None  # None: one q_proj (V2-Lite)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    softmax_scale: float = 1.0
    n_routed_experts: int = 0  # 0: every layer dense
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    num_experts_per_tok: int = 0
    first_k_dense_replace: int = 0
    scoring_func: str = "softmax"  # V2 softmax, V3 sigmoid (with e_score_correction_bias)
    topk_method: str = "greedy"  # greedy | group_limited_greedy (V2) | noaux_tc (V3)
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def is_moe(self, layer: int) -> bool:
        return bool(self.n_routed_experts) and layer >= self.first_k_dense_replace


class MLACache(KVCache):
    """The latent cache: per layer (B, 1, S, kv_lora_rank + qk_rope_head_dim), one row a token,
    written and sliced as KVCache's keys are (slots, left padding, per-layer device and dtype);
    its values are empty (the latent rows are the values too)."""

    @staticmethod
    def slot_shapes(args: DeepseekArgs) -> tuple[tuple[int, int], tuple[int, int]]:
        return (1, args.kv_lora_rank + args.qk_rope_head_dim), (1, 0)


class MLAttention(nn.Module):
    """Multi-head latent attention (see the module docstring)."""

    def __init__(self, args: DeepseekArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.n_head, self.rank = args.num_attention_heads, args.kv_lora_rank
        self.nope, self.rope, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        h, qk, bias = args.hidden_size, args.qk_nope_head_dim + args.qk_rope_head_dim, args.attention_bias
        if args.q_lora_rank:
            self.q_a_proj = nn.Linear(h, args.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(args.q_lora_rank, self.n_head * qk, bias=False)
        else:
            self.q_proj = nn.Linear(h, self.n_head * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, self.n_head * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_head * self.v_dim, h, bias=bias)
        self.scale = args.softmax_scale
        self.rotate = apply_rope_interleaved if args.rope_interleave else apply_rope
        self.absorb: bool | None = None  # None: by cost (_absorbs); True / False: always that way
        self.tap = None  # (name, tensor) -> None: sees absorbed attention's inputs (importance matrix)
        self._absorb_weights: tuple | None = None

    def fuse(self) -> bool:
        return False

    def forward(self, x, cos, sin, mask, cache, slots, kv_len: int | None):
        B, T, _ = x.shape
        q = self._query(x).view(B, T, self.n_head, self.nope + self.rope)
        q_nope, q_rope = q.split((self.nope, self.rope), dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split((self.rank, self.rope), dim=-1)
        q_rot = self._rope_and_write(q_rope, c, k_rope, cos, sin, cache, slots) if T == 1 else None
        if q_rot is not None:  # one launch wrote the latent row
            q_rope, kc = q_rot, cache.k[self.layer]
        else:
            q_rope = self.rotate(q_rope, cos, sin)
            k_rope = self.rotate(k_rope[:, :, None], cos, sin)[:, :, 0]
            latent = torch.cat((self.kv_a_layernorm(c), k_rope), dim=-1)[:, None]  # (B, 1, T, rank + rope)
            if T == 1 and getattr(cache, "attends_latent", None) is not None and self._absorbs(T, mask.shape[-1]) \
                    and cache.attends_latent(self.layer, x.dtype):  # dsq serve's blocks, read in place
                o = self._absorbed(q_nope, q_rope, None, mask, lambda ql, qr: cache.attend_latent(
                    self.layer, latent, ql, qr, mask, self.scale))
                if o is not None:
                    return self.o_proj(o)
            kc, _ = cache.update(self.layer, latent, latent[..., :0], slots)
        if kv_len is not None:
            kc = kc[:, :, :kv_len]
        kc = kc.to(x.dtype)
        if self._absorbs(T, kc.shape[2]):
            o = self._absorbed(q_nope, q_rope, kc, mask)
        else:
            o = self._plain(q_nope, q_rope, kc, mask)
        return self.o_proj(o)

    def _rope_and_write(self, q_rope, c, k_rope, cos, sin, cache, slots) -> torch.Tensor | None:
        """One token: the queries' rope, and the latent row (c normed, k_rope rotated) written into a
        plain latent cache, as one GPU launch (dispatch.mla_write_gpu); the rotated q_rope, or None
        where that does not apply (the torch ops then run)."""
        norm = self.kv_a_layernorm
        if (type(cache).update is not KVCache.update or getattr(cache, "attends_latent", None) is not None
                or self.tap is not None or norm.offset):
            return None
        return dispatch.mla_write_gpu(q_rope, c, k_rope, norm.weight, norm.eps, cos, sin, cache.k[self.layer], slots,
                                      self.rotate is apply_rope_interleaved)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if "q_proj" in self._modules:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def _absorbs(self, T: int, S: int) -> bool:
        """Absorbed or plain, by multiply-adds per head: plain expands the S cached latents
        (S * rank * (nope + v)) then attends at the heads' widths; absorbed transforms the T
        queries and outputs (T * rank * (nope + v)) then attends at the latent width."""
        if self.absorb is not None:
            return self.absorb
        expand = self.rank * (self.nope + self.v_dim)
        plain = S * expand + T * S * (self.nope + self.rope + self.v_dim)
        absorbed = T * expand + T * S * (2 * self.rank + self.rope)
        return absorbed < plain

    def _plain(self, q_nope, q_rope, kc, mask) -> torch.Tensor:
        B, T = q_nope.shape[:2]
        S = kc.shape[2]
        kv = self.kv_b_proj(kc[:, 0, :, :self.rank]).view(B, S, self.n_head, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split((self.nope, self.v_dim), dim=-1)
        k = torch.cat((k_nope, kc[:, :, :, self.rank:].expand(B, self.n_head, S, self.rope)), dim=-1)
        return dispatch.attention(torch.cat((q_nope, q_rope), dim=-1), k, v, mask, self.scale)

    def _absorbed(self, q_nope, q_rope, kc, mask, attend=None) -> torch.Tensor | None:
        """Attention at the latent width: W_UK folded into the queries, W_UV into the output.
        One token on a GPU: the MLA decode kernel over kc, or `attend(q_lat, q_rope)` (a paged
        cache's own, None when it cannot: then so is this)."""
        B, T = q_nope.shape[:2]
        w_uk, w_uv = self.absorb_weights(q_nope.dtype, q_nope.device)
        if self.tap is not None:
            self.tap("attn_k_b", q_nope)
        q_lat = torch.einsum("bthd,hdr->bthr", q_nope, w_uk)
        if attend is not None:
            o_lat = attend(q_lat, q_rope)
            if o_lat is None:
                return None
        elif T != 1 or (o_lat := dispatch.mla_decode(q_lat, q_rope, kc, mask, self.scale)) is None:
            o = dispatch.attention(torch.cat((q_lat, q_rope), dim=-1).contiguous(), kc, kc, mask, self.scale)
            o_lat = o.view(B, T, self.n_head, self.rank + self.rope)[..., :self.rank]
        if self.tap is not None:
            self.tap("attn_v_b", o_lat)
        return torch.einsum("bthr,hvr->bthv", o_lat, w_uv).reshape(B, T, self.n_head * self.v_dim)

    def absorb_weights(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK (H, nope, rank), W_UV (H, v, rank)): kv_b_proj's rows by head. Views of a float
        weight; a quantized one is dequantized once and kept."""
        m = self.kv_b_proj
        if type(m) is nn.Linear:
            w = m.weight
        else:
            kept = self._absorb_weights
            if kept is not None and kept[0] is m and kept[1].device == device and kept[1].dtype == dtype:
                return kept[1], kept[2]
            w = _float_weight(m)
        w = w.to(device, dtype).view(self.n_head, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]
        if type(m) is not nn.Linear:
            self._absorb_weights = (m, w_uk, w_uv)
        return w_uk, w_uv


def _float_weight(m: nn.Module) -> torch.Tensor:
    """The (N, K) float weight of a quantized Linear (GGUF blocks or any module with weight_float)."""
    if hasattr(m, "weight_float"):
        return m.weight_float()
    from dsq.kernels.gguf_ref import dequantize

    return dequantize(m.raw, m.qtype, m.in_features)


class Router(nn.Module):
    """Expert choice per token: softmax (V2) or sigmoid (V3, whose choice adds
    e_score_correction_bias) scores, top-k within the best groups, the chosen experts' scores as
    weights, normalized with norm_topk_prob (V2: only with more than one expert a token, as
    DeepSeek's code and llama.cpp do; transformers' V2 ignores the flag, which every V2
    checkpoint sets false), times routed_scaling_factor. Computes in float32, as transformers does;
    its weight stays float32 in a 16-bit model (as llama.cpp keeps GGUF's F32 router)."""

    FLOAT32_PARAMS = ("weight",)  # native_loader.float32_params

    def __init__(self, args: DeepseekArgs):
        super().__init__()
        self.top_k, self.n_expert = args.num_experts_per_tok, args.n_routed_experts
        self.sigmoid = args.scoring_func == "sigmoid"
        self.method, self.n_group, self.topk_group = args.topk_method, args.n_group, args.topk_group
        self.norm, self.scaling = args.norm_topk_prob, args.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.n_expert, args.hidden_size))
        if self.sigmoid:
            self.register_buffer("e_score_correction_bias", torch.zeros(self.n_expert))

    def route_params(self) -> dict:
        """This router's choice as dispatch.moe_route (one GPU launch after the GEMV) takes it."""
        grouped = self.topk_group < self.n_group
        mode = (2 if self.sigmoid else 1 if self.method == "group_limited_greedy" else 0) if grouped else 0
        return {"top_k": self.top_k, "sigmoid": self.sigmoid,
                "bias": self.e_score_correction_bias.float() if self.sigmoid else None, "group_mode": mode,
                "n_group": self.n_group, "topk_group": self.topk_group,
                "norm": bool(self.norm and (self.sigmoid or self.top_k > 1)), "scaling": self.scaling, "eps": NORM_EPS}

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, H) -> (weights (N, k) float32, expert ids (N, k))."""
        logits = F.linear(x.float(), self.weight.float())
        fused = dispatch.moe_route(logits, self.route_params)
        if fused is not None:
            return fused
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)
        choice = scores + self.e_score_correction_bias.float() if self.sigmoid else scores
        choice = self._in_best_groups(choice)
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, ids)
        if self.norm and (self.sigmoid or self.top_k > 1):
            w = w / (w.sum(dim=-1, keepdim=True) + NORM_EPS)
        return w * self.scaling, ids

    def _in_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """The scores with experts outside the topk_group best groups out of the running: V3
        ranks groups by their two best scores and drops the rest to -inf, V2's
        group_limited_greedy by their best and drops the rest to 0."""
        if self.topk_group >= self.n_group:  # every group stays in
            return choice
        if self.sigmoid:
            grouped = choice.view(-1, self.n_group, self.n_expert // self.n_group)
            group_scores, fill = grouped.topk(2, dim=-1)[0].sum(dim=-1), float("-inf")
        elif self.method == "group_limited_greedy":
            grouped = choice.view(-1, self.n_group, self.n_expert // self.n_group)
            group_scores, fill = grouped.max(dim=-1).values, 0.0
        else:
            return choice
        best = torch.topk(group_scores, self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], fill).view_as(choice)


class RoutedExperts(nn.ModuleList):
    """The routed experts, one MLP each (HF names `experts.N.gate_proj`, ...). A call runs each
    chosen expert once over the tokens that chose it and sums their weighted outputs per token."""

    def __init__(self, args: DeepseekArgs):
        super().__init__(MLP(args, args.moe_intermediate_size) for _ in range(args.n_routed_experts))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (N, H), ids and weights (N, k) -> (N, H) in x's dtype."""
        return _each_expert_once(x, ids, weights, lambda xe, e: self[e](xe), len(self))


def _each_expert_once(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, mlp, n_expert: int) -> torch.Tensor:
    """Each chosen expert's mlp(x rows, e) once over the tokens that chose it, weighted and summed per
    token (one host sync: how many pairs each expert has)."""
    order, counts = _by_expert(ids, n_expert)
    k = ids.shape[1]
    tok = order // k
    xs, out, r = x[tok], torch.zeros_like(x), 0
    for e, c in enumerate(counts):
        if c:
            rows = tok[r:r + c]
            y = mlp(xs[r:r + c], e) * weights.reshape(-1)[order[r:r + c], None]
            out.index_add_(0, rows, y.to(out.dtype))
        r += c
    return out


def _by_expert(ids: torch.Tensor, n_expert: int, host: bool = True):
    """ids (T, k) -> (the pairs' flat indices sorted by expert, each expert's count of pairs: on the
    host, the one host sync; with host=False an int64 tensor on ids' device, made without one)."""
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    if host:
        return order, torch.bincount(flat, minlength=n_expert).tolist()
    # scatter_add, not bincount: CUDA's bincount reads the largest id on the host
    return order, torch.zeros(n_expert, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))


class GPUStackedExperts(nn.Module):
    """The routed experts of one MoE layer with every expert's weights stacked in one packed weight
    per projection (kernels/packed.py; expert e's rows e*N..e*N+N-1): gate and up as one (per
    expert its gate rows, then its up rows) where they share a format, and down. A call of up to
    PAIRS_ROWS tokens runs each (token, expert) pair through its expert with the ids read on the
    device (dispatch.packed_experts: two grouped GEMVs, the activation, the weighted sum per token),
    so it never syncs with the host and a decode step made of these can be captured as one CUDA
    graph (the model's graph_safe). Longer calls (prompt chunks) sort the pairs by expert and run
    each projection as grouped GEMMs over the sorted rows (dispatch.grouped_experts), where pairs
    would read an expert's weights once per token that chose it: on a GPU one fused launch a
    projection that reads the experts' counts on the device (so a chunk can be captured: the model's
    prefill_graph_safe), else a slab of experts a launch after one host sync for the counts."""

    # tokens up to which a call takes the pairs path; above, the grouped GEMMs. A V2-Lite prompt of
    # 64 tokens through a loop over the chosen experts prefilled at 64 tok/s against llama.cpp's
    # 2400 (docs/benchmarks.md#deepseek), so prompt chunks up to this size took pairs; the grouped
    # GEMMs replaced that loop (a 512-token chunk: 1.4 s of ~1,700 launches and host syncs,
    # docs/benchmarks.md#the-gpu-claims-in-three-device-calls), and where they overtake pairs is not
    # yet timed.
    # A captured batch decode step has one token a sequence, so batches up to this size capture.
    # DSQ_MOE_PAIRS_ROWS=N moves it.
    PAIRS_ROWS = int(os.environ.get("DSQ_MOE_PAIRS_ROWS", "") or 128)
    _PARTS = ("lo", "sc", "hi", "d", "zp", "mn", "dmin")

    def __init__(self, gate_up: packed.Packed | None, gate: packed.Packed | None, up: packed.Packed | None,
                 down: packed.Packed, n_expert: int, act, source: str = ""):
        super().__init__()
        self.n_expert, self.act, self.source = n_expert, act, source
        self.hidden, self.inter = down.N // n_expert, down.K
        self._fmts, self._names = {}, []
        for name, p in (("gate_up", gate_up), ("gate", gate), ("up", up), ("down", down)):
            if p is None:
                continue
            if p.perm is not None or p.N % n_expert:
                raise ValueError("stacked experts take weights without act-order, equal rows per expert")
            self._fmts[name] = (p.fmt, p.N, p.K)
            self._names.append(name)
            for k in self._PARTS:
                self.register_buffer(f"{name}_{k}", getattr(p, k))

    def weight(self, name: str) -> packed.Packed:
        """The stacked packed weight `name` (gate_up, gate, up or down) over this module's buffers."""
        fmt, N, K = self._fmts[name]
        return packed.Packed(fmt, N, K, **{k: getattr(self, f"{name}_{k}") for k in self._PARTS})

    def extra_repr(self) -> str:
        return (f"{self.n_expert} experts stacked ({', '.join(self._names)}), {self.source}, hidden={self.hidden}, "
                f"inter={self.inter}")

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                add: torch.Tensor | None = None) -> torch.Tensor:
        """x (T, H), ids and weights (T, k) -> (T, H) in x's dtype, plus `add` (T, H) when given
        (the shared experts' output: on a GPU added in the launch that weighs and sums the pairs)."""
        T, k = ids.shape
        if T > self.PAIRS_ROWS:
            return self._grouped(x, ids, weights, add)
        E = self.n_expert
        if "gate_up" in self._fmts:
            g, u = dispatch.packed_experts(x, self.weight("gate_up"), ids, E).chunk(2, dim=-1)
        else:
            g = dispatch.packed_experts(x, self.weight("gate"), ids, E)
            u = dispatch.packed_experts(x, self.weight("up"), ids, E)
        y = dispatch.packed_experts(act_mul(self.act, g, u), self.weight("down"), ids, E)  # (T * k, H)
        out = dispatch.moe_combine(y, weights, x.dtype, add)
        if out is not None:
            return out
        y = (y.view(T, k, -1) * weights[..., None]).sum(dim=1).to(x.dtype)
        return y + add if add is not None else y

    def fused(self, x: torch.Tensor) -> bool:
        """Whether every projection's grouped GEMM here is a fused kernel (dispatch.grouped_fused),
        which reads the experts' counts on the device: then a prompt chunk never syncs with the host
        and can be captured in a CUDA graph."""
        return all(dispatch.grouped_fused(x, self.weight(n), self.n_expert) is not None for n in self._names)

    def _grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 add: torch.Tensor | None) -> torch.Tensor:
        """A prompt chunk's pairs sorted by expert, each projection's grouped GEMMs over them, the
        outputs back in (token, slot) order, weighted and summed per token, plus `add`. The experts'
        counts stay on the device where every projection is fused (`fused`), else one host sync."""
        T, k = ids.shape
        E = self.n_expert
        order, counts = _by_expert(ids, E, host=not self.fused(x))
        xs = x[order // k]
        if "gate_up" in self._fmts:
            g, u = dispatch.grouped_experts(xs, self.weight("gate_up"), counts, E).chunk(2, dim=-1)
        else:
            g = dispatch.grouped_experts(xs, self.weight("gate"), counts, E)
            u = dispatch.grouped_experts(xs, self.weight("up"), counts, E)
        ys = dispatch.grouped_experts(act_mul(self.act, g, u), self.weight("down"), counts, E)
        y = torch.empty_like(ys)
        y[order] = ys
        out = dispatch.moe_combine(y, weights, x.dtype, add)
        if out is not None:
            return out
        y = (y.view(T, k, -1) * weights[..., None]).sum(dim=1).to(x.dtype)
        return y + add if add is not None else y


class _Pinned:
    """Page-locked host buffers for the hidden state's trips to the CPU experts and back, shared by
    every layer (each layer's copies are done before the next layer writes them: a layer waits for
    its own copies to the host, which the stream orders after the last layer's copy back)."""

    def __init__(self):
        self.mem: torch.Tensor | None = None

    def take(self, n: int) -> torch.Tensor:
        """At least n float32 values of page-locked memory (grown, never shrunk)."""
        if self.mem is None or self.mem.numel() < n:
            if self.mem is not None and torch.cuda.is_available():
                torch.cuda.synchronize()  # copies queued from the old buffer are done before it goes
            self.mem = torch.empty(max(n, 1 << 16), dtype=torch.float32, pin_memory=True)
        return self.mem


class _Staging:
    """Two page-locked buffers that a streamed layer's expert blocks pass through on their way to
    the GPU, in turn: the blocks sit in pageable memory (the GGUF file's map), which a copy to a GPU
    reads through the driver's staging at a fraction of the link's speed, and in step with the host.
    Here the host copies them in (every thread), and the copy to the GPU then runs without the host,
    from the one buffer while the host fills the other. A buffer is filled again only once the copies
    queued from it are done (its event)."""

    def __init__(self, pin: bool = True):
        self.pin = pin
        self.bufs: list[torch.Tensor | None] = [None, None]
        self.events: list = [None, None]
        self.turn = 0

    @contextlib.contextmanager
    def put(self, t: torch.Tensor):
        """t's contents in the next buffer (grown to t's bytes if smaller), as a tensor of t's shape;
        the copies queued from it inside the block are awaited before that buffer is filled again."""
        i, self.turn = self.turn, self.turn ^ 1
        if self.events[i] is not None:
            self.events[i].synchronize()
            self.events[i] = None
        n = t.numel() * t.element_size()
        if self.bufs[i] is None or self.bufs[i].numel() < n:
            self.bufs[i] = None  # the smaller buffer goes before the larger is made (its copies are done)
            self.bufs[i] = torch.empty(n, dtype=torch.uint8, pin_memory=self.pin)
        view = self.bufs[i][:n].view(t.dtype).view(t.shape)
        view.copy_(t)
        try:
            yield view
        finally:
            if self.pin:
                self.events[i] = torch.cuda.Event()
                self.events[i].record()


class CPURoutedExperts(nn.Module):
    """The routed experts of one MoE layer kept in RAM as GGUF blocks (gate and up (E, I, row bytes),
    down (E, H, row bytes): the file's stacked `ffn_*_exps` tensors, not copied) and run by one C
    call per layer (kernels/cpu.moe_experts) whatever device the rest of the layer is on. The blocks
    are plain attributes, not buffers, so moving the layer to a GPU leaves them where they are.

    From a GPU, two ways:
    - queued (decode, up to QUEUE_ROWS rows): x, the expert ids and the weights are copied into
      this layer's own pinned buffers, the C call is queued on the stream as a CUDA host function
      (cuLaunchHostFunc), then the result's copy back: no host sync at all, and a decode step made
      of these can be captured as one CUDA graph (the model's graph_safe);
    - sent (prompt chunks, or where the driver's host functions are not at hand, or
      DSQ_MOE_QUEUE=0): `send` starts the copies to a shared pinned buffer and records an event,
      the caller queues the GPU's own work (shared experts) behind them, `receive` waits for the
      event (the layer's one host sync), runs the C call and queues the copy back.
    On the CPU the call runs directly."""

    QUEUE_ROWS = 16
    # From this many tokens a call from a GPU copies the layer's experts over and runs them there
    # (`streamed`): a prompt chunk chooses nearly every expert, and the copy of their blocks costs less
    # than the C kernels over that many rows (as llama.cpp offloads a large batch's MoE matmuls
    # under -ot exps=CPU; docs/benchmarks.md#part-3-first-run-h100-machine-2026-12-07-cut-by-the-calls-limit:
    # not yet timed: by that estimate the copy costs what the C call does at 35-115 rows, so 128 errs
    # towards the C call). DSQ_MOE_STREAM_ROWS=N moves it, 0 turns it off.
    STREAM_ROWS = int(os.environ.get("DSQ_MOE_STREAM_ROWS", "") or 128)
    pinned = _Pinned()
    # DSQ_MOE_STAGE=0: copy the blocks to the GPU straight from pageable memory (the A/B of the staging)
    staging = _Staging() if os.environ.get("DSQ_MOE_STAGE", "1") != "0" else None

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, qtypes: tuple[str, str, str]):
        super().__init__()
        self.gate, self.up, self.down, self.qtypes = gate, up, down, tuple(qtypes)
        self.n_expert, self.inter, self.hidden = gate.shape[0], gate.shape[1], down.shape[1]
        self._slots: dict = {}  # (device, rows, k) -> a queued call's pinned buffers and C arguments

    def extra_repr(self) -> str:
        return f"{self.n_expert} experts in RAM, {'/'.join(self.qtypes)}, hidden={self.hidden}, inter={self.inter}"

    @staticmethod
    def queues(device: torch.device) -> bool:
        """Whether calls from `device` are queued on its stream (see the class docstring)."""
        import os

        from dsq.kernels import cpu

        return (device.type == "cuda" and os.environ.get("DSQ_MOE_QUEUE", "1") != "0"
                and cpu.moe_host_fn() is not None and cpu.cuda_host_launcher() is not None)

    def _run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out=None) -> torch.Tensor:
        from dsq.kernels import cpu

        return cpu.moe_experts(x, ids, weights, self.gate, self.up, self.down, self.qtypes, out=out)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (N, H), ids and weights (N, k) -> (N, H) in x's dtype, on x's device."""
        if self.streams(x):
            return self.streamed(x, ids, weights)
        if x.device.type == "cpu":
            y = self._run(x.float().contiguous(), ids.long().contiguous(), weights.float().contiguous())
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        if x.shape[0] <= self.QUEUE_ROWS and self.queues(x.device):
            return self.queued(x, ids, weights)
        return self.receive(self.send(x, ids, weights))

    def streams(self, x: torch.Tensor) -> bool:
        """Whether a call with rows x (N, H) runs `streamed`: from a GPU, from STREAM_ROWS rows."""
        return self.STREAM_ROWS > 0 and x.device.type == "cuda" and x.shape[0] >= self.STREAM_ROWS

    def streamed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 add: torch.Tensor | None = None) -> torch.Tensor:
        """x (N, H) through this layer's experts copied to x's device for this call: each stacked
        projection's blocks through a page-locked buffer (_Staging), converted to the GPU kernels'
        layout there (packed.from_gguf, a chunk of rows copied at a time), run through the grouped
        GEMMs as GPUStackedExperts runs a prompt chunk (at any STREAM_ROWS: the pairs would read a
        streamed expert once per token that chose it), then dropped; plus `add`."""
        E = self.n_expert
        parts = []
        for t, q, k in ((self.gate, self.qtypes[0], self.hidden), (self.up, self.qtypes[1], self.hidden),
                        (self.down, self.qtypes[2], self.inter)):
            if x.device.type != "cuda" or self.staging is None:
                parts.append(packed.from_gguf(t.reshape(E * t.shape[1], t.shape[2]), q, k, device=x.device))
                continue
            # (E, rows, row bytes) straight into the buffer: a strided view of the file is not copied twice
            with self.staging.put(t) as pinned:
                parts.append(packed.from_gguf(pinned.view(E * t.shape[1], t.shape[2]), q, k, device=x.device))
        twin = GPUStackedExperts(None, parts[0], parts[1], parts[2], E, F.silu, "streamed from RAM")
        del parts
        return twin._grouped(x, ids, weights, add)

    def queued(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The call queued on x's stream between the copies (no host sync)."""
        from dsq.kernels import cpu

        N, k = ids.shape
        key = (x.device, N, k)
        if key not in self._slots:
            hx, hy = (torch.empty(N, self.hidden, pin_memory=True) for _ in range(2))
            hid, hw = torch.empty(N, k, dtype=torch.int64, pin_memory=True), torch.empty(N, k, pin_memory=True)
            args = cpu.moe_host_args(hx, hid, hw, self.gate, self.up, self.down, self.qtypes, hy,
                                     threads=torch.get_num_threads())
            self._slots[key] = (hx, hid, hw, hy, args)
        hx, hid, hw, hy, args = self._slots[key]
        hx.copy_(x.float(), non_blocking=True)
        hid.copy_(ids.long(), non_blocking=True)
        hw.copy_(weights.float(), non_blocking=True)
        stream = torch.cuda.current_stream(x.device).cuda_stream
        cpu.cuda_host_launcher()(stream, cpu.moe_host_fn(), ctypes.addressof(args))
        return hy.to(x.device, non_blocking=True).to(x.dtype)

    def send(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple:
        """Queue x, ids and weights's copies to the host; returns what `receive` needs."""
        N, H = x.shape
        k = ids.shape[1]
        mem = self.pinned.take(2 * N * H + 2 * N * k)
        hx, hy = mem[:N * H].view(N, H), mem[N * H:2 * N * H].view(N, H)
        hw = mem[2 * N * H:2 * N * H + N * k].view(N, k)
        hid = mem[2 * N * H + N * k:2 * N * H + 2 * N * k].view(torch.int32)[:N * k].view(N, k)
        hx.copy_(x.float(), non_blocking=True)
        hw.copy_(weights.float(), non_blocking=True)
        hid.copy_(ids.to(torch.int32), non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return x, hx, hid, hw, hy, done

    def receive(self, sent: tuple) -> torch.Tensor:
        """Wait for `send`'s copies, run the experts, queue the result's copy to x's device."""
        x, hx, hid, hw, hy, done = sent
        done.synchronize()
        self._run(hx, hid.long(), hw, out=hy)
        return hy.to(x.device, non_blocking=True).to(x.dtype)


class MoE(nn.Module):
    """Router + routed experts + shared experts (HF names: mlp.gate, mlp.experts.N, mlp.shared_experts)."""

    overlap = True  # routed experts in RAM: the GPU runs the shared experts meanwhile (False: one after the other)

    def __init__(self, args: DeepseekArgs):
        super().__init__()
        self.gate = Router(args)
        self.experts = RoutedExperts(args)
        self.shared_experts = (MLP(args, args.moe_intermediate_size * args.n_shared_experts)
                               if args.n_shared_experts else None)

    def fuse(self) -> bool:
        """Fuse the shared experts' gate/up; routed experts stay as stored (their GGUF blocks are
        views into the file's stacked tensors, which stacking rows would copy)."""
        return self.shared_experts.fuse() if self.shared_experts is not None else False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.gate(flat)
        if isinstance(self.experts, CPURoutedExperts) and self.experts.streams(flat):  # a prompt chunk
            shared = self.shared_experts(x).reshape(flat.shape) if self.shared_experts is not None else None
            return self.experts.streamed(flat, ids, weights, add=shared).view_as(x)
        if (self.overlap and isinstance(self.experts, CPURoutedExperts) and x.device.type != "cpu"
                and not (flat.shape[0] <= CPURoutedExperts.QUEUE_ROWS and CPURoutedExperts.queues(x.device))):
            # the GPU runs the shared experts while the CPU runs the routed ones
            sent = self.experts.send(flat, ids, weights)
            shared = self.shared_experts(x) if self.shared_experts is not None else None
            y = self.experts.receive(sent).view_as(x)
            return y + shared if shared is not None else y
        if isinstance(self.experts, GPUStackedExperts) and self.shared_experts is not None:
            shared = self.shared_experts(x).reshape(flat.shape)
            return self.experts(flat, ids, weights, add=shared).view_as(x)
        y = self.experts(flat, ids, weights).view_as(x)
        return y + self.shared_experts(x) if self.shared_experts is not None else y


class DeepseekLayer(DecoderLayer):
    def make_attention(self, args: DeepseekArgs, layer: int) -> nn.Module:
        return MLAttention(args, layer)

    def make_mlp(self, args: DeepseekArgs, layer: int) -> nn.Module:
        return MoE(args) if args.is_moe(layer) else MLP(args)


class DeepseekTransformer(Transformer):
    Layer = DeepseekLayer
    Cache = MLACache

    def _moe_experts(self):
        """(routed experts, the device of the layer around them) of each MoE layer."""
        from dsq.models.base import module_device

        for layer in self.model.layers:
            if isinstance(layer.mlp, MoE):
                yield layer.mlp.experts, module_device(layer.input_layernorm)

    @property
    def graph_safe(self) -> bool:
        """Dense layers only, or every MoE layer's experts stacked on the GPU (GPUStackedExperts:
        the ids stay on the device) or in RAM and queued from a GPU (no host control flow: the C
        call is a host function on the stream)."""
        return all((isinstance(ex, GPUStackedExperts) and dev.type == "cuda")
                   or (isinstance(ex, CPURoutedExperts) and CPURoutedExperts.queues(dev))
                   for ex, dev in self._moe_experts())

    @property
    def host_work_in_step(self) -> bool:
        """Some MoE layer's experts in RAM with the layer on a GPU whose stream queues their C call."""
        return any(isinstance(ex, CPURoutedExperts) and CPURoutedExperts.queues(dev) for ex, dev in self._moe_experts())

    @property
    def prefill_graph_safe(self) -> bool:
        """Every MoE layer's experts stacked on the GPU with every projection's grouped GEMM fused
        (GPUStackedExperts.fused: the experts' counts read on the device), so a prompt chunk longer
        than PAIRS_ROWS has no host sync."""
        return all(isinstance(ex, GPUStackedExperts) and dev.type == "cuda"
                   and ex.fused(torch.empty(0, dtype=self.dtype, device=dev)) for ex, dev in self._moe_experts())
