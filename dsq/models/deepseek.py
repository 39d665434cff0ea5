"""DeepSeek V2 (V2-Lite, V2, V2.5) and V3 (V3, R1): multi-head latent attention and mixture of
experts, one GGUF architecture (llama.cpp's `deepseek2`) for both HF model types.

GGUF layout, as llama.cpp's convert_hf_to_gguf writes it and its deepseek2 model loads it:
- the experts of a layer stacked per projection (`ffn_{gate,up,down}_exps`, expert-major);
- kv_b_proj in two parts for llama.cpp's absorbed MLA: `attn_k_b` (heads, kv_lora_rank,
  qk_nope_head_dim: the key rows, transposed) and `attn_v_b` (heads, v_head_dim, kv_lora_rank);
  a whole `attn_kv_b` (GGUFs without the MLA keys, which llama.cpp runs unabsorbed) is read too;
- attention as one key/value head (MQA) of kv_lora_rank + rope dims, with the real per-head
  widths in `key_length_mla` / `value_length_mla`;
- the router's gating function (V2 softmax, V3 sigmoid, which selects the HF model type on the way
  back), V3's `exp_probs_b` selection bias, YaRN's mscale_all_dim as 0.1 * yarn_log_multiplier.
The rope part of q and k is stored as DeepSeek trains it (interleaved pairs, llama.cpp's "norm"
rope), so no rows are permuted.

The torch model lives in dsq.models.deepseek_model (this module is read without torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsq.errors import BadModelFile, UnsupportedModel
from dsq.formats.hf import rope_parameters
from dsq.models import llama
from dsq.models.arch import REQUIRED, Arch

if TYPE_CHECKING:
    from dsq.formats.gguf_file import GGUFFile
    from dsq.models.base import ModelArgs

MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")  # and q_lora_rank, null allowed
MOE_FIELDS = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")

BLOCK_NAMES = {
    **{k: v for k, v in llama.BLOCK_NAMES.items() if "self_attn.k_proj" not in k and "self_attn.v_proj" not in k},
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn_kv_b.weight",  # read from GGUFs without the MLA keys
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
EXPERT_NAMES = {
    "mlp.experts.{x}.gate_proj.weight": "ffn_gate_exps.weight",
    "mlp.experts.{x}.up_proj.weight": "ffn_up_exps.weight",
    "mlp.experts.{x}.down_proj.weight": "ffn_down_exps.weight",
}
SPLIT_NAMES = {"self_attn.kv_b_proj.weight": ("attn_k_b.weight", "attn_v_b.weight")}

# transformers' config defaults where a checkpoint's config.json leaves a field out
DEFAULTS = {
    "deepseek_v2": dict(n_shared_experts=2, routed_scaling_factor=1.0, topk_method="greedy", norm_topk_prob=False,
                        first_k_dense_replace=0, n_group=None, topk_group=None),
    "deepseek_v3": dict(n_shared_experts=1, routed_scaling_factor=2.5, topk_method="noaux_tc", norm_topk_prob=True,
                        first_k_dense_replace=3, n_group=8, topk_group=4),
}
GATING_SOFTMAX, GATING_SIGMOID = 1, 2  # llama.cpp's expert_gating_func values (gguf.ExpertGatingFuncType)


def _get(cfg: dict, key: str):
    """A config value, or transformers' default for its model type when absent or null."""
    v = cfg.get(key)
    return DEFAULTS[cfg["model_type"]][key] if v is None else v


def _rope(cfg: dict) -> dict:
    return rope_parameters(cfg, "full_attention")


def _softmax_scale(cfg: dict) -> float:
    """1/sqrt(qk head dim), times YaRN's mscale(factor, mscale_all_dim)^2 (transformers' yarn_apply_mscale)."""
    from dsq.models.base import yarn_mscale

    scale = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5
    rope = _rope(cfg)
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
    return scale


def _groups(cfg: dict) -> tuple[int, int]:
    return int(_get(cfg, "n_group") or 1), int(_get(cfg, "topk_group") or 1)


def _q_lora_rank(cfg: dict) -> int | None:
    if "q_lora_rank" not in cfg:  # transformers would assume V3's 1536: say so rather than guess
        raise BadModelFile("config.json is missing q_lora_rank",
                           "set it to the q LoRA rank, or null for one q projection (DeepSeek-V2-Lite)")
    return cfg["q_lora_rank"] or None


