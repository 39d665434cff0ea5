"""Hostile files for the tests: a small valid GGUF / HF directory made by dsq, then damaged in one
named way each (one class of the crashes, hangs and internal errors dsq once had), and the CLI run
on them as a user would: `python -m dsq ...` in a child process."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

from dsq.fuzz import mutate
from dsq.fuzz.cli_target import with_template

ROOT = Path(__file__).resolve().parents[1]


def seed_gguf(root: Path) -> bytes:
    from dsq.fuzz.seeds import gguf_seeds

    return gguf_seeds(root)[0].read_bytes()


def _fields(data: bytes, kind: str) -> list:
    return [f for f in mutate.gguf_layout(data).fields if f.kind == kind]


def set_field(data: bytes, kind: str, index: int, value: int) -> bytes:
    """The `index`-th field of `kind` (see mutate.Field) set to `value` (little-endian, its size)."""
    f = _fields(data, kind)[index]
    buf = bytearray(data)
    buf[f.pos:f.pos + f.size] = (value & ((1 << (8 * f.size)) - 1)).to_bytes(f.size, "little")
    return bytes(buf)


def tensor_index(data: bytes, name: str) -> int:
    return [n for _, n in mutate.gguf_layout(data).names].index(name.encode())


def key_value(data: bytes, key: str) -> tuple[int, int]:
    """(position, type) of a key's value."""
    for pos, k in mutate.gguf_layout(data).keys:
        if k == key.encode():
            vt_pos = pos + len(k)
            return vt_pos + 4, struct.unpack_from("<I", data, vt_pos)[0]
    raise KeyError(key)


def set_key(data: bytes, key: str, vtype: int, payload: bytes) -> bytes:
    """Replace a scalar key's type and value by `vtype` and `payload` of the same byte size."""
    pos, old = key_value(data, key)
    size = mutate.SCALAR_SIZES[old]
    assert len(payload) == size, (len(payload), size)
    buf = bytearray(data)
    buf[pos - 4:pos] = struct.pack("<I", vtype)
    buf[pos:pos + size] = payload
    return bytes(buf)


def add_key(data: bytes, key: str, vtype: int, payload: bytes) -> bytes:
    """One more key/value pair after the others, and a filler string key that keeps the tensor
    data where it was (32-byte aligned)."""
    layout = mutate.gguf_layout(data)
    end = next(f.pos for f in layout.fields if f.kind == "name_len")
    kv = struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", vtype) + payload
    fill_key = b"test.filler"
    fixed = 8 + len(fill_key) + 4 + 8
    fill = b" " * (-(len(kv) + fixed) % 32)
    kv += struct.pack("<Q", len(fill_key)) + fill_key + struct.pack("<IQ", 8, len(fill)) + fill
    n_kv = struct.unpack_from("<Q", data, 16)[0] + 2
    return data[:16] + struct.pack("<Q", n_kv) + data[24:end] + kv + data[end:]


def set_string(data: bytes, key: str, value: str) -> bytes:
    return mutate.set_string(data, key, value)


def rename_tensor(data: bytes, index: int, name: str) -> bytes:
    pos, old = mutate.gguf_layout(data).names[index]
    assert len(old) == len(name)
    return data[:pos] + name.encode() + data[pos + len(old):]


def template_gguf(data: bytes, template: str) -> bytes:
    return with_template(data, template)


def hf_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(d: Path, **changes) -> Path:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def safetensors_with_header(path: Path, edit) -> None:
    """Rewrite a safetensors file's JSON header through `edit(header) -> header` (same data)."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = edit(json.loads(data[8:8 + n]))
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(len(new).to_bytes(8, "little") + new + data[8 + n:])


def dsq(args: list[str], cwd: Path, stdin: str = "", timeout: float = 120) -> subprocess.CompletedProcess:
    """python -m dsq ARGS in a child process, as a user runs it."""
    env = dict(os.environ, DSQ_QUIET="1", DSQ_CACHE=str(cwd / ".dsq-cache"), GGML_NO_BACKTRACE="1")
    env.pop("DSQ_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "dsq", *args], cwd=cwd, env=env, input=stdin, text=True,
                          capture_output=True, timeout=timeout)


def assert_one_line_error(p: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 1 (not a signal), exactly one stderr line, dsq's own error, no internal error."""
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    assert len(lines) == 1, p.stderr[-2000:]
    assert lines[0].startswith("error: ") and "internal error" not in lines[0], lines[0]
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]
