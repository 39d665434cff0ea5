"""Qwen2 (and DeepSeek-R1-Distill-Qwen): Llama with biases on q/k/v."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from dsq.models import llama
from dsq.models.arch import Arch

if TYPE_CHECKING:
    from dsq.formats.gguf_file import GGUFFile
    from dsq.models.base import ModelArgs


def args_from_config(cfg: dict) -> ModelArgs:
    if cfg.get("use_sliding_window"):
        from dsq.errors import UnsupportedModel

        raise UnsupportedModel("Qwen2 with use_sliding_window is not supported", "set it to false in config.json")
    return replace(llama.args_from_config(cfg), attention_bias=True, mlp_bias=False)


def read_gguf(g: GGUFFile, cfg: dict, tensor_names: set[str]) -> dict:
    return {"hidden_act": "silu", "attention_bias": True, "mlp_bias": False, "use_sliding_window": False}


ARCH = Arch(model_types=("qwen2",), hf_class="Qwen2ForCausalLM", gguf_arch="qwen2",
            args_from_config=args_from_config, block_names=llama.BLOCK_NAMES, read_gguf=read_gguf,
            chat_template="chatml")
