"""The metadata a GGUF's readers rely on, checked for type and range when a file is opened.

llama.cpp and dsq read these keys as integers, floats, strings or arrays of one length; a value of
another type, out of range, or whose products overflow the 32-bit sizes llama.cpp computes makes
them fail in ways a user cannot act on. Each check raises `Refused` naming the key.

Architecture keys are checked by suffix (`<arch>.block_count`), for whatever `general.architecture`
says, so one table covers every decoder llama.cpp runs.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from dsq.formats.gguf_file import _STRING, Refused

if TYPE_CHECKING:
    from dsq.formats.gguf_file import GGUFFile

_INTS, _FLOATS, _BOOL = {0, 1, 2, 3, 4, 5, 10, 11}, {6, 12}, 7
I32 = (1 << 31) - 1
MAX_TOKENS = 1 << 24
MAX_HEAD_PRODUCT = 1 << 24  # heads x head size: llama.cpp's uint32 sizes stay far from overflow
MAX_TOKEN_TYPE = 6  # llama_token_type: 0 undefined .. 6 byte

# suffix -> (low, high, may be one value per layer)
_ARCH_INTS = {
    "block_count": (1, 1 << 16, False),
    "context_length": (1, I32, False),
    "embedding_length": (1, 1 << 20, False),
    "feed_forward_length": (0, 1 << 22, True),
    "attention.head_count": (1, 1 << 16, True),
    "attention.head_count_kv": (0, 1 << 16, True),
    "attention.key_length": (1, 1 << 16, False),
    "attention.value_length": (1, 1 << 16, False),
    "rope.dimension_count": (0, 1 << 16, False),
    "attention.sliding_window": (0, I32, False),
    "rope.scaling.original_context_length": (0, I32, False),
    "vocab_size": (1, MAX_TOKENS, False),
    "expert_count": (0, 1 << 16, False),
    "expert_used_count": (0, 1 << 16, False),
}
# suffix -> (low, high): finite floats in a range
_ARCH_FLOATS = {
    "attention.layer_norm_rms_epsilon": (0.0, 1.0),
    "attention.layer_norm_epsilon": (0.0, 1.0),
    "rope.freq_base": (1e-6, 1e30),
    "rope.freq_base_swa": (1e-6, 1e30),
    "rope.scaling.factor": (1e-6, 1e6),
    "final_logit_softcapping": (0.0, 1e30),
    "attn_logit_softcapping": (0.0, 1e30),
}
_STRINGS = ("general.architecture", "general.name", "tokenizer.ggml.model", "tokenizer.ggml.pre",
            "tokenizer.chat_template")
_BOOLS = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix")
_GENERAL_INTS = {"general.file_type": (0, I32), "general.quantization_version": (0, I32)}
REQUIRED_KEYS = ("context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count")
_TOKEN_IDS = ("bos", "eos", "unknown", "padding", "seperator", "eot", "eom", "mask", "cls", "sep", "pad")


def check_metadata(g: GGUFFile) -> None:
    """Every key dsq or llama.cpp reads: present where required, of its type, in its range."""
    f = g._fields
    for key in _STRINGS:
        _string(f, key)
    if "general.architecture" not in f or not f["general.architecture"][1]:
        raise Refused("general.architecture", "is missing")
    for key in _BOOLS:
        _scalar(f, key, {_BOOL}, "a bool")
    for key, (lo, hi) in _GENERAL_INTS.items():
        _int(g, key, lo, hi)
    _not_split(g)
    arch = f["general.architecture"][1]
    _required(g, arch)
    layers = _int(g, f"{arch}.block_count", 1, 1 << 16)
    for suffix, (lo, hi, per_layer) in _ARCH_INTS.items():
        _int(g, f"{arch}.{suffix}", lo, hi, layers if per_layer else None)
    for suffix, (lo, hi) in _ARCH_FLOATS.items():
        _float(f, f"{arch}.{suffix}", lo, hi)
    _sliding_pattern(g, f"{arch}.attention.sliding_window_pattern", layers)
    _head_sizes(g, arch)
    _rope_dims(g, arch)
    _shapes(g, arch, layers)
    _vocab(g)


def _not_split(g: GGUFFile) -> None:
    """One part of a split GGUF: llama.cpp would look for the other parts by file name."""
    count = _int(g, "split.count", 0, 1 << 16)
    if count is not None and count > 1:
        raise Refused("split.count", f"is {count}: dsq reads single files", state="one part of a split GGUF",
                      hint="merge the parts first: llama-gguf-split --merge FIRST-PART OUT.gguf")
    _int(g, "split.no", 0, 1 << 16)
    _int(g, "split.tensors.count", 0, 1 << 32)


def _required(g: GGUFFile, arch: str) -> None:
    """The keys and tensor every decoder's loader reads (llama.cpp's, and dsq's converter)."""
    for suffix in REQUIRED_KEYS:
        if f"{arch}.{suffix}" not in g._fields:
            raise Refused(f"{arch}.{suffix}", "is missing")
    if "token_embd.weight" not in g._tensors:
        raise Refused("tensor 'token_embd.weight'", "is missing")


