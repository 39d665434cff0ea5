"""Architectures dsq converts between HF and GGUF, as data: names, hyperparameters, quirks.

One `ArchSpec` per HF `model_type`. Tensor names follow llama.cpp (`gguf.get_tensor_name_map`
is the oracle in the tests); hyperparameter keys follow llama.cpp's `<arch>.*` conventions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsq.errors import UnsupportedModel

# HF name inside a decoder block -> GGUF name inside `blk.N.`
_LLAMA_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_BIASES = {
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
}
_GEMMA3_BLOCK = {
    **{k: v for k, v in _LLAMA_BLOCK.items() if k != "post_attention_layernorm.weight"},
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


@dataclass(frozen=True)
class ArchSpec:
    model_type: str  # HF config.json model_type
    gguf_arch: str  # general.architecture
    hf_class: str  # HF architectures[0]
    block_names: dict[str, str]
    permute_qk: bool = False  # llama.cpp's llama arch wants q/k rows interleaved for rope
    norm_offset: float = 0.0  # Gemma stores (1 + w); GGUF holds the sum
    required: tuple[str, ...] = ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                 "intermediate_size", "vocab_size")
    extra_config: dict[str, Any] = field(default_factory=dict)

    def hf_to_gguf_name(self, name: str) -> str | None:
        if name in _GLOBAL:
            return _GLOBAL[name]
        if name.startswith("model.layers."):
            rest = name[len("model.layers."):]
            idx, _, suffix = rest.partition(".")
            g = self.block_names.get(suffix) or _BIASES.get(suffix)
            if g is not None and idx.isdigit():
                return f"blk.{idx}.{g}"
        return None

    def gguf_to_hf_name(self, name: str) -> str | None:
        for hf, g in _GLOBAL.items():
            if g == name:
                return hf
        if name.startswith("blk."):
            idx, _, suffix = name[4:].partition(".")
            for hf, g in {**self.block_names, **_BIASES}.items():
                if g == suffix:
                    return f"model.layers.{idx}.{hf}"
        return None

    def is_norm(self, hf_name: str) -> bool:
        return hf_name.endswith("norm.weight")

    def _qk_heads(self, hf_name: str, n_head: int, n_kv: int) -> int | None:
        if not self.permute_qk:
            return None
        return n_head if hf_name.endswith("q_proj.weight") else n_kv if hf_name.endswith("k_proj.weight") else None

    def to_gguf(self, hf_name: str, w, n_head: int, n_kv: int):
        """An HF tensor as GGUF stores it: llama's q/k rows interleaved, Gemma's norms as 1 + w."""
        heads = self._qk_heads(hf_name, n_head, n_kv)
        if heads:
            w = permute_qk(w, heads)
        return w + self.norm_offset if self.norm_offset and self.is_norm(hf_name) else w

    def from_gguf(self, hf_name: str, w, n_head: int, n_kv: int):
        """The inverse of `to_gguf`; rows may be raw quant blocks (a row permutation needs no dequant)."""
        heads = self._qk_heads(hf_name, n_head, n_kv)
        if heads:
            w = unpermute_qk(w, heads)
        return w - self.norm_offset if self.norm_offset and self.is_norm(hf_name) else w

    def gguf_plan(self, names: list[str], where: str) -> list[tuple[str, str]]:
        """[(gguf name, HF name)] for a GGUF's tensors (rope_freqs is config, not a weight)."""
        plan = []
        for n in names:
            if n == "rope_freqs.weight":
                continue
            h = self.gguf_to_hf_name(n)
            if h is None:
                raise UnsupportedModel(f"{where}: tensor {n} has no place in a {self.model_type} model")
            plan.append((n, h))
        return plan


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", "llama", "LlamaForCausalLM", _LLAMA_BLOCK, permute_qk=True),
    "qwen2": ArchSpec("qwen2", "qwen2", "Qwen2ForCausalLM", _LLAMA_BLOCK),
    "gemma3_text": ArchSpec("gemma3_text", "gemma3", "Gemma3ForCausalLM", _GEMMA3_BLOCK, norm_offset=1.0),
}
GGUF_TO_MODEL_TYPE = {s.gguf_arch: s.model_type for s in ARCHS.values()}

