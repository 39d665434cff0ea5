"""safetensors headers, parsed and checked by dsq before any tensor is read.

The header is 8 bytes of length, then that much JSON: per tensor a dtype, a shape and its byte
range in the data that follows. `read_header` checks it all against the file: the length
(bounded, inside the file), the JSON (an object, no repeated names), each dtype known, each shape
a list of non-negative integers, each byte range inside the data, as long as dtype and shape say,
aligned for its dtype, and no two ranges overlapping. A file that fails is refused with one
`BadModelFile` line naming the tensor and field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from dsq.errors import BadModelFile

MAX_HEADER = 100 << 20  # the safetensors library's own bound on the JSON header
MAX_RANK = 8
# safetensors dtype -> (torch dtype name, bytes per element)
DTYPES = {"F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
          "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
          "U64": ("uint64", 8), "U32": ("uint32", 4), "U16": ("uint16", 2), "U8": ("uint8", 1),
          "BOOL": ("bool", 1), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1)}


@dataclass(frozen=True)
class STEntry:
    name: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int

    @property
    def torch_dtype(self) -> str:
        return DTYPES[self.dtype][0]


class _Refused(Exception):
    pass


def _no_repeats(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise _Refused(f"names {k!r} twice")
        out[k] = v
    return out


def _load_json(path: Path, size: int) -> tuple[dict, int]:
    """(header object, offset where the data starts)."""
    if size < 8:
        raise _Refused(f"has {size} bytes, too few for a header")
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if n > MAX_HEADER or n > size - 8:
            raise _Refused(f"declares a {n}-byte header, the file has {size - 8} bytes after the length")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_repeats)
    except (ValueError, RecursionError) as e:
        raise _Refused(f"has a header that is not valid JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise _Refused("has a header that is not a JSON object")
    return header, 8 + n


def _entry(name: str, info, base: int, data_len: int) -> STEntry:
    where = f"tensor {name!r}"
    if not isinstance(info, dict):
        raise _Refused(f"{where} is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _Refused(f"{where} has dtype {dtype!r}, not one of {', '.join(DTYPES)}")
    if (not isinstance(shape, list) or len(shape) > MAX_RANK
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise _Refused(f"{where} has shape {shape!r}, must be up to {MAX_RANK} non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise _Refused(f"{where} has data_offsets {offsets!r}, must be [start, end]")
    start, end = offsets
    if not 0 <= start <= end <= data_len:
        raise _Refused(f"{where} has data_offsets [{start}, {end}] outside the {data_len} bytes of data")
    itemsize = DTYPES[dtype][1]
    if end - start != math.prod(shape) * itemsize:
        raise _Refused(f"{where} has {end - start} bytes, its dtype {dtype} and shape {shape} need "
                       f"{math.prod(shape) * itemsize}")
    if (base + start) % itemsize:
        raise _Refused(f"{where} starts at byte {base + start}, not aligned for {dtype}")
    return STEntry(name, dtype, tuple(shape), base + start, base + end)


def _check_metadata(meta) -> None:
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise _Refused("has __metadata__ that is not an object of strings")


def _check_overlaps(entries: list[STEntry]) -> None:
    prev = None
    for e in sorted(entries, key=lambda e: (e.start, e.end)):
        if prev is not None and e.start < prev.end:
            raise _Refused(f"tensor {e.name!r} overlaps tensor {prev.name!r}")
        if e.end > e.start:
            prev = e


def read_header(path: str | Path) -> dict[str, STEntry]:
    """The tensors of a safetensors file, name -> STEntry, every field checked against the file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        header, base = _load_json(path, size)
        entries = {}
        for name, info in header.items():
            if name == "__metadata__":
                _check_metadata(info)
            else:
                entries[name] = _entry(name, info, base, size - base)
        _check_overlaps(list(entries.values()))
    except _Refused as e:
        raise BadModelFile(f"{path} is not a valid safetensors file: it {e}", "re-download it") from None
    except OSError as e:
        raise BadModelFile(f"{path} could not be read ({e.strerror or e})", "check the file") from None
    return entries