def _array_of(f: dict, key: str, types: set[int], what: str):
    """(count, numpy values) of an array of one of `types`, or None when the key is absent."""
    v = f.get(key)
    if v is None:
        return None
    if v[0] != "a" or v[1] not in types:
        raise Refused(key, f"must be an array of {what}")
    return v[2]


def _scalar(f: dict, key: str, types: set[int], what: str):
    v = f.get(key)
    if v is None:
        return None
    if v[0] != "v" or len(v) < 3 or v[2] not in types:
        raise Refused(key, f"must be {what}")
    return v[1]


def _string(f: dict, key: str) -> None:
    v = f.get(key)
    if v is not None and (v[0] != "v" or len(v) != 2):
        raise Refused(key, "must be a string")


def _int(g: GGUFFile, key: str, lo: int, hi: int, per_layer: int | None = None):
    """An integer in [lo, hi]; with `per_layer`, also an array of that many such integers."""
    f = g._fields
    v = f.get(key)
    if v is None:
        return None
    if per_layer is not None and v[0] == "a" and v[1] in _INTS:
        if v[2] != per_layer:
            raise Refused(key, f"has {v[2]} values, the model has {per_layer} layers")
        vals = [int(x) for x in g.field(key)]
        bad = next((x for x in vals if not lo <= x <= hi), None)
        if bad is not None:
            raise Refused(key, f"holds {bad}, must be {lo} to {hi}")
        return max(vals) if vals else lo
    x = _scalar(f, key, _INTS, "an integer")
    if not lo <= x <= hi:
        raise Refused(key, f"is {x}, must be {lo} to {hi}")
    return x


def _float(f: dict, key: str, lo: float, hi: float) -> None:
    x = _scalar(f, key, _FLOATS | _INTS, "a number")
    if x is not None and not (math.isfinite(x) and lo <= x <= hi):
        raise Refused(key, f"is {x}, must be a finite number from {lo:g} to {hi:g}")


def _sliding_pattern(g: GGUFFile, key: str, layers: int | None) -> None:
    v = g._fields.get(key)
    if v is None:
        return
    if v[0] == "a":
        if v[1] not in _INTS | {_BOOL}:
            raise Refused(key, "must be an integer or an array of flags")
        if layers is not None and v[2] != layers:
            raise Refused(key, f"has {v[2]} flags, the model has {layers} layers")
        return
    _int(g, key, 1, 1 << 16)


def _head_sizes(g: GGUFFile, arch: str) -> None:
    """Heads x head size, as llama.cpp multiplies them in 32 bits."""

    def value(suffix):
        return g.field(f"{arch}.{suffix}")

    heads, kv = value("attention.head_count"), value("attention.head_count_kv")
    heads = max(heads) if isinstance(heads, list) and heads else heads
    kv = max(kv) if isinstance(kv, list) and kv else kv
    n_embd = value("embedding_length")
    for size_key in ("attention.key_length", "attention.value_length"):
        size = value(size_key)
        for n in (heads, kv):
            if size and n and size * n > MAX_HEAD_PRODUCT:
                raise Refused(f"{arch}.{size_key}", f"is {size}, times {n} heads overflows")
    if n_embd and heads and not value("attention.key_length") and n_embd < heads:
        raise Refused(f"{arch}.embedding_length", f"is {n_embd}, fewer than its {heads} attention heads")


# Architectures whose llama.cpp graph asserts that rope turns the whole head (n_rot == head size)
_FULL_ROPE = {"llama", "qwen2"}


