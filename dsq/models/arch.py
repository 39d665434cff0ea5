"""What an architecture is, as one value: the `Arch` entry each dsq/models/<arch>.py defines.

An entry holds every fact about its architecture that the rest of dsq asks: HF and GGUF names,
tensor names both ways (one tensor each, or as `Made` says: a layer's routed experts stacked into
one GGUF tensor, a tensor written in parts), the weight transforms llama.cpp expects, the config -> ModelArgs
function, the GGUF keys it writes and reads back, its sliding-window layers, its chat-template
fallback and its torch model. Tensor names follow llama.cpp (`gguf.get_tensor_name_map` is the
oracle in the tests); GGUF keys follow llama.cpp's `<arch>.*` conventions.

Nothing here imports torch: the registry is read by paths (llama.cpp's) that never load it.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, Callable

from dsq.errors import BadModelFile, UnsupportedModel

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


def _no_shape_keys(cfg: dict) -> dict:
    return {}


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
    gguf_shape: Callable[[dict], dict] = _no_shape_keys  # config -> shape keys (add_<key>: value) unlike the common
    # Tensors that are not one GGUF tensor each (names inside a block): routed experts, HF name with
    # {x} for the expert -> the stacked GGUF tensor; and tensors written in parts, HF -> GGUF names
    expert_names: dict[str, str] = field(default_factory=dict)
    expert_count: Callable[[dict], int] | None = None  # config.json -> routed experts in each MoE layer
    split_names: dict[str, tuple[str, ...]] = field(default_factory=dict)
    split: Callable[[str, Any, dict], tuple] | None = None  # (HF name in a block, tensor, config) -> its parts
    join: Callable[[str, list, dict], Any] | None = None  # (HF name in a block, parts, config) -> the tensor
    layers_only: bool = False  # layers past num_hidden_layers (DeepSeek-V3's next-token block) are not the model's
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

    def model_tensor(self, name: str, cfg: dict) -> bool:
        """Whether an HF tensor belongs to the model config.json describes."""
        m = re.match(r"model\.layers\.(\d+)\.", name) if self.layers_only else None
        return m is None or int(m.group(1)) < cfg["num_hidden_layers"]

    @cached_property
    def _expert_patterns(self) -> list[tuple[re.Pattern, str]]:
        return [(re.compile(re.escape(h).replace(r"\{x\}", r"(\d+)") + "$"), g) for h, g in self.expert_names.items()]

    def to_gguf_tensors(self, hf_names: list[str], cfg: dict, where: str) -> list[Made]:
        """How each GGUF tensor is made from an HF checkpoint's tensors: one each, the experts of a
        layer stacked, or one tensor in parts (split_names). Unknown tensors are refused."""
        n_head = cfg["num_attention_heads"]
        n_kv = cfg.get("num_key_value_heads") or n_head
        stacks = self.check_experts(hf_names, cfg, where)
        stacked = {name for parts in stacks.values() for name in parts.values()}
        out = []
        for name in (n for n in hf_names if n not in stacked):
            idx, suffix = _block_of(name, "model.layers.")
            if idx is not None and suffix in self.split_names:
                out += [Made(f"blk.{idx}.{g}", (name,), partial(_split_part, self.split, suffix, cfg, j))
                        for j, g in enumerate(self.split_names[suffix])]
            elif (g := self.hf_to_gguf_name(name)) is not None:
                out.append(Made(g, (name,), partial(_one, self.to_gguf, name, n_head, n_kv)))
            else:
                raise UnsupportedModel(f"tensor {name} has no GGUF counterpart for {self.model_type}",
                                       "this checkpoint has parts dsq does not convert yet")
        return out + [Made(f"blk.{idx}.{g}", tuple(parts[x] for x in sorted(parts)), _stack)
                      for (idx, g), parts in stacks.items()]

    def check_experts(self, hf_names: list[str], cfg: dict, where: str) -> dict[tuple[int, str], dict[int, str]]:
        """The routed experts' HF tensors by (layer, stacked GGUF name), expert -> name; every
        layer's experts must be 0..n-1 for the config's n."""
        stacks: dict[tuple[int, str], dict[int, str]] = {}
        for name in hf_names:
            idx, suffix = _block_of(name, "model.layers.")
            expert = self._expert_of(suffix) if idx is not None else None
            if expert is not None:
                stacks.setdefault((idx, expert[0]), {})[expert[1]] = name
        for (idx, g), parts in stacks.items():
            n = self.expert_count(cfg)
            if sorted(parts) != list(range(n)):
                raise BadModelFile(f"{where}: model.layers.{idx} has {len(parts)} experts' {g.split('_')[1]} tensors, "
                                   f"the config says {n} experts", "the checkpoint does not match its config")
        return stacks

    def gguf_target(self, hf_name: str) -> tuple[str, int | None] | None:
        """(GGUF tensor, expert or None) an HF weight goes into; None for one written in parts."""
        idx, suffix = _block_of(hf_name, "model.layers.")
        expert = self._expert_of(suffix) if idx is not None else None
        if expert is not None:
            return f"blk.{idx}.{expert[0]}", expert[1]
        if idx is not None and suffix in self.split_names:
            return None
        g = self.hf_to_gguf_name(hf_name)
        return None if g is None else (g, None)

    def _expert_of(self, suffix: str) -> tuple[str, int] | None:
        """(stacked GGUF name, expert) of an HF expert tensor's name inside its block, or None."""
        for pattern, g in self._expert_patterns:
            m = pattern.match(suffix)
            if m:
                return g, int(m.group(1))
        return None

    def from_gguf_tensors(self, names: list[str], cfg: dict, shape_of: Callable[[str], tuple],
                          where: str) -> list[Made]:
        """How each HF tensor is made from a GGUF's tensors (the inverse of to_gguf_tensors; an
        expert's tensor is a slice of its stacked one). rope_freqs is config, not a weight."""
        n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        stacked = {g: h for h, g in self.expert_names.items()}
        parts_of = {g: h for h, gs in self.split_names.items() for g in gs}
        out, parts = [], {}
        for n in names:
            idx, suffix = _block_of(n, "blk.")
            if n == "rope_freqs.weight":
                continue
            if idx is not None and suffix in stacked:
                out += self._experts_from(n, idx, stacked[suffix], shape_of(n), cfg, where)
            elif idx is not None and suffix in parts_of:
                parts.setdefault((idx, parts_of[suffix]), {})[suffix] = n
            elif (h := self.gguf_to_hf_name(n)) is not None:
                out.append(Made(h, (n,), partial(_one, self.from_gguf, h, n_head, n_kv)))
            else:
                raise UnsupportedModel(f"{where}: tensor {n} has no place in a {self.model_type} model")
        for (idx, h), got in parts.items():
            need = self.split_names[h]
            if set(got) != set(need):
                raise BadModelFile(f"{where}: blk.{idx} has {', '.join(sorted(got))} without "
                                   f"{', '.join(sorted(set(need) - set(got)))}", "the file is damaged")
            out.append(Made(f"model.layers.{idx}.{h}", tuple(got[g] for g in need),
                            partial(_joined, self.join, h, cfg)))
        return out

    def _experts_from(self, n: str, idx: int, template: str, shape: tuple, cfg: dict, where: str) -> list[Made]:
        count = self.expert_count(cfg)
        if len(shape) != 3 or shape[0] != count:
            raise BadModelFile(f"{where}: tensor {n} holds {shape[0] if len(shape) == 3 else 'no'} experts, the "
                               f"metadata says {count}", "the file is damaged or does not match its metadata")
        return [Made(f"model.layers.{idx}.{template.format(x=x)}", (n,), partial(_expert_slice, x), expert=x)
                for x in range(count)]


@dataclass(frozen=True)
class Made:
    """One tensor of one format made from tensors of the other: `build` takes `sources` (their
    names) in that order; `expert`: it is that expert's slice of its one stacked source."""

    name: str
    sources: tuple[str, ...]
    build: Callable[[list], Any]
    expert: int | None = None


def _block_of(name: str, prefix: str) -> tuple[int | None, str]:
    """(layer, name inside it) of a tensor inside a decoder block, else (None, name)."""
    if name.startswith(prefix):
        idx, _, suffix = name[len(prefix):].partition(".")
        if idx.isdigit():
            return int(idx), suffix
    return None, name


def _one(transform, name: str, n_head: int, n_kv: int, tensors: list):
    return transform(name, tensors[0], n_head, n_kv)


def _split_part(split, suffix: str, cfg: dict, j: int, tensors: list):
    return split(suffix, tensors[0], cfg)[j]


def _joined(join, suffix: str, cfg: dict, tensors: list):
    return join(suffix, tensors, cfg)


def _stack(tensors: list):
    import torch

    return torch.stack(tensors)


def _expert_slice(x: int, tensors: list):
    return tensors[0][x]


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
