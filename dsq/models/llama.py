"""Llama (and DeepSeek-R1-Distill-Llama): the base transformer with SiLU MLP and llama3 rope."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsq.formats.hf import rope_parameters
from dsq.models.arch import Arch

if TYPE_CHECKING:
    from dsq.formats.gguf_file import GGUFFile
    from dsq.models.base import ModelArgs

BLOCK_NAMES = {
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


def args_from_config(cfg: dict) -> ModelArgs:
    from dsq.models.base import ModelArgs

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


def read_gguf(g: GGUFFile, cfg: dict, tensor_names: set[str]) -> dict:
    return {"hidden_act": "silu", "attention_bias": "blk.0.attn_q.bias" in tensor_names, "mlp_bias": False}


ARCH = Arch(model_types=("llama",), hf_class="LlamaForCausalLM", gguf_arch="llama",
            args_from_config=args_from_config, block_names=BLOCK_NAMES, permute_qk=True, read_gguf=read_gguf)