def _rope_dims(g: GGUFFile, arch: str) -> None:
    """rope.dimension_count equal to the head size where llama.cpp requires it (it aborts otherwise)."""
    rot = g.field(f"{arch}.rope.dimension_count")
    if arch not in _FULL_ROPE or rot is None:
        return
    heads = g.field(f"{arch}.attention.head_count")
    heads = max(heads) if isinstance(heads, list) and heads else heads
    head = g.field(f"{arch}.attention.key_length") or (g.field(f"{arch}.embedding_length") // heads if heads else None)
    if head and rot != head:
        raise Refused(f"{arch}.rope.dimension_count", f"is {rot}, but {arch} turns the whole head of {head}")


def _per_layer(g: GGUFFile, key: str, layers: int, default) -> list:
    v = g.field(key, default)
    return [int(x) for x in v] if isinstance(v, list) else [v] * layers


def _expected_shapes(g: GGUFFile, arch: str, layers: int) -> dict:
    """GGUF tensor kind -> per layer: its shape in torch order, as llama.cpp's graphs use it."""
    a = g.arch_field
    n_embd = a("embedding_length")
    heads = _per_layer(g, f"{arch}.attention.head_count", layers, None)
    kv = _per_layer(g, f"{arch}.attention.head_count_kv", layers, None)
    kv = [k if k is not None else h for k, h in zip(kv, heads)]
    ff = _per_layer(g, f"{arch}.feed_forward_length", layers, None)
    out: dict[str, list] = {k: [] for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up", "ffn_gate",
                                            "ffn_down", "attn_norm", "ffn_norm")}
    for h, k, f in zip(heads, kv, ff):
        hd_k = a("attention.key_length") or (n_embd // h if h else 0)
        hd_v = a("attention.value_length") or hd_k
        out["attn_q"].append((h * hd_k, n_embd))
        out["attn_k"].append((k * hd_k, n_embd))
        out["attn_v"].append((k * hd_v, n_embd))
        out["attn_output"].append((n_embd, h * hd_v))
        for kind in ("ffn_up", "ffn_gate"):
            out[kind].append((f, n_embd))
        out["ffn_down"].append((n_embd, f))
        out["attn_norm"].append((n_embd,))
        out["ffn_norm"].append((n_embd,))
    return out


def _shapes(g: GGUFFile, arch: str, layers: int) -> None:
    """The tensors every decoder has, shaped as the metadata says: llama.cpp checks only some of
    them when it loads, and a graph built on the others aborts (GGML_ASSERT in a reshape)."""
    import re

    heads = _per_layer(g, f"{arch}.attention.head_count", layers, None)
    kv = _per_layer(g, f"{arch}.attention.head_count_kv", layers, None)
    for i, (h, k) in enumerate(zip(heads, kv)):
        if h and k and h % k:
            raise Refused(f"{arch}.attention.head_count_kv", f"is {k} in layer {i}, which does not divide the "
                                                             f"{h} attention heads")
    expected = _expected_shapes(g, arch, layers)
    if g.arch_field("attention.kv_lora_rank") is not None:  # multi-head latent attention: other shapes
        expected = {k: v for k, v in expected.items() if not k.startswith("attn_")}
    n_embd = g.arch_field("embedding_length")
    for name, (_, shape, _, _) in g._tensors.items():
        if name in ("token_embd.weight", "output.weight") and shape[-1] != n_embd:
            raise Refused(f"tensor {name!r}", f"has rows of {shape[-1]}, {arch}.embedding_length is {n_embd}")
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
        if m and m[2] in expected and int(m[1]) < layers and shape != expected[m[2]][int(m[1])]:
            raise Refused(f"tensor {name!r}", f"has shape {shape}, the metadata implies {expected[m[2]][int(m[1])]}")


def _vocab(g: GGUFFile) -> None:
    """The tokenizer arrays: one length, ids inside the vocabulary, token types known."""
    f = g._fields
    n = _array_of(f, "tokenizer.ggml.tokens", {_STRING}, "strings")
    _array_of(f, "tokenizer.ggml.merges", {_STRING}, "strings")
    if n is None:
        for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
            if key in f:
                raise Refused(key, "is present without tokenizer.ggml.tokens")
        return
    if not 1 <= n <= MAX_TOKENS:
        raise Refused("tokenizer.ggml.tokens", f"holds {n} tokens, must be 1 to {MAX_TOKENS}")
    for key, types, what in (("tokenizer.ggml.scores", _FLOATS, "numbers"),
                             ("tokenizer.ggml.token_type", _INTS, "integers")):
        count = _array_of(f, key, types, what)
        if count is not None and count != n:
            raise Refused(key, f"has {count} entries for {n} tokens")
    if "tokenizer.ggml.scores" in f:
        scores = np.asarray(g.field("tokenizer.ggml.scores"), dtype=np.float64)
        if scores.size and not np.isfinite(scores).all():
            raise Refused("tokenizer.ggml.scores", "holds a value that is not a finite number")
    if "tokenizer.ggml.token_type" in f:
        types_ = np.asarray(g.field("tokenizer.ggml.token_type"), dtype=np.int64)
        if types_.size and (types_.min() < 0 or types_.max() > MAX_TOKEN_TYPE):
            raise Refused("tokenizer.ggml.token_type", f"holds a type outside 0 to {MAX_TOKEN_TYPE}")
    for kind in _TOKEN_IDS:
        _int(g, f"tokenizer.ggml.{kind}_token_id", 0, n - 1)
    if g.field("tokenizer.ggml.model") == "llama":
        _spm_bytes(g)


def _spm_bytes(g: GGUFFile) -> None:
    """A SentencePiece vocabulary falls back to byte tokens for text it has no piece for; llama.cpp
    aborts (an uncaught std::out_of_range) when a byte has neither <0xXX> nor itself as a token."""
    have = g.short_tokens
    for b in range(256):
        if f"<0x{b:02X}>".encode() not in have and bytes([b]) not in have:
            raise Refused("tokenizer.ggml.tokens", f"has no token for byte 0x{b:02X} (neither <0x{b:02X}> nor the "
                                                   "byte itself), which SentencePiece tokenizing falls back to")
