"""The architectures dsq converts and runs: one `Arch` entry each (dsq.models.arch), and lookups.

Adding an architecture means one new module in dsq/models/ that defines its `ARCH`, and one line
in `ARCHS` below.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsq.errors import BadModelFile, UnsupportedModel
from dsq.models import deepseek, gemma3, llama, qwen2
from dsq.models.arch import Arch

ARCHS: tuple[Arch, ...] = (
    llama.ARCH,
    qwen2.ARCH,
    gemma3.ARCH,
    deepseek.ARCH,
)


@dataclass(frozen=True)
class RunOnly:
    """What placement and chat-template choice know of a GGUF architecture dsq does not convert."""

    sliding_period: int = 0  # see Arch.sliding_period
    chat_template: str | None = None  # see Arch.chat_template


# GGUF architectures llama.cpp runs (and dsq with it) that have no entry above.
RUN_ONLY = {
    "gemma2": RunOnly(sliding_period=2, chat_template="gemma"),
    "gemma": RunOnly(chat_template="gemma"),
    "cohere2": RunOnly(sliding_period=2),
    "qwen3": RunOnly(chat_template="chatml"),
}

_BY_MODEL_TYPE = {mt: a for a in ARCHS for mt in a.model_types}
_BY_GGUF = {a.gguf_arch: a for a in ARCHS}


def find_model_type(model_type: str) -> Arch | None:
    return _BY_MODEL_TYPE.get(model_type)


def find_gguf(gguf_arch: str) -> Arch | RunOnly | None:
    """The entry for a GGUF architecture: a full `Arch`, a `RunOnly`, or None."""
    return _BY_GGUF.get(gguf_arch) or RUN_ONLY.get(gguf_arch)


def arch_for_model_type(model_type: str) -> Arch:
    """The entry for an HF model_type, or UnsupportedModel saying what is supported."""
    for a in ARCHS:
        if model_type in a.refused:
            raise UnsupportedModel(*a.refused[model_type])
    arch = find_model_type(model_type)
    if arch is None:
        raise UnsupportedModel(f"architecture {model_type!r} is not supported",
                               f"supported: {', '.join(_BY_MODEL_TYPE)}")
    return arch


def arch_for_gguf(gguf_arch: str) -> Arch:
    """The entry for a GGUF general.architecture, or UnsupportedModel (conversion to HF needs one)."""
    arch = _BY_GGUF.get(gguf_arch)
    if arch is None:
        raise UnsupportedModel(f"GGUF architecture {gguf_arch!r} cannot be converted to HF yet",
                               f"supported: {', '.join(_BY_GGUF)}")
    return arch


def gguf_name(model_type: str) -> str:
    """The GGUF architecture name of an HF model_type (the name chat-template fallbacks go by);
    the model_type itself when dsq has no entry for it."""
    arch = find_model_type(model_type)
    return arch.gguf_arch if arch else model_type


def build_args(cfg: dict, where: str = "config.json"):
    """(Arch, ModelArgs) for a config dict, or a one-line error naming the missing field."""
    arch = find_model_type(cfg.get("model_type", ""))
    if arch is None:
        raise UnsupportedModel(f"architecture {cfg.get('model_type', '')!r} is not supported by the native runtime",
                               f"supported: {', '.join(_BY_MODEL_TYPE)}")
    missing = [k for k in arch.required if k not in cfg]
    if missing:
        raise BadModelFile(f"{where} is missing {', '.join(missing)}", "fix or re-download the config")
    try:
        return arch, arch.args_from_config(cfg)
    except (KeyError, TypeError, ValueError) as e:
        raise BadModelFile(f"{where} has an unusable value ({type(e).__name__}: {e})", "fix the config") from e
