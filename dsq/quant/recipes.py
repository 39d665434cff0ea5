"""Load, validate and apply the YAML recipes in recipes/ (installed as dsq.recipes)."""

from __future__ import annotations

from importlib import resources

import yaml

from dsq.errors import DsqError

REQUIRED = ("name", "model", "architecture", "params_b", "shape", "quantize", "memory_gb", "parallel", "serve")
SERVE = ("llama_cpp", "ollama", "vllm", "sglang")
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
    bits = spec.impl.weight_bits(spec)
    floor = r["params_b"] * bits / 8 * 0.9
    if r["memory_gb"]["artifact"] < floor:
        raise DsqError(f"recipe {name}: an artifact of {r['memory_gb']['artifact']} GB is too small for "
                       f"{r['params_b']}B parameters at {bits} bits")


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
