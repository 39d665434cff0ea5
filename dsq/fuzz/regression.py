"""Findings kept as small regression files: each input as a difference from the seed it was made
from (the seeds are rebuilt the same way every time), so a megabyte GGUF with a damaged header is
kept in a few hundred bytes.

A file (tests/regressions/NAME.json) holds the target, the outcome and detail when found, the
command for CLI findings, and per input file: the seed's name and SHA-256, and the bytes that
differ: the seed's first `prefix` bytes, then `middle` (zlib, with the seed's next 32 KiB as its
dictionary), then the seed's last `suffix` bytes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import zlib
from pathlib import Path

from dsq.fuzz import seeds


def seed_files(root: Path) -> dict[str, bytes]:
    """name -> bytes of every seed file: the GGUFs, and the HF directory's files as model/NAME."""
    out = {p.name: p.read_bytes() for p in seeds.gguf_seeds(root)}
    out.update({f"model/{f.name}": f.read_bytes() for f in sorted(seeds.hf_seed(root).iterdir())})
    for i, t in enumerate(seeds.template_seeds()):
        out[f"template{i}.jinja"] = t.encode()
    return out


def _prefix_len(a: bytes, b: bytes) -> int:
    """Length of the common prefix, compared in blocks first (seeds are megabytes)."""
    n, i = min(len(a), len(b)), 0
    while i + 4096 <= n and a[i:i + 4096] == b[i:i + 4096]:
        i += 4096
    while i < n and a[i] == b[i]:
        i += 1
    return i


def encode_file(data: bytes, seeds_: dict[str, bytes], hint: str | None = None) -> dict:
    """`data` as a difference from the seed it shares most bytes with (`hint` first)."""
    best = None
    for name, seed in seeds_.items():
        p = _prefix_len(data, seed)
        s = _prefix_len(data[p:][::-1], seed[p:][::-1])
        score = p + s + (1 if name == hint else 0)
        if best is None or score > best[0]:
            best = (score, name, p, s)
    _, name, p, s = best
    seed = seeds_[name]
    z = zlib.compressobj(9, zdict=seed[p:p + 32768] or b"\0")
    middle = z.compress(data[p:len(data) - s]) + z.flush()
    return {"seed": name, "seed_sha256": hashlib.sha256(seed).hexdigest(), "prefix": p, "suffix": s,
            "middle": base64.b64encode(middle).decode()}


def decode_file(entry: dict, seeds_: dict[str, bytes]) -> bytes:
    seed = seeds_.get(entry["seed"])
    if seed is None or hashlib.sha256(seed).hexdigest() != entry["seed_sha256"]:
        raise LookupError(f"seed {entry['seed']} is not the one this regression was made from")
    p = entry["prefix"]
    tail = seed[len(seed) - entry["suffix"]:] if entry["suffix"] else b""
    z = zlib.decompressobj(zdict=seed[p:p + 32768] or b"\0")
    return seed[:p] + z.decompress(base64.b64decode(entry["middle"])) + z.flush() + tail


def save(path: Path, note: dict, files: dict[str, bytes], seeds_: dict[str, bytes]) -> Path:
    note = dict(note, files={name: encode_file(data, seeds_, name) for name, data in files.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(note, indent=1) + "\n")
    return path


def load(path: Path, seeds_: dict[str, bytes]) -> tuple[dict, dict[str, bytes]]:
    note = json.loads(Path(path).read_text())
    return note, {name: decode_file(e, seeds_) for name, e in note["files"].items()}