# Everything llama.cpp runs can be *run* from GGUF; these are the ones dsq converts.
SUPPORTED = ", ".join(ARCHS)


def arch_for_model_type(model_type: str) -> ArchSpec:
    if model_type == "gemma3":
        raise UnsupportedModel(
            "multimodal Gemma 3 checkpoints (model_type gemma3) are not supported yet",
            "use a text-only Gemma 3 checkpoint (model_type gemma3_text)",
        )
    spec = ARCHS.get(model_type)
    if spec is None:
        raise UnsupportedModel(
            f"architecture {model_type!r} is not supported",
            f"supported: {SUPPORTED}",
        )
    return spec


def arch_for_gguf(gguf_arch: str) -> ArchSpec:
    mt = GGUF_TO_MODEL_TYPE.get(gguf_arch)
    if mt is None:
        raise UnsupportedModel(
            f"GGUF architecture {gguf_arch!r} cannot be converted to HF yet",
            f"supported: {', '.join(GGUF_TO_MODEL_TYPE)}",
        )
    return ARCHS[mt]


def permute_qk(w, n_head: int):
    """HF rotate-half q/k rows -> llama.cpp interleaved pairs (convert_hf_to_gguf's `permute`)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w, n_head: int):
    """Inverse of `permute_qk`."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(rope: dict, head_dim: int):
    """Per-frequency divisors for llama3 rope scaling, written as `rope_freqs.weight`."""
    import math

    import torch

    base = rope.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor = rope.get("factor", 8.0)
    lo, hi = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    lo_wl, hi_wl = old_ctx / lo, old_ctx / hi
    out = []
    for f in freqs.tolist():
        wl = 2 * math.pi / f
        if wl < hi_wl:
            out.append(1.0)
        elif wl > lo_wl:
            out.append(factor)
        else:
            smooth = (old_ctx / wl - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def llama3_rope_from_factors(factors, rope_theta: float, head_dim: int) -> dict | None:
    """Recover llama3 rope-scaling settings from a GGUF `rope_freqs` tensor (the inverse of
    `llama3_rope_factors`), assuming the usual low/high frequency factors 1 and 4. None when no
    setting reproduces the tensor."""
    import math

    import numpy as np

    f = np.asarray(factors, dtype=np.float64)
    big = float(f.max())
    lo, hi = 1.0, 4.0
    freqs = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2) / head_dim))
    wl = 2 * math.pi / freqs
    mid = (f > 1 + 1e-6) & (f < big - 1e-6)
    cands = []
    if mid.any():
        s = (1 / f[mid] - 1 / big) / (1 - 1 / big)
        cands.append(int(round(float(np.median((s * (hi - lo) + lo) * wl[mid])))))
    cands += [8192, 4096, 16384, 32768, 2048, 131072]
    for old in cands:
        rope = {"rope_type": "llama3", "rope_theta": rope_theta, "factor": big, "low_freq_factor": lo,
                "high_freq_factor": hi, "original_max_position_embeddings": old}
        if np.allclose(llama3_rope_factors(rope, head_dim).numpy(), f, rtol=1e-4, atol=1e-4):
            return rope
    return None


def head_dim(config: dict) -> int:
    hd = config.get("head_dim")
    return int(hd) if hd else config["hidden_size"] // config["num_attention_heads"]


def gemma3_layer_types(config: dict) -> list[str]:
    lt = config.get("layer_types")
    if lt:
        return list(lt)
    pattern = int(config.get("sliding_window_pattern", 6) or 6)
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(config["num_hidden_layers"])]

