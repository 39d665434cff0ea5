"""Gemma 3 (text): sandwich norms stored as (w - 1), qk-norm, GELU-tanh MLP, embeddings scaled
by sqrt(hidden), sliding-window layers with their own rope base, optional logit soft-capping."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsq.errors import UnsupportedModel
from dsq.formats.hf import rope_parameters
from dsq.models import llama
from dsq.models.arch import Arch, head_dim, sliding_from_gguf

if TYPE_CHECKING:
    from dsq.formats.gguf_file import GGUFFile
    from dsq.models.base import ModelArgs

BLOCK_NAMES = {
    **{k: v for k, v in llama.BLOCK_NAMES.items() if k != "post_attention_layernorm.weight"},
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
SLIDING_PERIOD = 6  # llama.cpp's gemma3 default: every 6th layer is global
LAYERS_27B = 62  # Gemma 3 27B: llama.cpp scales its queries by 1/sqrt(hidden / heads), not by head_dim


def layer_types(config: dict) -> list[str]:
    lt = config.get("layer_types")
    if lt:
        return list(lt)
    pattern = int(config.get("sliding_window_pattern", SLIDING_PERIOD) or SLIDING_PERIOD)
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(config["num_hidden_layers"])]


def sliding_layers(config: dict) -> list[bool]:
    return [t == "sliding_attention" for t in layer_types(config)]


def args_from_config(cfg: dict) -> ModelArgs:
    from dsq.models.base import ModelArgs

    heads = cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or 256
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    return ModelArgs(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads, head_dim=hd,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        rope=rope_parameters(cfg, "full_attention"), rope_local=rope_parameters(cfg, "sliding_attention"),
        attention_bias=bool(cfg.get("attention_bias", False)), tie_word_embeddings=cfg.get("tie_word_embeddings", True),
        hidden_act="gelu_tanh" if "gelu" in act else "silu", norm_offset=1.0, qk_norm=True, sandwich_norm=True,
        embed_scale=cfg["hidden_size"] ** 0.5, query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", hd),
        sliding_window=cfg.get("sliding_window"), layer_types=layer_types(cfg),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"))


def _check_llama_cpp_runs(cfg: dict) -> None:
    if cfg.get("attn_logit_softcapping"):
        raise UnsupportedModel("Gemma 3 with attn_logit_softcapping is not supported by llama.cpp")
    hd = head_dim(cfg)
    qpas = cfg.get("query_pre_attn_scalar", hd)
    if qpas != hd and cfg["num_hidden_layers"] != LAYERS_27B:
        raise UnsupportedModel(f"query_pre_attn_scalar {qpas} != head_dim {hd}",
                               "llama.cpp's gemma3 scales queries by 1/sqrt(head_dim)")


def write_gguf(w, cfg: dict) -> None:
    _check_llama_cpp_runs(cfg)
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
    if cfg.get("sliding_window"):
        w.add_sliding_window(int(cfg["sliding_window"]))
        w.add_sliding_window_pattern(sliding_layers(cfg))
        w.add_rope_freq_base_swa(float(rope_parameters(cfg, "sliding_attention")["rope_theta"]))


def read_gguf(g: GGUFFile, cfg: dict, tensor_names: set[str]) -> dict:
    a = g.arch_field
    window = int(a("attention.sliding_window", 0) or 0)
    swa = sliding_from_gguf(a("attention.sliding_window_pattern"), g.n_layers, SLIDING_PERIOD)
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": cfg["head_dim"],
        "sliding_window": window or None,
        "layer_types": ["sliding_attention" if s and window else "full_attention" for s in swa],
        "rope_local_base_freq": float(a("rope.freq_base_swa", 10000.0)),
        "final_logit_softcapping": a("final_logit_softcapping"),
        "attn_logit_softcapping": None,
        "attention_bias": False,
    }


ARCH = Arch(
    model_types=("gemma3_text",), hf_class="Gemma3ForCausalLM", gguf_arch="gemma3",
    args_from_config=args_from_config, block_names=BLOCK_NAMES, norm_offset=1.0, tied_default=True,
    refused={"gemma3": ("multimodal Gemma 3 checkpoints (model_type gemma3) are not supported yet",
                        "use a text-only Gemma 3 checkpoint (model_type gemma3_text)")},
    gguf_head_dim_always=True, gguf_rope_dims=False, write_gguf=write_gguf, read_gguf=read_gguf,
    sliding_layers=sliding_layers, sliding_period=SLIDING_PERIOD, chat_template="gemma")
