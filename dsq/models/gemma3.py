"""Gemma 3 (text): sandwich norms stored as (w - 1), qk-norm, GELU-tanh MLP, embeddings scaled
by sqrt(hidden), sliding-window layers with their own rope base, optional logit soft-capping."""

from __future__ import annotations

from dsq.formats.arch import gemma3_layer_types
from dsq.formats.hf import rope_parameters
from dsq.models.base import ModelArgs, Transformer

REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def args_from_config(cfg: dict) -> ModelArgs:
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or 256
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    return ModelArgs(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        rope=rope_parameters(cfg, "full_attention"), rope_local=rope_parameters(cfg, "sliding_attention"),
        attention_bias=bool(cfg.get("attention_bias", False)), tie_word_embeddings=cfg.get("tie_word_embeddings", True),
        hidden_act="gelu_tanh" if "gelu" in act else "silu", norm_offset=1.0, qk_norm=True, sandwich_norm=True,
        embed_scale=cfg["hidden_size"] ** 0.5, query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", head_dim),
        sliding_window=cfg.get("sliding_window"), layer_types=gemma3_layer_types(cfg),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"))


Model = Transformer