def _check_moe(cfg: dict) -> None:
    if int(cfg.get("moe_layer_freq", 1) or 1) != 1:
        raise UnsupportedModel(f"moe_layer_freq {cfg['moe_layer_freq']} is not supported",
                               "dsq and llama.cpp run DeepSeek models with an MoE block in every layer from "
                               "first_k_dense_replace on (moe_layer_freq 1)")
    n_group, _ = _groups(cfg)
    if cfg["n_routed_experts"] % n_group:
        raise UnsupportedModel(f"n_routed_experts {cfg['n_routed_experts']} is not a multiple of n_group {n_group}",
                               "fix the config")


def args_from_config(cfg: dict) -> ModelArgs:
    from dsq.models.deepseek_model import DeepseekArgs

    _check_moe(cfg)
    heads, v3 = cfg["num_attention_heads"], cfg["model_type"] == "deepseek_v3"
    n_group, topk_group = _groups(cfg)
    return DeepseekArgs(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], rotary_dim=cfg["qk_rope_head_dim"],
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)), rope=_rope(cfg),
        attention_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)) and not v3,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        q_lora_rank=_q_lora_rank(cfg), kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"], rope_interleave=bool(cfg.get("rope_interleave", True)) or not v3,
        softmax_scale=_softmax_scale(cfg), n_routed_experts=cfg["n_routed_experts"],
        n_shared_experts=int(_get(cfg, "n_shared_experts")), moe_intermediate_size=cfg["moe_intermediate_size"],
        num_experts_per_tok=cfg["num_experts_per_tok"], first_k_dense_replace=int(_get(cfg, "first_k_dense_replace")),
        scoring_func="sigmoid" if v3 else "softmax", topk_method="noaux_tc" if v3 else _get(cfg, "topk_method"),
        n_group=n_group, topk_group=topk_group, norm_topk_prob=bool(_get(cfg, "norm_topk_prob")),
        routed_scaling_factor=float(_get(cfg, "routed_scaling_factor")))


# -- GGUF ---------------------------------------------------------------------------------------
def gguf_shape(cfg: dict) -> dict:
    """Attention as llama.cpp's absorbed MLA sees it: one KV head of the latent width."""
    r, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    return {"head_count_kv": 1, "key_length": r + rope, "value_length": r, "rope_dimension_count": rope}


def _check_llama_cpp_runs(cfg: dict) -> None:
    rope = _rope(cfg)
    if cfg["model_type"] == "deepseek_v3" and not cfg.get("rope_interleave", True):
        raise UnsupportedModel("DeepSeek-V3 with rope_interleave false cannot be written as GGUF",
                               "llama.cpp's deepseek2 ropes interleaved pairs, as DeepSeek's checkpoints store them")
    m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
    if rope.get("rope_type") == "yarn" and m and m_all and float(m) != float(m_all):
        raise UnsupportedModel(f"YaRN with mscale {m} != mscale_all_dim {m_all} cannot be written as GGUF",
                               "llama.cpp's deepseek2 assumes the two are equal, as DeepSeek's checkpoints have them")


