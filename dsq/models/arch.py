"""What an architecture is, as one value: the `Arch` entry each dsq/models/<arch>.py defines.

An entry holds every fact about its architecture that the rest of dsq asks: HF and GGUF names,
tensor names both ways, the weight transforms llama.cpp expects, the config -> ModelArgs
function, the GGUF keys it writes and reads back, its sliding-window layers, its chat-template
fallback and its torch model. Tensor names follow llama.cpp (`gguf.get_tensor_name_map` is the
oracle in the tests); GGUF keys follow llama.cpp's `<arch>.*` conventions.

Nothing here imports torch: the registry is read by paths (llama.cpp's) that never load it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from dsq.errors import UnsupportedModel

if TYPE_CHECKING:
    from dsq.formats.gguf_file import GGUFFile
    from dsq.models.base import ModelArgs

GLOBAL_NAMES = {  # HF name -> GGUF name, outside the decoder blocks
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
BIAS_NAMES = {  # HF name inside model.layers.N -> GGUF name inside blk.N, for every architecture
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
}
REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def _no_gguf_keys(w, cfg: dict) -> None:
    return None


def _no_hf_keys(g: GGUFFile, cfg: dict, tensor_names: set[str]) -> dict:
    return {}


@dataclass(frozen=True, kw_only=True)
class Arch:
    model_types: tuple[str, ...]  # HF config.json model_type values; the first is written back
    hf_class: str  # HF architectures[0]
    gguf_arch: str  # GGUF general.architecture
    args_from_config: Callable[[dict], ModelArgs]  # config.json -> the torch model's arguments
    block_names: dict[str, str]  # HF name inside model.layers.N -> GGUF name inside blk.N (biases: BIAS_NAMES)
    model: str = "dsq.models.base:Transformer"  # the torch model class, imported when first asked for
    required: tuple[str, ...] = REQUIRED  # config.json keys without which nothing can be built
    refused: dict[str, tuple[str, str]] = field(default_factory=dict)  # related model_type -> (error, hint)
    permute_qk: bool = False  # llama.cpp's arch wants q/k rows interleaved for its rope
    norm_offset: float = 0.0  # the checkpoint stores norms as (w - offset); GGUF and the model hold w
    tied_default: bool = False  # tie_word_embeddings when config.json does not say
    gguf_head_dim_always: bool = False  # write attention.key/value_length even when config.json has no head_dim
    gguf_rope_dims: bool = True  # write rope.dimension_count
    write_gguf: Callable[[Any, dict], None] = _no_gguf_keys  # (GGUFWriter, config): keys after the common ones
    read_gguf: Callable[[GGUFFile, dict, set[str]], dict] = _no_hf_keys  # (file, config so far, tensor names) -> keys
    sliding_layers: Callable[[dict], list[bool]] | None = None  # config.json -> per layer: sliding-window attention?
    sliding_period: int = 0  # GGUF without a layer pattern: every n-th layer is global (0: no sliding window)
    chat_template: str | None = None  # fallback when the model has none: a name in runtime.chat_template.TEMPLATES

    @property
    def model_type(self) -> str:
        return self.model_types[0]

    @property
    def Model(self) -> type:  # noqa: N802 - a class: arch.Model(args)
        module, _, name = self.model.partition(":")
        return getattr(importlib.import_module(module), name)

    def hf_to_gguf_name(self, name: str) -> str | None:
        if name in GLOBAL_NAMES:
            return GLOBAL_NAMES[name]
        if name.startswith("model.layers."):
            idx, _, suffix = name[len("model.layers."):].partition(".")
            g = self.block_names.get(suffix) or BIAS_NAMES.get(suffix)
            if g is not None and idx.isdigit():
                return f"blk.{idx}.{g}"
        return None

    def gguf_to_hf_name(self, name: str) -> str | None:
        for hf, g in GLOBAL_NAMES.items():
            if g == name:
                return hf
        if name.startswith("blk."):
            idx, _, suffix = name[4:].partition(".")
            for hf, g in {**self.block_names, **BIAS_NAMES}.items():
                if g == suffix:
                    return f"model.layers.{idx}.{hf}"
        return None

    def _qk_heads(self, hf_name: str, n_head: int, n_kv: int) -> int | None:
        if not self.permute_qk:
            return None
        return n_head if hf_name.endswith("q_proj.weight") else n_kv if hf_name.endswith("k_proj.weight") else None

    def _offset_norm(self, hf_name: str) -> bool:
        return bool(self.norm_offset) and hf_name.endswith("norm.weight")

    def to_gguf(self, hf_name: str, w, n_head: int, n_kv: int):
        """An HF tensor as GGUF stores it (q/k rows interleaved, norms with their offset added)."""
        heads = self._qk_heads(hf_name, n_head, n_kv)
        if heads:
            w = permute_qk(w, heads)
        return w + self.norm_offset if self._offset_norm(hf_name) else w

    def from_gguf(self, hf_name: str, w, n_head: int, n_kv: int):
        """The inverse of `to_gguf`; rows may be raw quant blocks (a row permutation needs no dequant)."""
        heads = self._qk_heads(hf_name, n_head, n_kv)
        if heads:
            w = unpermute_qk(w, heads)
        return w - self.norm_offset if self._offset_norm(hf_name) else w

    def gguf_plan(self, names: list[str], where: str) -> list[tuple[str, str]]:
        """[(gguf name, HF name)] for a GGUF's tensors (rope_freqs is config, not a weight)."""
        plan = []
        for n in names:
            if n == "rope_freqs.weight":
                continue
            h = self.gguf_to_hf_name(n)
            if h is None:
                raise UnsupportedModel(f"{where}: tensor {n} has no place in a {self.model_type} model")
            plan.append((n, h))
        return plan


def permute_qk(w, n_head: int):
    """HF rotate-half q/k rows -> llama.cpp interleaved pairs (convert_hf_to_gguf's `permute`)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w, n_head: int):
    """Inverse of `permute_qk`."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def head_dim(config: dict) -> int:
    hd = config.get("head_dim")
    return int(hd) if hd else config["hidden_size"] // config["num_attention_heads"]


def sliding_from_gguf(pattern, n_layer: int, period: int) -> list[bool]:
    """Per layer: sliding-window attention? From a GGUF's attention.sliding_window_pattern, which
    is a list of flags or a period (every period-th layer is global; `period` when absent)."""
    if isinstance(pattern, list):
        return [bool(x) for x in pattern]
    p = int(pattern or period)
    return [(i + 1) % p != 0 for i in range(n_layer)]
