"""Load, validate and apply the YAML recipes in recipes/ (installed as dsq.recipes)."""

from __future__ import annotations

from importlib import resources

import yaml

from dsq.errors import DsqError

REQUIRED = ("name", "model", "architecture", "params_b", "shape", "quantize", "memory_gb", "parallel", "serve")
SERVE = ("dsq", "llama_cpp", "ollama", "vllm", "sglang")
SUPPORT = ("native", "pending")  # dsq_support: dsq quantizes and runs the architecture, or refuses it
FORMATS = {"bf16": 16, "fp8": 8, "q8_0": 8.5, "q4_k_m": 4.5, "awq_int4": 4}  # memory_gb.weights: nominal bits
_QUANT_KEYS = {"method", "bits", "group_size", "sym", "act_order", "damp", "fp8_scheme", "fp8_format", "type",
               "imatrix", "calib", "calib_samples", "calib_seq_len", "keep_16bit"}


def list_recipes() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("dsq.recipes").iterdir() if p.name.endswith(".yaml"))


def load_recipe(name: str) -> dict:
    f = resources.files("dsq.recipes").joinpath(f"{name}.yaml")
    if not f.is_file():
        raise DsqError(f"no recipe named {name!r}", f"available: {', '.join(list_recipes())}")
    return yaml.safe_load(f.read_text(encoding="utf-8"))


def validate_recipe(r: dict) -> None:
    """Raise DsqError naming the first problem."""
    from dsq.quant.registry import spec_from_options

    name = r.get("name", "?")
    missing = [k for k in REQUIRED if k not in r]
    if missing:
        raise DsqError(f"recipe {name}: missing {', '.join(missing)}")
    q = r["quantize"]
    unknown = set(q) - _QUANT_KEYS
    if unknown:
        raise DsqError(f"recipe {name}: unknown quantize keys {sorted(unknown)}")
    spec = spec_from_options(recipe_options(q)).validate()
    missing = [s for s in SERVE if not r["serve"].get(s)]
    if missing:
        raise DsqError(f"recipe {name}: no serving command for {', '.join(missing)}")
    sh, par = r["shape"], r["parallel"]
    for k in ("tp", "pp", "ep"):
        if not isinstance(par.get(k), int) or par[k] < 1:
            raise DsqError(f"recipe {name}: parallel.{k} must be a positive integer")
    if sh["heads"] % par["tp"] or sh["kv_heads"] % par["tp"] and par["tp"] % sh["kv_heads"]:
        raise DsqError(f"recipe {name}: tensor parallel size {par['tp']} does not split {sh['heads']} heads "
                       f"/ {sh['kv_heads']} KV heads")
    if sh["layers"] < par["pp"]:
        raise DsqError(f"recipe {name}: pipeline parallel size {par['pp']} exceeds {sh['layers']} layers")
    if par["ep"] > 1 and par["ep"] > sh.get("experts", 0):
        raise DsqError(f"recipe {name}: expert parallel size {par['ep']} needs a model with that many experts")
    if f"--tensor-parallel-size {par['tp']}" not in r["serve"]["vllm"] and par["tp"] > 1:
        raise DsqError(f"recipe {name}: the vLLM command does not use --tensor-parallel-size {par['tp']}")
    if r.get("dsq_support", "native") not in SUPPORT:
        raise DsqError(f"recipe {name}: dsq_support must be one of {', '.join(SUPPORT)}")
    _validate_moe(r)
    bits = spec.impl.weight_bits(spec)
    floor = r["params_b"] * bits / 8 * 0.9
    if r["memory_gb"]["artifact"] < floor:
        raise DsqError(f"recipe {name}: an artifact of {r['memory_gb']['artifact']} GB is too small for "
                       f"{r['params_b']}B parameters at {bits} bits")


def _validate_moe(r: dict) -> None:
    """memory_gb.weights (GB per format) and offload (the `dsq offload` plans), where a recipe has them."""
    name, sh = r.get("name", "?"), r["shape"]
    for fmt, gb in r["memory_gb"].get("weights", {}).items():
        if fmt not in FORMATS:
            raise DsqError(f"recipe {name}: memory_gb.weights has unknown format {fmt!r} (one of {', '.join(FORMATS)})")
        # embeddings and layers kept 16-bit only add: a size under the nominal bits is wrong
        if not FORMATS[fmt] / 8 * r["params_b"] * 0.95 <= gb <= r["params_b"] * 2 * 1.05:
            raise DsqError(f"recipe {name}: {gb} GB of {fmt} weights does not fit {r['params_b']}B parameters")
    if "active_params_b" in r and not 0 < r["active_params_b"] <= r["params_b"]:
        raise DsqError(f"recipe {name}: active_params_b must be between 0 and params_b")
    for p in r.get("offload", {}).get("plans", []):
        where = f"recipe {name}: offload plan for {p.get('gpu_gb')} GB"
        if p.get("experts") not in ("cpu", "gpu") or not 0 <= p.get("gpu_layers", -1) <= sh["layers"]:
            raise DsqError(f"{where}: experts must be cpu or gpu and gpu_layers 0..{sh['layers']}")
        if p["gpu_used_gb"] > p["gpu_gb"] or p["fits"] != (p["ram_used_gb"] <= max(p["ram_gb"])):
            raise DsqError(f"{where}: its GPU or RAM use does not match its budget and `fits`")


def apply_recipe(name: str, opts: dict) -> dict:
    """CLI options with the recipe's quantize settings applied."""
    r = load_recipe(name)
    validate_recipe(r)
    if r.get("dsq_support") == "pending":
        raise DsqError(f"recipe {name} targets {r['architecture']}, which dsq cannot quantize yet",
                       f"serve the released weights: {r['serve']['vllm']}")
    return {**opts, **recipe_options(r["quantize"])}


def recipe_options(q: dict) -> dict:
    """A recipe's quantize section under the CLI's option names (type -> qtype, keep_16bit -> skip)."""
    out = {{"type": "qtype", "keep_16bit": "skip"}.get(k, k): v for k, v in q.items()}
    out["skip"] = list(out.get("skip", []))
    return out
