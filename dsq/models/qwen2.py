"""Qwen2 (and DeepSeek-R1-Distill-Qwen): Llama with biases on q/k/v."""

from __future__ import annotations

from dataclasses import replace

from dsq.models import llama
from dsq.models.base import ModelArgs, Transformer

REQUIRED = llama.REQUIRED


def args_from_config(cfg: dict) -> ModelArgs:
    if cfg.get("use_sliding_window"):
        from dsq.errors import UnsupportedModel

        raise UnsupportedModel("Qwen2 with use_sliding_window is not supported", "set it to false in config.json")
    return replace(llama.args_from_config(cfg), attention_bias=True, mlp_bias=False)


Model = Transformer
