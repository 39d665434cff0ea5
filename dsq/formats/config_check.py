"""config.json as the loaders read it: each field's type and range, and the sizes it implies.

`check_config` runs when an HF directory is opened (the fields every decoder shares) and again with
an architecture's required fields (its registry entry's `Arch.required`). A value of the wrong type
or sign, a head count that does not divide the hidden size, or dimensions whose weights could not
fit in the files beside the config are refused with one line naming the field.
"""

from __future__ import annotations

import math
from typing import Any

from dsq.errors import BadModelFile, UnsupportedModel

I32 = (1 << 31) - 1
# name -> (low, high) for integers; None in a config means "not set" for the optional ones
INTS = {
    "hidden_size": (1, 1 << 20),
    "intermediate_size": (1, 1 << 22),
    "num_hidden_layers": (1, 1 << 16),
    "num_attention_heads": (1, 1 << 16),
    "num_key_value_heads": (1, 1 << 16),
    "head_dim": (1, 1 << 16),
    "vocab_size": (1, 1 << 24),
    "max_position_embeddings": (1, I32),
    "sliding_window": (0, I32),
    "sliding_window_pattern": (1, 1 << 16),
    "query_pre_attn_scalar": (1, 1 << 24),
}
FLOATS = {
    "rms_norm_eps": (0.0, 1.0),
    "rope_theta": (1e-6, 1e30),
    "rope_local_base_freq": (1e-6, 1e30),
    "final_logit_softcapping": (0.0, 1e30),
    "attn_logit_softcapping": (0.0, 1e30),
}
NULLABLE = {"sliding_window", "final_logit_softcapping", "attn_logit_softcapping", "head_dim", "num_key_value_heads",
            "torch_dtype", "hidden_act", "hidden_activation", "rope_scaling", "rope_parameters", "quantization_config",
            "layer_types", "sliding_window_pattern", "use_sliding_window"}
BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")
STRINGS = ("model_type", "hidden_act", "hidden_activation", "torch_dtype")
ROPE_INTS = {"original_max_position_embeddings": (1, I32)}
ROPE_FLOATS = {"factor": (1e-6, 1e6), "low_freq_factor": (1e-6, 1e6), "high_freq_factor": (1e-6, 1e6),
               "rope_theta": (1e-6, 1e30), "attention_factor": (0.0, 1e6), "beta_fast": (0.0, 1e6),
               "beta_slow": (0.0, 1e6), "mscale": (0.0, 1e6), "mscale_all_dim": (0.0, 1e6)}
# rope type -> the fields its frequencies are computed from (models/base.py rope_inv_freq)
ROPE_TYPES = {"default": (), "linear": ("factor",), "llama3": ("factor", "original_max_position_embeddings"),
              "yarn": ("factor", "original_max_position_embeddings")}
QUANT_BITS = (2, 3, 4, 8)


def _bad(where: str, name: str, problem: str) -> BadModelFile:
    return BadModelFile(f"{where}: {name} {problem}", "fix or re-download the config")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_int(where: str, name: str, v: Any, lo: int, hi: int) -> None:
    if not _is_int(v):
        raise _bad(where, name, f"is {v!r}, must be an integer")
    if not lo <= v <= hi:
        raise _bad(where, name, f"is {v}, must be {lo} to {hi}")


def check_float(where: str, name: str, v: Any, lo: float, hi: float) -> None:
    if not _is_number(v) or not math.isfinite(v) or not lo <= v <= hi:
        raise _bad(where, name, f"is {v!r}, must be a finite number from {lo:g} to {hi:g}")


def _present(cfg: dict, where: str, name: str) -> bool:
    """Whether `name` holds a value to check; null only where a loader reads it as "not set"."""
    if name not in cfg:
        return False
    if cfg[name] is None and name not in NULLABLE:
        raise _bad(where, name, "is null")
    return cfg[name] is not None


def _scalars(cfg: dict, where: str) -> None:
    for name, (lo, hi) in INTS.items():
        if _present(cfg, where, name):
            check_int(where, name, cfg[name], lo, hi)
    for name, (lo, hi) in FLOATS.items():
        if _present(cfg, where, name):
            check_float(where, name, cfg[name], lo, hi)
    for name in BOOLS:
        if _present(cfg, where, name) and not isinstance(cfg[name], bool):
            raise _bad(where, name, f"is {cfg[name]!r}, must be true or false")
    for name in STRINGS:
        if _present(cfg, where, name) and not isinstance(cfg[name], str):
            raise _bad(where, name, f"is {cfg[name]!r}, must be a string")


def _token_ids(cfg: dict, where: str) -> None:
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = cfg.get(name)
        ids = v if isinstance(v, list) else [v]
        for x in ids:
            if x is not None:
                check_int(where, name, x, 0, (1 << 24) - 1)


def _rope(cfg: dict, where: str) -> None:
    for key in ("rope_scaling", "rope_parameters"):
        rp = cfg.get(key)
        if rp is None:
            continue
        if not isinstance(rp, dict):
            raise _bad(where, key, "must be an object")
        for sub in [rp, *(v for v in rp.values() if isinstance(v, dict))]:
            _rope_fields(sub, where, key)


