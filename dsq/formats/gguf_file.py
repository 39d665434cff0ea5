"""Read GGUF files: metadata as plain Python values, tensor directory, validation.

A small header parser of our own (memory-mapped; array values decoded lazily) that turns every way
a file can be broken into one `BadModelFile` error saying what to do. Dequantization uses
`gguf.quants`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from dsq.errors import BadModelFile, ModelNotFound, UnsupportedModel

GGUF_MAGIC = b"GGUF"

# Keys whose values are long arrays: kept out of `metadata`, read on demand through `field()`.
_BULK_KEYS = {
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    type_name: str  # GGML type name, e.g. "Q4_K", "F32"
    shape: tuple[int, ...]  # torch order: (rows, row_length)
    n_bytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
           12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
       7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_FLOAT_NP = {"F32": np.float32, "F16": np.float16, "F64": np.float64}
_UINT32 = 4
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 63  # GGML_MAX_NAME - 1 bytes
MAX_KEY = 65535
MAX_ELEMENTS = 1 << 53  # elements in one tensor (far past any model; keeps byte sizes in int64)
MAX_ALIGNMENT = 1 << 24
# Types llama.cpp computes with (weights it writes and reads); integer, F64 and its intermediate
# types (Q8_1, Q8_K) abort inside ggml when a model uses them as weights.
TENSOR_TYPES = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "IQ1_M",
                "TQ1_0", "TQ2_0", "MXFP4"}
SHORT_TOKEN = 6  # bytes of "<0xXX>": byte tokens are collected while the vocabulary is parsed
_MIN_KV = 8 + 4 + 1  # key length, value type, smallest value
_MIN_TENSOR_INFO = 8 + 1 + 4 + 8 + 4 + 8  # name length, 1-byte name, n_dims, one dim, type, offset


class Refused(Exception):
    """One problem in a file's structure: `field` names where, `problem` says what."""

    def __init__(self, field: str, problem: str, truncated: bool = False, hint: str | None = None,
                 state: str | None = None):
        super().__init__(f"{field}: {problem}")
        self.field, self.problem, self.hint = field, problem, hint
        self.state = state or ("truncated" if truncated else "damaged")


class _Cursor:
    """Reads little-endian values, each checked against the bytes left before it is read."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path, self.end = buf, 0, path, len(buf)

    def left(self) -> int:
        return self.end - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.end - self.pos:
            raise Refused(what, "runs past the end of the file", truncated=True)

    def unpack(self, fmt: str, what: str = "header"):
        size = struct.calcsize(fmt)
        self.need(size, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v[0]

    def raw_string(self, what: str) -> bytes:
        n = self.unpack("<Q", what)
        self.need(n, what)
        s = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return s

    def string(self, what: str = "string") -> str:
        return self.raw_string(what).decode("utf-8", errors="replace")

    def name(self, what: str, limit: int) -> str:
        """A key or tensor name: non-empty UTF-8 of at most `limit` bytes."""
        raw = self.raw_string(what)
        if not raw or len(raw) > limit:
            raise Refused(what, f"has length {len(raw)}, must be 1 to {limit} bytes")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise Refused(what, "is not valid UTF-8") from None

    def skip_strings(self, count: int, what: str, short: set | None = None) -> None:
        """Step over `count` strings; those of at most SHORT_TOKEN bytes go into `short`."""
        buf, pos, end = self.buf, self.pos, self.end
        for _ in range(count):
            if pos + 8 > end:
                raise Refused(what, "runs past the end of the file", truncated=True)
            (n,) = struct.unpack_from("<Q", buf, pos)
            if short is not None and n <= SHORT_TOKEN:
                short.add(bytes(buf[pos + 8:pos + 8 + n]))
            pos += 8 + n
        if pos > end:
            raise Refused(what, "runs past the end of the file", truncated=True)
        self.pos = pos


def _kv(c: _Cursor, fields: dict, short: set) -> None:
    """One key/value pair, its lengths and counts checked against the bytes left."""
    key = c.name(f"key #{len(fields)}", MAX_KEY)
    if key in fields:
        raise Refused(f"key {key!r}", "appears twice")
    vtype = c.unpack("<I", f"key {key!r}")
    where = f"key {key!r}"
    if vtype == _ARRAY:
        etype, count = c.unpack("<I", where), c.unpack("<Q", where)
        fields[key] = ("a", etype, count, c.pos)
        if etype == _STRING:
            if count > c.left() // 8:
                raise Refused(where, f"holds {count} strings, more than the file has room for", truncated=True)
            c.skip_strings(count, where, short if key == "tokenizer.ggml.tokens" else None)
        elif etype in _SCALAR:
            size = struct.calcsize(_SCALAR[etype])
            if count > c.left() // size:
                raise Refused(where, f"holds {count} values, more than the file has room for", truncated=True)
            c.pos += count * size
        else:
            raise Refused(where, f"is an array of unknown type {etype}")
    elif vtype == _STRING:
        fields[key] = ("v", c.string(where))
    elif vtype in _SCALAR:
        fields[key] = ("v", c.unpack(_SCALAR[vtype], where), vtype)
    else:
        raise Refused(where, f"has unknown value type {vtype}")


def _alignment(fields: dict) -> int:
    f = fields.get("general.alignment")
    if f is None:
        return 32
    if f[0] != "v" or len(f) < 3 or f[2] != _UINT32:
        raise Refused("general.alignment", "must be a uint32")
    align = f[1]
    if align <= 0 or align & (align - 1) or align > MAX_ALIGNMENT:
        raise Refused("general.alignment", f"is {align}, must be a power of two up to {MAX_ALIGNMENT}")
    return align


def _tensor_info(c: _Cursor, i: int, align: int):
    """(name, type, torch-order shape, offset, n_bytes) of one tensor, every field checked."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    name = c.name(f"tensor #{i} name", MAX_NAME)
    where = f"tensor {name!r}"
    nd = c.unpack("<I", where)
    if not 1 <= nd <= MAX_DIMS:
        raise Refused(where, f"has {nd} dimensions, must be 1 to {MAX_DIMS}")
    dims = [c.unpack("<Q", where) for _ in range(nd)]
    n_el = 1
    for d in dims:
        if d < 1:
            raise Refused(where, f"has dimension {d}, must be positive")
        n_el *= d
        if n_el > MAX_ELEMENTS:
            raise Refused(where, f"has dimensions {dims}, whose product overflows")
    tcode = c.unpack("<I", where)
    try:
        ttype = GGMLQuantizationType(tcode)
        block, tsize = GGML_QUANT_SIZES[ttype]
    except (ValueError, KeyError):
        raise Refused(where, f"has unknown type {tcode}") from None
    if ttype.name not in TENSOR_TYPES:
        raise Refused(where, f"has type {ttype.name}, which llama.cpp does not compute with")
    if nd == 1 and ttype.name != "F32":
        raise Refused(where, f"is a vector of type {ttype.name}; vectors (norms, biases) must be F32")
    if dims[0] % block:
        raise Refused(where, f"has rows of {dims[0]} values, not a multiple of its {ttype.name} block of {block}")
    off = c.unpack("<Q", where)
    if off % align:
        raise Refused(where, f"has offset {off}, not a multiple of the alignment {align}")
    return name, ttype, tuple(reversed(dims)), off, n_el // block * tsize


