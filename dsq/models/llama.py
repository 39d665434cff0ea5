"""Llama (and DeepSeek-R1-Distill-Llama): the base transformer with SiLU MLP and llama3 rope."""

from __future__ import annotations

from dsq.formats.hf import rope_parameters
from dsq.models.base import ModelArgs, Transformer

REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def args_from_config(cfg: dict) -> ModelArgs:
    heads = cfg["num_attention_heads"]
    return ModelArgs(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rope=rope_parameters(cfg), attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)), tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))


Model = Transformer
