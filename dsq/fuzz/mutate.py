"""Seeded mutators: damage a valid input the ways broken downloads and hostile files do.

Every mutator takes a `random.Random` and returns new bytes or text; the same seed gives the same
inputs, so a run is reproducible from its command line.
"""

from __future__ import annotations

import json
import random
import struct
from dataclasses import dataclass

EXTREMES = [0, 1, 2, 3, 7, 31, 32, 33, 63, 64, 255, 256, 4095, 65535, 65536, (1 << 31) - 1, 1 << 31, (1 << 32) - 1,
            1 << 32, (1 << 48) + 1, (1 << 62), (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
JSON_EXTREMES = [-1, 0, 1, -(1 << 31), (1 << 31) - 1, 1 << 32, 1 << 63, 1 << 64, 10 ** 30, 1.5, -0.5, 1e308, -1e308,
                 float("inf"), float("nan"), "", "x", "7", None, True, False, [], [1, 2], {}, {"a": 1}]


# -- bytes ------------------------------------------------------------------------------------------
def flip_bits(rng: random.Random, data: bytearray, lo: int, hi: int) -> None:
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(lo, hi)
        data[i] ^= 1 << rng.randrange(8)


def overwrite_int(rng: random.Random, data: bytearray, pos: int, size: int) -> None:
    v = rng.choice(EXTREMES) + rng.choice((0, 0, 0, -1, 1))
    v &= (1 << (8 * size)) - 1
    data[pos:pos + size] = v.to_bytes(size, "little")


def byte_mutation(rng: random.Random, data: bytes, hot_end: int | None = None) -> bytes:
    """One generic mutation; positions fall mostly before `hot_end` (a file's header)."""
    buf = bytearray(data)
    if not buf:
        return bytes([rng.randrange(256)])
    hi = min(len(buf), hot_end) if hot_end and rng.random() < 0.9 else len(buf)
    op = rng.randrange(7)
    if op == 0:
        flip_bits(rng, buf, 0, hi)
    elif op == 1:
        size = rng.choice((1, 2, 4, 8))
        pos = rng.randrange(0, max(1, hi - size))
        overwrite_int(rng, buf, pos, min(size, len(buf) - pos))
    elif op == 2:  # truncate
        return bytes(buf[:rng.randrange(0, len(buf))])
    elif op == 3:  # delete a span
        i = rng.randrange(hi)
        del buf[i:i + rng.randint(1, 64)]
    elif op == 4:  # duplicate a span in place
        i = rng.randrange(hi)
        span = buf[i:i + rng.randint(1, 64)]
        buf[i:i] = span
    elif op == 5:  # insert random bytes
        i = rng.randrange(hi)
        buf[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    else:  # set a run of bytes to one extreme byte
        i = rng.randrange(hi)
        n = rng.randint(1, 16)
        buf[i:i + n] = bytes([rng.choice((0, 0xFF, 0x7F, 0x80))]) * len(buf[i:i + n])
    return bytes(buf)


# -- GGUF -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Field:
    kind: str  # "count", "key_len", "vtype", "value", "arr_type", "arr_count", "name_len", "n_dims", "dim",
    #            "ttype", "offset"
    pos: int
    size: int


@dataclass
class GGUFLayout:
    """Where a valid GGUF's fields sit, so mutations can aim at them."""

    fields: list[Field]
    names: list[tuple[int, bytes]]  # (position of a tensor's name bytes, the name)
    keys: list[tuple[int, bytes]]
    header_end: int


SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes


def _name(data: bytes, pos: int, kind: str, fields: list, names: list) -> int:
    """A length-prefixed key or tensor name: its length field, and (position, bytes) of the name."""
    (n,) = struct.unpack_from("<Q", data, pos)
    fields.append(Field(kind, pos, 8))
    names.append((pos + 8, data[pos + 8:pos + 8 + n]))
    return pos + 8 + n


def _scan_array(data: bytes, pos: int, fields: list) -> int:
    et, count = struct.unpack_from("<IQ", data, pos)
    fields += [Field("arr_type", pos, 4), Field("arr_count", pos + 4, 8)]
    pos += 12
    if et != 8:
        if count:
            fields.append(Field("value", pos, SCALAR_SIZES[et]))
        return pos + count * SCALAR_SIZES[et]
    for i in range(count):  # strings: the first few lengths and the last one are targets
        (n,) = struct.unpack_from("<Q", data, pos)
        if i < 4 or i == count - 1:
            fields.append(Field("value", pos, 8))
        pos += 8 + n
    return pos


def _scan_kv(data: bytes, pos: int, fields: list, keys: list) -> int:
    pos = _name(data, pos, "key_len", fields, keys)
    (vt,) = struct.unpack_from("<I", data, pos)
    fields.append(Field("vtype", pos, 4))
    pos += 4
    if vt == 8:
        (n,) = struct.unpack_from("<Q", data, pos)
        fields.append(Field("value", pos, 8))
        return pos + 8 + n
    if vt == 9:
        return _scan_array(data, pos, fields)
    fields.append(Field("value", pos, SCALAR_SIZES[vt]))
    return pos + SCALAR_SIZES[vt]


def gguf_layout(data: bytes) -> GGUFLayout:
    fields = [Field("count", 8, 8), Field("count", 16, 8)]
    keys: list = []
    names: list = []
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24
    for _ in range(n_kv):
        pos = _scan_kv(data, pos, fields, keys)
    for _ in range(n_tensors):
        pos = _name(data, pos, "name_len", fields, names)
        (nd,) = struct.unpack_from("<I", data, pos)
        fields.append(Field("n_dims", pos, 4))
        pos += 4
        fields += [Field("dim", pos + 8 * i, 8) for i in range(nd)]
        pos += 8 * nd
        fields += [Field("ttype", pos, 4), Field("offset", pos + 4, 8)]
        pos += 12
    return GGUFLayout(fields, names, keys, pos)


_TYPE_CODES = list(range(0, 14)) + [24, 25, 26, 27, 28, 30, 33, 39, 40, 41, 42, 1000, (1 << 32) - 1]


def _same_length_pair(rng: random.Random, items: list[tuple[int, bytes]]):
    by_len: dict[int, list] = {}
    for pos, name in items:
        by_len.setdefault(len(name), []).append((pos, name))
    groups = [g for g in by_len.values() if len(g) > 1]
    return rng.sample(rng.choice(groups), 2) if groups else None


def gguf_mutation(rng: random.Random, data: bytes, layout: GGUFLayout) -> bytes:
    """A structure-aware mutation of a GGUF (or, one time in four, a generic byte mutation)."""
    r = rng.random()
    if r < 0.25:
        return byte_mutation(rng, data, layout.header_end)
    buf = bytearray(data)
    if r < 0.35:  # a repeated tensor name or key: copy one name over another of the same length
        pair = _same_length_pair(rng, layout.names if rng.random() < 0.6 else layout.keys)
        if pair:
            (dst, _), (_, name) = pair
            buf[dst:dst + len(name)] = name
            return bytes(buf)
    f = rng.choice(layout.fields)
    if f.kind in ("vtype", "arr_type", "ttype") and rng.random() < 0.7:
        buf[f.pos:f.pos + 4] = rng.choice(_TYPE_CODES).to_bytes(4, "little")
    elif f.kind == "n_dims" and rng.random() < 0.7:
        buf[f.pos:f.pos + 4] = rng.choice((0, 1, 2, 3, 4, 5, 8, 1 << 31)).to_bytes(4, "little")
    elif f.kind == "value" and f.size in (4, 8) and rng.random() < 0.3:  # a float's extremes
        v = rng.choice((float("nan"), float("inf"), -1.0, 0.0, 1e38, -1e-45))
        buf[f.pos:f.pos + f.size] = struct.pack("<f" if f.size == 4 else "<d", v)
    else:
        overwrite_int(rng, buf, f.pos, f.size)
    return bytes(buf)


# -- JSON documents (config.json, safetensors headers) ---------------------------------------------
# tokenizer.ggml.model values llama.cpp knows (and some it does not): each takes its vocabulary
# load down another path, where a vocabulary made for a different one may break it
TOKENIZER_MODELS = ("llama", "gpt2", "bert", "t5", "rwkv", "plamo2", "none", "no_vocab", "ugm", "")


def set_string(data: bytes, key: str, value: str) -> bytes:
    """A GGUF with string key `key` set to `value` of any length (the padding before the tensor
    data redone, so the data keeps its 32-byte alignment)."""
    layout = gguf_layout(data)
    pos = next(p + len(k) for p, k in layout.keys if k == key.encode())
    if struct.unpack_from("<I", data, pos)[0] != 8:
        raise ValueError(f"{key} is not a string")
    n = struct.unpack_from("<Q", data, pos + 4)[0]
    end = layout.header_end
    head = data[:pos + 4] + struct.pack("<Q", len(value.encode())) + value.encode() + data[pos + 12 + n:end]
    return head + b"\0" * (-len(head) % 32) + data[-(-end // 32) * 32:]


def tokenizer_mutation(rng: random.Random, data: bytes) -> bytes:
    """The vocabulary declared as another tokenizer model (its tokens, scores and types kept)."""
    return set_string(data, "tokenizer.ggml.model", rng.choice(TOKENIZER_MODELS))


def _paths(obj, prefix=()) -> list[tuple]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:8]):
            out += _paths(v, prefix + (i,))
    return out


def _set(obj, path: tuple, value):
    for p in path[:-1]:
        obj = obj[p]
    obj[path[-1]] = value


def json_mutation(rng: random.Random, obj) -> object:
    """A copy of `obj` with one value replaced by an extreme, a key deleted, or a value copied."""
    obj = json.loads(json.dumps(obj))
    paths = [p for p in _paths(obj) if p]
    if not paths:
        return rng.choice(JSON_EXTREMES)
    path = rng.choice(paths)
    op = rng.random()
    if op < 0.6:
        _set(obj, path, rng.choice(JSON_EXTREMES))
    elif op < 0.75:
        parent = obj
        for p in path[:-1]:
            parent = parent[p]
        if isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent.pop(path[-1])
    elif op < 0.9:  # another value from the same document
        other = obj
        for p in rng.choice(paths):
            other = other[p]
        _set(obj, path, json.loads(json.dumps(other)))
    else:
        v = rng.choice((0, 1, 7, 1 << 20))
        _set(obj, path, v if rng.random() < 0.5 else -v)
    return obj


def json_text_mutation(rng: random.Random, text: str) -> str:
    """Damage JSON text itself: a byte mutation, or a key duplicated."""
    if rng.random() < 0.3 and '":' in text:
        quotes, k = [], text.find('"')  # the first 200 quotes
        while k >= 0 and len(quotes) < 200:
            quotes.append(k)
            k = text.find('"', k + 1)
        i = rng.choice(quotes)
        j = text.find(",", i)
        if j > i:
            return text[:j + 1] + text[i:j] + "," + text[j + 1:]
    return byte_mutation(rng, text.encode()).decode("utf-8", "replace")


def safetensors_mutation(rng: random.Random, data: bytes) -> bytes:
    """Mutate a safetensors file's header: its JSON (structure-aware or as text) or its length."""
    n = int.from_bytes(data[:8], "little")
    header, body = data[8:8 + n], data[8 + n:]
    r = rng.random()
    if r < 0.1:
        buf = bytearray(data)
        overwrite_int(rng, buf, 0, 8)
        return bytes(buf)
    if r < 0.25:
        return byte_mutation(rng, data, 8 + n)
    try:
        obj = json.loads(header)
    except ValueError:
        obj = None
    if obj is not None and r < 0.85:
        new = json.dumps(json_mutation(rng, obj)).encode()
    else:
        new = json_text_mutation(rng, header.decode("utf-8", "replace")).encode()
    new += b" " * (-len(new) % 8)
    return len(new).to_bytes(8, "little") + new + body


# -- templates --------------------------------------------------------------------------------------
SNIPPETS = [
    "{% for a in range(99999) %}{% for b in range(99999) %}", "{% endfor %}{% endfor %}",
    "{% for x in messages %}", "{% endfor %}", "{% if true %}", "{% endif %}", "{{", "}}", "{%", "%}",
    "{{ 'a' * 1000000000 }}", "{{ 10 ** 100000 }}", "{{ 'x'|center(999999999) }}", "{{ ''.__class__.__mro__ }}",
    "{{ messages[99]['content'] }}", "{{ raise_exception('no') }}", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{{ 1 // 0 }}", "{{ '%999999999d' % 1 }}", "{{ '{:>999999999}'.format(1) }}", "{% include 'x' %}",
    "{% extends 'base' %}", "{{ cycler }}", "{{ self }}", "{{ lipsum(99999) }}", "{{ range(1, 99999999, 0) }}",
    "{{ messages|tojson(indent=99999999) }}", "(((((((((((((((((((((", "'", "\"", "\x00", "{# ", " #}",
    "{% raw %}", "{% endraw %}", "{{ messages|map(attribute='content')|join('\\n' * 99999) }}",
    "{% filter upper %}", "{% endfilter %}", "{{ x.y.z }}", "{% set x = x %}", "{% break %}", "{% continue %}",
]


def template_mutation(rng: random.Random, text: str) -> str:
    op = rng.random()
    if op < 0.5:
        i = rng.randrange(len(text) + 1)
        return text[:i] + rng.choice(SNIPPETS) + text[i:]
    if op < 0.65 and text:
        i = rng.randrange(len(text))
        return text[:i] + text[i + rng.randint(1, 40):]
    if op < 0.75 and text:
        i = rng.randrange(len(text))
        return text[:i] + text[i:i + rng.randint(1, 80)] * rng.randint(2, 6) + text[i:]
    if op < 0.85:
        return rng.choice(SNIPPETS[:2]) + text + rng.choice(SNIPPETS[1:2] + ["", "{% endfor %}"])
    return byte_mutation(rng, text.encode()).decode("utf-8", "replace")