def _check_layout(infos: list, data_start: int, size: int) -> None:
    """Every tensor's bytes inside the file, none overlapping another."""
    if data_start > size:
        raise Refused("data section", f"starts at byte {data_start}, past the end of the file ({size})", True)
    end_of = {}
    for name, _, _, off, nbytes in infos:
        end = data_start + off + nbytes
        if end > size:
            raise Refused(f"tensor {name!r}", f"ends at byte {end}, file has {size}", truncated=True)
        end_of[name] = (off, off + nbytes)
    prev = None
    for name, (start, end) in sorted(end_of.items(), key=lambda kv: kv[1]):
        if prev is not None and start < prev[1]:
            raise Refused(f"tensor {name!r}", f"overlaps tensor {prev[0]!r}")
        prev = (name, end)


class GGUFFile:
    """A GGUF file opened for reading (own parser: opening the 262k-token built-in model takes
    ~0.1 s where gguf.GGUFReader takes ~10 s). Long arrays are decoded only when asked for.

    Opening validates the whole structure before anything reads it: every count and length
    against the bytes left, keys and tensor names (unique, UTF-8, bounded), the alignment, each
    tensor's type, dimensions, size and offset (inside the data section, no overlaps), and the
    types and ranges of the metadata that loaders read (dsq.formats.gguf_check). A file that fails
    is refused with one `BadModelFile` line naming the field; llama.cpp only ever opens files
    that passed."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.exists():
            raise ModelNotFound(f"{self.path} does not exist", "check the path")
        if self.path.is_dir():
            raise BadModelFile(f"{self.path} is a directory, not a GGUF file", "pass a .gguf file")
        if not is_gguf(self.path):
            raise BadModelFile(
                f"{self.path} is not a GGUF file (no GGUF magic)",
                "pass a .gguf file or an HF model directory",
            )
        try:
            self.mm = np.memmap(self.path, dtype=np.uint8, mode="c")  # copy-on-write: torch views need writable
        except (OSError, ValueError) as e:
            raise BadModelFile(f"{self.path} could not be mapped ({e})", "check the file") from None
        try:
            self._parse()
            from dsq.formats.gguf_check import check_metadata

            check_metadata(self)
        except Refused as e:
            raise self.refusal(e) from None

    def refusal(self, e: Refused) -> BadModelFile:
        return BadModelFile(f"{self.path} is {e.state}: {e.field} {e.problem}", e.hint or "download or convert it again")

    def _parse(self) -> None:
        c = _Cursor(memoryview(self.mm), self.path)
        c.pos = 4
        self.version = c.unpack("<I", "version")
        if self.version not in (2, 3):
            raise Refused("version", f"is {self.version}, dsq reads GGUF versions 2 and 3")
        n_tensors, n_kv = c.unpack("<Q", "tensor count"), c.unpack("<Q", "key count")
        if n_kv > c.left() // _MIN_KV:
            raise Refused("key count", f"is {n_kv}, more than the file has room for", truncated=True)
        if n_tensors > c.left() // _MIN_TENSOR_INFO:
            raise Refused("tensor count", f"is {n_tensors}, more than the file has room for", truncated=True)
        self._fields: dict[str, tuple] = {}  # key -> ("v", value[, type]) | ("a", type, count, pos)
        self.short_tokens: set[bytes] = set()  # the vocabulary's tokens of up to SHORT_TOKEN bytes
        for _ in range(n_kv):
            _kv(c, self._fields, self.short_tokens)
        align = _alignment(self._fields)
        infos, seen = [], set()
        for i in range(n_tensors):
            info = _tensor_info(c, i, align)
            if info[0] in seen:
                raise Refused(f"tensor {info[0]!r}", "appears twice")
            seen.add(info[0])
            infos.append(info)
        data_start = (c.pos + align - 1) // align * align
        _check_layout(infos, data_start, len(self.mm))
        self.alignment, self.data_start = align, data_start
        self._tensors = {n: (t, shape, data_start + off, nb) for n, t, shape, off, nb in infos}

    # -- metadata -------------------------------------------------------------------------
    def field(self, key: str, default: Any = None) -> Any:
        f = self._fields.get(key)
        if f is None:
            return default
        if f[0] == "v":
            return f[1]
        _, etype, count, pos = f
        if etype == _STRING:
            c = _Cursor(memoryview(self.mm), self.path)
            c.pos = pos
            return [c.string() for _ in range(count)]
        arr = np.frombuffer(self.mm, dtype=_NP[etype], count=count, offset=pos)
        return arr.tolist()

    def keys(self) -> list[str]:
        return list(self._fields)

    @cached_property
    def metadata(self) -> dict[str, Any]:
        """Scalar keys and short arrays (the long tokenizer arrays are left out)."""
        return {k: self.field(k) for k, f in self._fields.items()
                if k not in _BULK_KEYS and (f[0] == "v" or f[2] <= 64)}

    @property
    def arch(self) -> str:
        arch = self.field("general.architecture")
        if not arch:
            raise BadModelFile(f"{self.path} has no general.architecture key", "convert it again")
        return str(arch)

    def arch_field(self, suffix: str, default: Any = None) -> Any:
        return self.field(f"{self.arch}.{suffix}", default)

    @property
    def name(self) -> str:
        return str(self.field("general.name") or self.path.stem)

    @property
    def n_layers(self) -> int:
        return int(self.arch_field("block_count", 0))

    # -- tensors --------------------------------------------------------------------------
    @cached_property
    def tensors(self) -> list[TensorEntry]:
        return [TensorEntry(n, t.name, shape, nb) for n, (t, shape, _, nb) in self._tensors.items()]

    def raw(self, name: str):
        """(bytes of one tensor as a uint8 numpy view, GGMLQuantizationType, torch-order shape)."""
        t, shape, start, nbytes = self._tensors[name]
        return self.mm[start:start + nbytes], t, shape

    def dequantize(self, name: str) -> np.ndarray:
        """One tensor as float32 in torch order (rows, row_length)."""
        from gguf.quants import dequantize

        data, t, shape = self.raw(name)
        if t.name in _FLOAT_NP:
            return np.frombuffer(data, dtype=_FLOAT_NP[t.name]).astype(np.float32, copy=False).reshape(shape)
        rows = data.reshape(-1, data.size // max(1, int(np.prod(shape[:-1]))))
        try:
            return dequantize(rows, t).astype(np.float32, copy=False).reshape(shape)
        except NotImplementedError:
            raise UnsupportedModel(f"{self.path}: tensor {name} has type {t.name}, which dsq cannot dequantize",
                                   "use a GGUF with float or llama.cpp quantized weights") from None

    @property
    def file_type(self) -> int | None:
        ft = self.field("general.file_type")
        return None if ft is None else int(ft)

    def describe_quant(self) -> str:
        """The file's weight type, e.g. 'Q4_K_M' or 'F16'."""
        from dsq.formats.gguf_types import FTYPE_NAMES

        ft = self.file_type
        if ft is not None and ft in FTYPE_NAMES:
            return FTYPE_NAMES[ft]
        counts: dict[str, int] = {}
        for t in self.tensors:
            if len(t.shape) >= 2:
                counts[t.type_name] = counts.get(t.type_name, 0) + t.n_bytes
        return max(counts, key=counts.get) if counts else "unknown"
