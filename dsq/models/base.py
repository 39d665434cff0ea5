"""The decoder-only transformer shared by llama, qwen2, gemma3 and (with its own attention, MoE and
cache: dsq.models.deepseek) DeepSeek V2/V3, in plain torch.

HF parameter names (model.embed_tokens, model.layers.N.self_attn.q_proj, ...), so checkpoints
load with `load_state_dict(assign=True)` onto a model built on the meta device. Nothing here
knows about quantization: quantized weights arrive as module swaps (nn.Linear -> a quantized
Linear) made by the runtime before loading.

Shapes: B batch, T new tokens, S cache length, H query heads, Hk key/value heads, D head dim.
The KV cache is preallocated (B, Hk, S, D) per layer; `slots` (T,) say which cache columns the
new tokens go to (the same for every row; rows of a batch are left-padded, `pad` (B,) counts
each row's padding), and positions are slots - pad.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dsq.kernels import dispatch


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    rope_local: dict | None = None  # rope of sliding-window layers (Gemma 3), if different
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"  # or "gelu_tanh"
    norm_offset: float = 0.0  # Gemma: weights are stored as (w - 1)
    qk_norm: bool = False
    sandwich_norm: bool = False  # Gemma 2/3: norms after attention and MLP as well
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden)
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # "sliding_attention" | "full_attention" per layer
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    rotary_dim: int | None = None  # rope width when it is not head_dim (DeepSeek's MLA: qk_rope_head_dim)

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def is_sliding(self, i: int) -> bool:
        return bool(self.sliding_window and self.layer_types and self.layer_types[i] == "sliding_attention")


def module_device(m: nn.Module) -> torch.device:
    """Device of a module's first parameter or buffer (quantized modules hold buffers only), or of
    its output where it says (an output head split between devices: qmodules.RowSplitLinear)."""
    if isinstance(getattr(m, "out_device", None), torch.device):
        return m.out_device
    for t in m.parameters():
        return t.device
    for t in m.buffers():
        return t.device
    return torch.device("cpu")


@dataclass(frozen=True)
class Placement:
    """Where the loader put each part of a model: the token embedding, each layer, the final norm,
    the output head (where its output is). The hidden state moves by it, once at each change of
    device (cross_device), whatever the tensors report."""

    embed: torch.device
    layers: tuple[torch.device, ...]
    norm: torch.device
    head: torch.device


def cross_device(x: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The hidden state x handed to the next part of the model on `device` (in `dtype`): the one copy
    a boundary between devices costs."""
    return x.to(device, dtype) if dtype is not None else x.to(device)


# -- rope -----------------------------------------------------------------------------------
def rope_inv_freq(rope: dict, dim: int) -> torch.Tensor:
    """Inverse frequencies (dim/2,) for a rope config: default, linear, llama3, yarn."""
    base = float(rope.get("rope_theta", 10000.0))
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return inv.float()
    if kind == "linear":
        return (inv / float(rope["factor"])).float()
    if kind == "llama3":
        factor = float(rope["factor"])
        lo, hi = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
        old = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(medium, smoothed, scaled).float()
    if kind == "yarn":
        return _yarn_inv_freq(rope, dim, base)
    raise ValueError(f"rope type {kind!r} is not supported")