def write_gguf(w, cfg: dict) -> None:
    from gguf import ExpertGatingFuncType

    _check_llama_cpp_runs(cfg)
    _check_moe(cfg)
    v3 = cfg["model_type"] == "deepseek_v3"
    w.add_leading_dense_block_count(int(_get(cfg, "first_k_dense_replace")))
    w.add_q_lora_rank(_q_lora_rank(cfg) or 0)  # 0: one q projection (llama.cpp requires the key)
    w.add_kv_lora_rank(cfg["kv_lora_rank"])
    w.add_key_length_mla(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    w.add_value_length_mla(cfg["v_head_dim"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_shared_count(int(_get(cfg, "n_shared_experts")))
    w.add_expert_weights_scale(float(_get(cfg, "routed_scaling_factor")))
    if _get(cfg, "norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID if v3 else ExpertGatingFuncType.SOFTMAX)
    if _get(cfg, "n_group") is not None:
        w.add_expert_group_count(int(_get(cfg, "n_group")))
        w.add_expert_group_used_count(int(_get(cfg, "topk_group")))
    rope = _rope(cfg)
    if rope.get("rope_type") == "yarn" and rope.get("mscale_all_dim"):
        w.add_rope_scaling_yarn_log_mul(0.1 * float(rope["mscale_all_dim"]))


def _head_dims(a, rope: int) -> tuple[int, int]:
    """(qk_nope_head_dim, v_head_dim) from the MLA keys, or from a GGUF without them (per-head widths)."""
    if a("attention.key_length_mla") is not None:
        return int(a("attention.key_length_mla")) - rope, int(a("attention.value_length_mla"))
    return int(a("attention.key_length")) - rope, int(a("attention.value_length"))


def _moe_from_gguf(a, v3: bool) -> dict:
    n_group, topk_group = a("expert_group_count"), a("expert_group_used_count")
    grouped = n_group is not None and int(n_group) > 1
    return {
        "n_routed_experts": int(a("expert_count")), "num_experts_per_tok": int(a("expert_used_count")),
        "moe_intermediate_size": int(a("expert_feed_forward_length")),
        "n_shared_experts": int(a("expert_shared_count", 0)),
        "first_k_dense_replace": int(a("leading_dense_block_count", 0)),
        "routed_scaling_factor": float(a("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(a("expert_weights_norm", False)), "scoring_func": "sigmoid" if v3 else "softmax",
        "topk_method": "noaux_tc" if v3 else "group_limited_greedy" if grouped else "greedy",
        "n_group": None if n_group is None else int(n_group),
        "topk_group": None if topk_group is None else int(topk_group),
    }


def read_gguf(g: GGUFFile, cfg: dict, tensor_names: set[str]) -> dict:
    a = g.arch_field
    v3 = a("expert_gating_func") == GATING_SIGMOID
    rope = int(a("rope.dimension_count"))
    nope, v = _head_dims(a, rope)
    out = {
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "num_key_value_heads": cfg["num_attention_heads"], "head_dim": rope,
        "q_lora_rank": int(a("attention.q_lora_rank", 0) or 0) or None,
        "kv_lora_rank": int(a("attention.kv_lora_rank")),
        "qk_rope_head_dim": rope, "qk_nope_head_dim": nope, "v_head_dim": v,
        "rope_interleave": True, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        **_moe_from_gguf(a, v3),
    }
    scaling = cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type") == "yarn" and a("rope.scaling.yarn_log_multiplier"):
        m_all = float(a("rope.scaling.yarn_log_multiplier")) / 0.1
        out["rope_scaling"] = {**scaling, "mscale": m_all, "mscale_all_dim": m_all}
    return out


# -- tensors in and out of GGUF's layout ---------------------------------------------------------
def _kv_b_dims(cfg: dict) -> tuple[int, int, int]:
    return cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]


def split(name: str, w, cfg: dict) -> tuple:
    """kv_b_proj (heads * (nope + v), rank) -> (attn_k_b (heads, rank, nope), attn_v_b (heads, v, rank))."""
    heads, nope, v = _kv_b_dims(cfg)
    k_b, v_b = w.reshape(heads, nope + v, w.shape[-1]).split((nope, v), dim=1)
    return k_b.transpose(1, 2).contiguous(), v_b.contiguous()


def join(name: str, parts: list, cfg: dict):
    """The inverse of `split`."""
    import torch

    k_b, v_b = parts
    heads, nope, v = _kv_b_dims(cfg)
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(heads * (nope + v), k_b.shape[1])


def expert_count(cfg: dict) -> int:
    return int(cfg["n_routed_experts"])


ARCH = Arch(
    model_types=("deepseek_v3", "deepseek_v2"), hf_class="DeepseekV3ForCausalLM", gguf_arch="deepseek2",
    args_from_config=args_from_config, block_names=BLOCK_NAMES, model="dsq.models.deepseek_model:DeepseekTransformer",
    required=REQUIRED + MLA_FIELDS + MOE_FIELDS, gguf_shape=gguf_shape, gguf_rope_dims=False,
    write_gguf=write_gguf, read_gguf=read_gguf, expert_names=EXPERT_NAMES, expert_count=expert_count,
    split_names=SPLIT_NAMES, split=split, join=join, layers_only=True)
