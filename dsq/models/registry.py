"""HF model_type -> architecture module (one file per architecture, found by name)."""

from __future__ import annotations

import importlib

from dsq.errors import BadModelFile, UnsupportedModel

MODULES = {"llama": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3"}


def arch_module(model_type: str):
    name = MODULES.get(model_type)
    if name is None:
        raise UnsupportedModel(f"architecture {model_type!r} is not supported by the native runtime",
                               f"supported: {', '.join(MODULES)}")
    return importlib.import_module(f"dsq.models.{name}")


def build_args(cfg: dict, where: str = "config.json"):
    """ModelArgs for a config dict, or a one-line error naming the missing field."""
    mod = arch_module(cfg.get("model_type", ""))
    missing = [k for k in mod.REQUIRED if k not in cfg]
    if missing:
        raise BadModelFile(f"{where} is missing {', '.join(missing)}", "fix or re-download the config")
    try:
        return mod, mod.args_from_config(cfg)
    except (KeyError, TypeError, ValueError) as e:
        raise BadModelFile(f"{where} has an unusable value ({type(e).__name__}: {e})", "fix the config") from e