def _yarn_inv_freq(rope: dict, dim: int, base: float) -> torch.Tensor:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between
    (transformers' _compute_yarn_parameters, in float32 as it computes them)."""
    factor = float(rope["factor"])
    old = float(rope["original_max_position_embeddings"])
    fast, slow = float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1)

    def corr_dim(rotations: float) -> float:
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(fast), corr_dim(slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated = 1 - ramp  # the share of each frequency kept as trained
    return (1.0 / (factor * pos)) * (1 - extrapolated) + (1.0 / pos) * extrapolated


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context `factor`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(rope: dict) -> float:
    """What cos and sin are multiplied by: YaRN's temperature (mscale over mscale_all_dim when a
    config gives both, as transformers computes it), 1 for every other rope."""
    if rope.get("rope_type") != "yarn":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor, m, m_all = float(rope["factor"]), rope.get("mscale"), rope.get("mscale_all_dim")
    if m and m_all:
        return yarn_mscale(factor, float(m)) / yarn_mscale(factor, float(m_all))
    return yarn_mscale(factor)


def rope_tables(rope: dict, dim: int, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (length, dim) in float32, HF's rotate-half layout, times the rope's attention factor."""
    inv = rope_inv_freq(rope, dim).to(device)
    t = torch.arange(length, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    af = rope_attention_factor(rope)
    if af == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * af, emb.sin() * af


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, D); cos/sin (B, T, 1, D) float32."""
    if (y := dispatch.rope_gpu(x, cos, sin, interleaved=False)) is not None:
        return y
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rot = torch.cat((-x2, x1), dim=-1)
    return _cast(xf * cos + rot * sin, x.dtype)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope over interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's layout, llama.cpp's "norm"
    rope): x (..., D), cos/sin (..., D) as rope_tables lays them out. The result holds the
    rotated even elements, then the odd ones (transformers' DeepSeek-V3 order): queries and keys
    get the same order, so their dot products are those of the interleaved layout."""
    if (y := dispatch.rope_gpu(x, cos, sin, interleaved=True)) is not None:
        return y
    half = x.shape[-1] // 2
    xf = x.float()
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return _cast(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1), x.dtype)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t.to(dtype), without the call when it is a no-op (the decode step has hundreds)."""
    return t if t.dtype == dtype else t.to(dtype)


# -- KV cache -------------------------------------------------------------------------------
class KVCache:
    """Preallocated keys/values per layer (each on its layer's device, in its dtype) plus rope tables."""

    def __init__(self, args: ModelArgs, batch: int, length: int, dtype: torch.dtype | list[torch.dtype],
                 devices: list[torch.device]):
        dtypes = dtype if isinstance(dtype, list) else [dtype] * len(devices)
        self.batch, self.length, self.dtype = batch, length, dtypes[-1] if dtypes else dtype
        (hk, dk), (hv, dv) = self.slot_shapes(args)
        self.k = [torch.zeros(batch, hk, length, dk, dtype=t, device=d) for t, d in zip(dtypes, devices)]
        self.v = [torch.zeros(batch, hv, length, dv, dtype=t, device=d) for t, d in zip(dtypes, devices)]
        self.args = args
        self.rope: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for d in dict.fromkeys(devices):
            self.rope_on("full", d)
            if args.rope_local is not None:
                self.rope_on("local", d)

    @staticmethod
    def slot_shapes(args: ModelArgs) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, width) of one token's keys, then of its values, in every layer."""
        return (args.num_key_value_heads, args.head_dim), (args.num_key_value_heads, args.head_dim)

    def rope_on(self, kind: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the cache's length on `device` ("full" or "local" rope), made on first use
        (a layer run away from its cache's device: a CPU layer's prompt chunk on the GPU)."""
        key = (kind, str(device))
        if key not in self.rope:
            rope = self.args.rope_local if kind == "local" else self.args.rope
            self.rope[key] = rope_tables(rope, self.args.rope_dim, self.length, device)
        return self.rope[key]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
        """Write k, v (B, Hk, T, D) at `slots`; return the layer's full cache."""
        kc, vc = self.k[layer], self.v[layer]
        kc.index_copy_(2, slots, _cast(k, kc.dtype))
        vc.index_copy_(2, slots, _cast(v, vc.dtype))
        return kc, vc


class PassThroughCache:
    """For whole sequences in one pass (calibration): nothing stored, attention sees these tokens."""

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
        return k, v


# -- blocks ---------------------------------------------------------------------------------
def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) scaled by the norm's weight, in torch ops: the norm everywhere
    neither the CPU's C kernel nor the GPU's one launch (RMSNorm.forward) takes it."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:  # Gemma: scale in float32, then cast
        return (xf * (offset + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)  # Llama: cast, then scale


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.offset = eps, offset
        self._scaled = None  # (weight, its version, offset + weight in float32) while it is unchanged

    def _offset_weight(self) -> torch.Tensor:
        """offset + weight in float32, kept between calls when no gradient is wanted (decode)."""
        w = self.weight
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or w.is_inference():
            return self.offset + w.float()
        c = self._scaled
        if c is None or c[0] is not w or c[1] != w._version:
            c = self._scaled = (w, w._version, self.offset + w.float())
        return c[2]

    def scale_weight(self) -> torch.Tensor:
        """What x * rsqrt(mean(x^2) + eps) is multiplied by: weight, or offset + weight in float32."""
        return self._offset_weight() if self.offset else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cpu and (self.offset or x.dtype == self.weight.dtype == torch.float32):
            # on the CPU torch.rms_norm computes x * rsqrt(mean(x^2) + eps) * w bit for bit as the
            # lines below do in float32, in one call (a decode step runs ~100 norms)
            return _cast(dispatch.rms_norm(x.float(), self.scale_weight(), self.eps), x.dtype)
        if (y := dispatch.rms_norm_gpu(x, self.weight, self.eps, self.offset)) is not None:
            return y
        return rms_norm_torch(x, self.weight, self.eps, self.offset)

    def add_norm(self, x: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + a, the norm of it): a residual sum and the next norm, one launch on a GPU."""
        both = dispatch.rms_norm_gpu(x, self.weight, self.eps, self.offset, add=a) if x.dtype == a.dtype else None
        if both is not None:
            return both
        x = x + a
        return x, self(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.n_head, self.n_kv, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        h, d = args.hidden_size, args.head_dim
        self.q_proj = nn.Linear(h, self.n_head * d, bias=args.attention_bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=args.attention_bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=args.attention_bias)
        self.o_proj = nn.Linear(self.n_head * d, h, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(d, args.rms_norm_eps, args.norm_offset)
            self.k_norm = RMSNorm(d, args.rms_norm_eps, args.norm_offset)
        self.qk_norm = args.qk_norm
        self.scale = (args.query_pre_attn_scalar or d) ** -0.5
        self.softcap = args.attn_logit_softcapping

    def fuse(self) -> bool:
        """Replace q/k/v by one projection (one weight read, one launch) when all three are float, or
        all three quantized modules of one format that can stack their rows (fuse_rows)."""
        mods = (self.q_proj, self.k_proj, self.v_proj)
        if hasattr(type(mods[0]), "fuse_rows"):  # quantized modules that know how to stack their rows
            fused = type(mods[0]).fuse_rows(mods)
            if fused is not None:
                self.qkv_proj = fused
                del self.q_proj, self.k_proj, self.v_proj
                return True
            # GGUF K-quant mixes often store v in another type than q and k (the built-in model:
            # q, k Q5_0, v Q8_0): stack q and k at least
            fused = type(mods[0]).fuse_rows(mods[:2])
            if fused is None:
                return False
            self.qk_proj = fused
            del self.q_proj, self.k_proj
            return True
        if not all(type(m) is nn.Linear for m in mods) or len({m.weight.dtype for m in mods}) != 1:
            return False
        w = torch.cat([m.weight for m in mods])
        fused = nn.Linear(w.shape[1], w.shape[0], bias=self.q_proj.bias is not None, device="meta")
        fused.weight = nn.Parameter(w, requires_grad=False)
        if self.q_proj.bias is not None:
            fused.bias = nn.Parameter(torch.cat([m.bias for m in mods]), requires_grad=False)
        self.qkv_proj = fused
        del self.q_proj, self.k_proj, self.v_proj
        return True

    def forward(self, x, cos, sin, mask, cache: KVCache, slots, kv_len: int | None):
        B, T, _ = x.shape
        if "qkv_proj" in self._modules:
            nq, nk = self.n_head * self.head_dim, self.n_kv * self.head_dim
            q, k, v = self.qkv_proj(x).split((nq, nk, nk), dim=-1)
            q = q.view(B, T, self.n_head, self.head_dim)
            k, v = k.view(B, T, self.n_kv, self.head_dim), v.view(B, T, self.n_kv, self.head_dim)
        elif "qk_proj" in self._modules:
            q, k = self.qk_proj(x).split((self.n_head * self.head_dim, self.n_kv * self.head_dim), dim=-1)
            q, k = q.view(B, T, self.n_head, self.head_dim), k.view(B, T, self.n_kv, self.head_dim)
            v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)
        else:
            q = self.q_proj(x).view(B, T, self.n_head, self.head_dim)
            k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)
            v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)
        if type(cache) is KVCache:  # the one-call decode step writes the cache itself
            o = dispatch.attention_step(q, k, v, self._fused_norms, cos, sin, cache.k[self.layer], cache.v[self.layer],
                                        slots, kv_len, mask, self.scale, self.softcap)
            if o is not None:
                return self.o_proj(o)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attend = getattr(cache, "attend", None)  # a cache with its own attention (dsq serve's paged one)
        if attend is not None:
            o = attend(self.layer, q, k.transpose(1, 2), v.transpose(1, 2), mask, self.scale, self.softcap)
            if o is not None:
                return self.o_proj(o)
        kc, vc = cache.update(self.layer, k.transpose(1, 2), v.transpose(1, 2), slots)  # (B, Hk, S, D)
        if kv_len is not None:
            kc, vc = kc[:, :, :kv_len], vc[:, :, :kv_len]
        o = dispatch.attention(q, _cast(kc, q.dtype), _cast(vc, q.dtype), mask, self.scale, self.softcap)
        return self.o_proj(o)

    def _fused_norms(self):
        """The q/k norms as dispatch.attention_step takes them: (q weight, k weight, eps), (None,
        None, 0.0) without q/k norms, None when the two differ in eps (one call takes one)."""
        if not self.qk_norm:
            return None, None, 0.0
        if self.k_norm.eps != self.q_norm.eps:
            return None
        return self.q_norm.scale_weight(), self.k_norm.scale_weight(), self.q_norm.eps


def gelu_tanh(t: torch.Tensor) -> torch.Tensor:
    return F.gelu(t, approximate="tanh")


def act_mul(act, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """act(g) * u for an MLP's activation (F.silu or gelu_tanh): one launch on a GPU."""
    if act is F.silu or act is gelu_tanh:
        y = dispatch.act_mul_gpu(g, u, gelu=act is gelu_tanh)
        if y is not None:
            return y
    return act(g) * u


class MLP(nn.Module):
    # forward(x, residual) gives mlp(x) + residual, the add in down_proj's one-row GEMV on a GPU
    # (dispatch.linear_add); DecoderLayer passes its residual only to an mlp whose class says so
    adds_residual = True

    def __init__(self, args: ModelArgs, intermediate_size: int | None = None):
        super().__init__()
        h, f = args.hidden_size, intermediate_size or args.intermediate_size
        self.gate_proj = nn.Linear(h, f, bias=args.mlp_bias)
        self.up_proj = nn.Linear(h, f, bias=args.mlp_bias)
        self.down_proj = nn.Linear(f, h, bias=args.mlp_bias)
        self.act = gelu_tanh if args.hidden_act == "gelu_tanh" else F.silu

    def fuse(self) -> bool:
        """Replace gate/up by one projection when both are float, or quantized modules of one
        format that can stack their rows (fuse_rows)."""
        mods = (self.gate_proj, self.up_proj)
        if hasattr(type(mods[0]), "fuse_rows"):
            fused = type(mods[0]).fuse_rows(mods)
            if fused is None:
                return False
            self.gate_up_proj = fused
            del self.gate_proj, self.up_proj
            return True
        if not all(type(m) is nn.Linear for m in mods) or self.gate_proj.bias is not None:
            return False
        w = torch.cat([m.weight for m in mods])
        fused = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        fused.weight = nn.Parameter(w, requires_grad=False)
        self.gate_up_proj = fused
        del self.gate_proj, self.up_proj
        return True

    def forward(self, x, residual: torch.Tensor | None = None):
        """down(act(gate x) * up x), plus `residual` when given."""
        if "gate_up_proj" in self._modules:
            g, u = self.gate_up_proj(x).chunk(2, dim=-1)
            h = act_mul(self.act, g, u)
        else:
            h = act_mul(self.act, self.gate_proj(x), self.up_proj(x))
        if residual is None:
            return self.down_proj(h)
        return dispatch.linear_add(self.down_proj, h, residual)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        eps, off = args.rms_norm_eps, args.norm_offset
        self.self_attn = self.make_attention(args, layer)
        self.mlp = self.make_mlp(args, layer)
        self.input_layernorm = RMSNorm(args.hidden_size, eps, off)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps, off)
        self.sandwich = args.sandwich_norm
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(args.hidden_size, eps, off)
            self.post_feedforward_layernorm = RMSNorm(args.hidden_size, eps, off)

    def make_attention(self, args: ModelArgs, layer: int) -> nn.Module:
        return Attention(args, layer)

    def make_mlp(self, args: ModelArgs, layer: int) -> nn.Module:
        return MLP(args)

    def forward(self, x, cos, sin, mask, cache, slots, kv_len):
        a = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, slots, kv_len)
        if self.sandwich:
            x, h = self.pre_feedforward_layernorm.add_norm(x, self.post_attention_layernorm(a))
            return x + self.post_feedforward_layernorm(self.mlp(h))
        x, h = self.post_attention_layernorm.add_norm(x, a)
        if getattr(self.mlp, "adds_residual", False):
            return self.mlp(h, residual=x)
        return x + self.mlp(h)


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs, layer_class: type = DecoderLayer):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(layer_class(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_offset)


class Transformer(nn.Module):
    """A causal LM: logits = lm_head(norm(layers(embed(ids)))). An architecture with other blocks
    or another cache subclasses it and names them (Layer, Cache)."""

    Layer: type = DecoderLayer
    Cache: type = KVCache
    placement: Placement | None = None  # as the loader placed it (None: where the tensors are)
    _fused_decode = None  # the runtime's one-call decode of CPU layers (dsq/runtime/fused_layer.py), if attached

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args, self.Layer)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def fuse_projections(self) -> int:
        """Fuse q/k/v (or q/k) and gate/up wherever the weights are plain float tensors or
        quantized modules of one format (a runtime transform for speed; the parameter names of a
        loaded model change). Returns how many."""
        n = 0
        for layer in self.model.layers:
            n += layer.self_attn.fuse() + layer.mlp.fuse()
        return n

    @property
    def graph_safe(self) -> bool:
        """Whether a decode step is the same kernels whatever the tokens (so it can be captured
        as a CUDA graph or compiled whole); a model routing tokens to experts is not."""
        return True

    @property
    def prefill_graph_safe(self) -> bool:
        """Whether a full prompt chunk is the same kernels whatever the tokens, with no host sync
        (so it can be captured as a CUDA graph): a dense model's is."""
        return True

    @property
    def host_work_in_step(self) -> bool:
        """Whether a GPU decode step runs C calls on the host's threads as host functions queued on
        its stream (DeepSeek's routed experts in RAM): a dense model's does not."""
        return False

    def layer_devices(self) -> list[torch.device]:
        if self.placement is not None:
            return list(self.placement.layers)
        return [module_device(layer.input_layernorm) for layer in self.model.layers]

    def _device_before(self, start: int, x: torch.Tensor) -> torch.device:
        """The device the hidden state entering layer `start` is on: the placement's (the embedding's,
        or layer start-1's), else x's."""
        p = self.placement
        if p is None:
            return x.device
        return p.layers[start - 1] if start > 0 else p.embed

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (norm weights are always stored in it)."""
        return self.model.norm.weight.dtype

    def layer_dtypes(self) -> list[torch.dtype]:
        """The activation dtype each layer computes in: its norm weights' (in a model split between
        a GPU and the CPU, the CPU layers compute in float32, the C kernels' dtype)."""
        return [layer.input_layernorm.weight.dtype for layer in self.model.layers]

    def make_cache(self, batch: int, length: int, dtype: torch.dtype) -> KVCache:
        """A KV cache of `length` slots in `dtype`; CPU layers of a split model keep theirs in their
        compute dtype, which the CPU attention kernels read."""
        if self.args.embed_scale:  # HF rounds the scale to the activation dtype; a float keeps graphs static
            self._embed_scale = float(torch.tensor(self.args.embed_scale, dtype=self.dtype))
        devices = self.layer_devices()
        cpu = torch.device("cpu")
        # split: CPU layers beside GPU layers, or beside a head on the GPU (the final norm's device)
        split = len({d == cpu for d in [*devices, *([self.placement.norm] if self.placement else [])]}) > 1
        dtypes = [t if split and d == cpu else dtype for t, d in zip(self.layer_dtypes(), devices)]
        return self.Cache(self.args, batch, length, dtypes, devices)

    def block_context(self, layer: int, T: int, device, dtype=torch.float32):
        """(cos, sin, mask, slots) to run one decoder layer over whole sequences of T tokens."""
        a = self.args
        rope = a.rope_local if a.is_sliding(layer) and a.rope_local else a.rope
        cos, sin = rope_tables(rope, a.rope_dim, T, device)
        slots = torch.arange(T, device=device)
        # plain causal attention needs no mask tensor (lets SDPA use its flash kernels)
        mask = (self._mask(slots, torch.zeros(1, dtype=torch.long, device=device), T, True, device)
                if a.is_sliding(layer) else None)
        return cos[None, :, None], sin[None, :, None], mask, slots

    def _mask(self, slots, pad, S: int, sliding: bool, device) -> torch.Tensor:
        """(B, 1, T, S) bool: causal, no padding, inside the window for sliding layers."""
        s = torch.arange(S, device=device)
        sl = slots.to(device)[:, None]
        m = (s[None, :] <= sl)[None] & (s[None, None, :] >= pad.to(device)[:, None, None])
        if sliding:
            m = m & (sl - s[None, :] < self.args.sliding_window)[None]
        return m[:, None]

    def forward(self, input_ids: torch.Tensor, slots: torch.Tensor | None = None, cache: KVCache | None = None,
                pad: torch.Tensor | None = None, kv_len: int | None = None, last_only: bool = False):
        """Logits (B, T, V), or (B, 1, V) with last_only. Without a cache: a plain causal pass."""
        B, T = input_ids.shape
        if cache is None:
            cache = self.make_cache(B, T, self.dtype)
            slots = torch.arange(T, device=module_device(self.model.embed_tokens))
        x = self.embed(input_ids)
        x = self.forward_layers(x, 0, len(self.model.layers), slots, cache, pad, kv_len)
        return self.head(x, last_only)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings (B, T, H), in the first layer's activation dtype."""
        x = self.model.embed_tokens(input_ids.to(module_device(self.model.embed_tokens)))
        x = x.to(self.model.layers[0].input_layernorm.weight.dtype if len(self.model.layers) else self.dtype)
        return x * self._embed_scale if self.args.embed_scale else x

    def forward_layers(self, x: torch.Tensor, start: int, end: int, slots: torch.Tensor, cache: KVCache,
                       pad: torch.Tensor | None = None, kv_len: int | None = None) -> torch.Tensor:
        """Decoder layers start..end-1 over x (B, T, H); each layer gets x on its device and in its
        dtype (layer_dtypes)."""
        if pad is None:
            pad = torch.zeros(x.shape[0], dtype=torch.long, device=slots.device)
        S = kv_len if kv_len is not None else cache.length
        per_dev: dict = {}
        placed = self.placement.layers if self.placement is not None else None
        at = self._device_before(start, x)
        # a decode step's covered CPU layers: one C call each (dsq/runtime/fused_layer.py, attached at load)
        step = None
        if not torch.compiler.is_compiling() and self._fused_decode is not None and x.shape[1] == 1:
            step = self._fused_decode.begin(x, slots, cache, pad, kv_len)
        for i in range(start, end):
            if step is not None:
                y = step.run(i, x)
                if y is not None:
                    x = y
                    continue
            layer = self.model.layers[i]
            dev = placed[i] if placed is not None else cache.k[i].device
            dtype = layer.input_layernorm.weight.dtype
            if dev != at:  # the hidden state crosses to the next device once, here
                x, at = cross_device(x, dev, dtype), dev
            cos, sin, mask, sl = self.layer_context(i, dev, slots, pad, S, cache, per_dev)
            x = layer(_cast(x, dtype), cos, sin, mask, cache, sl, kv_len)
        return x

    def layer_context(self, i: int, dev: torch.device, slots: torch.Tensor, pad: torch.Tensor, S: int, cache: KVCache,
                      memo: dict | None = None) -> tuple:
        """(cos, sin, mask, slots) for layer i on `dev` over S cache slots; `memo` shares them
        between layers of one device and window kind."""
        a = self.args
        key = (str(dev), a.is_sliding(i))
        if memo is not None and key in memo:
            return memo[key]
        sl, pd = slots.to(dev), pad.to(dev)
        pos = (sl[None, :] - pd[:, None])[:, :, None]  # (B, T, 1): cos/sin broadcast over heads
        cos, sin = cache.rope_on("local" if a.is_sliding(i) and a.rope_local else "full", dev)
        ctx = (cos[pos], sin[pos], self._mask(sl, pd, S, a.is_sliding(i), dev), sl)
        if memo is not None:
            memo[key] = ctx
        return ctx

    def head(self, x: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Final norm and output head: logits (B, T, V), or (B, 1, V) with last_only."""
        p = self.placement
        if p is None:
            x = x.to(self.model.norm.weight.device, self.dtype)
        elif p.norm != (p.layers[-1] if p.layers else p.embed):
            x = cross_device(x, p.norm, self.dtype)
        x = self.model.norm(_cast(x, self.dtype))
        if last_only:
            x = x[:, -1:]
        return self.logits(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The output head over final-normed hidden states x. A quantized head in RAM reading x from
        a GPU gets it in float32, its C kernels' dtype: the logits are then float32, which the CPU's
        sampling reads at twice bf16's speed (a 16-bit float head keeps x's dtype)."""
        dev = module_device(self.lm_head)
        if dev.type == "cpu" and x.device.type != "cpu" and not any(
                p.dtype in (torch.float16, torch.bfloat16) for p in self.lm_head.parameters()):
            x = x.float()
        p = self.placement
        if p is None:
            x = x.to(dev)
        elif p.head != p.norm:
            x = cross_device(x, p.head)
        return self.softcap(self.lm_head(x))

    def softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's output capped as the architecture asks (final_logit_softcapping), else as is."""
        if self.args.final_logit_softcapping:
            c = self.args.final_logit_softcapping
            logits = torch.tanh(logits / c) * c
        return logits