def _rope_fields(rp: dict, where: str, key: str) -> None:
    for name, (lo, hi) in ROPE_INTS.items():
        if rp.get(name) is not None:
            check_int(where, f"{key}.{name}", rp[name], lo, hi)
    for name, (lo, hi) in ROPE_FLOATS.items():
        if rp.get(name) is not None:
            check_float(where, f"{key}.{name}", rp[name], lo, hi)
    for name in ("rope_type", "type"):
        if rp.get(name) is not None and not isinstance(rp[name], str):
            raise _bad(where, f"{key}.{name}", "must be a string")
    kind = rp.get("rope_type") if rp.get("rope_type") is not None else rp.get("type")
    if kind is not None:
        if kind not in ROPE_TYPES:
            raise UnsupportedModel(f"{where}: {key} type {kind!r} is not supported",
                                   f"supported: {', '.join(ROPE_TYPES)}")
        missing = [f for f in ROPE_TYPES[kind] if rp.get(f) is None]
        if missing:
            raise _bad(where, f"{key}.{missing[0]}", f"is missing (a {kind} rope needs it)")
    lo, hi = rp.get("low_freq_factor"), rp.get("high_freq_factor")
    if _is_number(lo) and _is_number(hi) and lo == hi:
        raise _bad(where, f"{key}.high_freq_factor", "equals low_freq_factor (the ramp between them divides by the gap)")


def _heads(cfg: dict, where: str) -> None:
    """Head counts that divide what they split, and an even head size (rotary halves)."""
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    hidden, hd = cfg.get("hidden_size"), cfg.get("head_dim")
    if heads and kv and heads % kv:
        raise _bad(where, "num_key_value_heads", f"is {kv}, which does not divide num_attention_heads ({heads})")
    if hd is None and heads and hidden:
        if hidden % heads:
            raise _bad(where, "num_attention_heads", f"is {heads}, which does not divide hidden_size ({hidden})")
        hd = hidden // heads
    if hd is not None and hd % 2:
        raise _bad(where, "head_dim", f"is {hd}, must be even (rotary embeddings rotate pairs)")
    for n in (heads, kv):
        if hd and n and hd * n > 1 << 24:
            raise _bad(where, "head_dim", f"is {hd}, times {n} heads is too large")


def _layer_types(cfg: dict, where: str) -> None:
    lt, n = cfg.get("layer_types"), cfg.get("num_hidden_layers")
    if lt is None:
        return
    if not isinstance(lt, list) or not all(isinstance(x, str) for x in lt):
        raise _bad(where, "layer_types", "must be a list of strings")
    if _is_int(n) and len(lt) != n:
        raise _bad(where, "layer_types", f"has {len(lt)} entries, num_hidden_layers is {n}")


def _quantization(cfg: dict, where: str) -> None:
    qc = cfg.get("quantization_config")
    if qc is None:
        return
    if not isinstance(qc, dict):
        raise _bad(where, "quantization_config", "must be an object")
    if qc.get("quant_method") is not None and not isinstance(qc["quant_method"], str):
        raise _bad(where, "quantization_config.quant_method", "must be a string")
    if qc.get("bits") is not None and qc["bits"] not in QUANT_BITS:
        raise _bad(where, "quantization_config.bits", f"is {qc['bits']!r}, must be one of {QUANT_BITS}")
    if qc.get("quant_method") in ("gptq", "awq") and qc.get("bits") is None:
        raise _bad(where, "quantization_config.bits", "is missing")
    g = qc.get("group_size")
    if g is not None and (not _is_int(g) or not (g == -1 or 1 <= g <= 1 << 20)):
        raise _bad(where, "quantization_config.group_size", f"is {g!r}, must be -1 or a positive integer")


def implied_parameters(cfg: dict) -> int:
    """Weights the config implies: embeddings (and an untied head), attention and MLP per layer."""
    hidden, inter, layers = cfg.get("hidden_size") or 0, cfg.get("intermediate_size") or 0, cfg.get("num_hidden_layers") or 0
    vocab, heads = cfg.get("vocab_size") or 0, cfg.get("num_attention_heads") or 1
    hd = cfg.get("head_dim") or hidden // heads
    kv = cfg.get("num_key_value_heads") or heads
    per_layer = hidden * hd * (2 * heads + 2 * kv) + 3 * hidden * inter
    head = 0 if cfg.get("tie_word_embeddings", True) else vocab * hidden
    return vocab * hidden + head + layers * per_layer


def check_config(cfg: dict, where: str = "config.json", required: tuple[str, ...] = (),
                 weight_bytes: int | None = None) -> None:
    """Raise BadModelFile naming the first field of `cfg` that loaders could not use.

    `required`: fields that must be present (an architecture's `Arch.required`). `weight_bytes`:
    the size of the weight files; the weights the config implies must fit in it at one bit each.
    """
    if not isinstance(cfg, dict):
        raise BadModelFile(f"{where} does not hold a JSON object", "fix or re-download it")
    missing = [k for k in required if cfg.get(k) is None]
    if missing:
        raise BadModelFile(f"{where} is missing {', '.join(missing)}", "fix or re-download the config")
    _scalars(cfg, where)
    _token_ids(cfg, where)
    _rope(cfg, where)
    _heads(cfg, where)
    _layer_types(cfg, where)
    _quantization(cfg, where)
    if weight_bytes is not None:
        n = implied_parameters(cfg)
        if n > 8 * weight_bytes + (1 << 20):
            raise BadModelFile(f"{where}: its dimensions imply {n:,} weights, more than the weight files "
                               f"({weight_bytes:,} bytes) can hold", "fix or re-download the config")
