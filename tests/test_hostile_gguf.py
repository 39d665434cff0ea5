"""Damaged and hostile GGUFs: dsq's reader refuses each with one line naming the field, before
llama.cpp sees the file, and the CLI (run on both backends, quantize) exits 1 with that line:
never a signal, a hang or an internal error."""

from __future__ import annotations

import struct
import time

import pytest

from dsq.errors import BadModelFile
from dsq.formats.gguf_file import GGUFFile
from hostile import (add_key, assert_one_line_error, dsq, key_value, rename_tensor, seed_gguf, set_field, set_key,
                     tensor_index)


def _array_count(d: bytes, key: str, n: int) -> bytes:
    pos, vtype = key_value(d, key)
    assert vtype == 9
    return d[:pos + 4] + struct.pack("<Q", n) + d[pos + 12:]


def _string_len(d: bytes, key: str, n: int) -> bytes:
    pos, vtype = key_value(d, key)
    assert vtype == 8
    return d[:pos] + struct.pack("<Q", n) + d[pos + 8:]


def _no_byte_tokens(d: bytes) -> bytes:
    for b in range(256):
        d = d.replace(f"<0x{b:02X}>".encode(), b"<0xZZ>", 1)
    return d


def _norm(d: bytes) -> int:
    return tensor_index(d, "blk.0.attn_norm.weight")


# name -> (damage, what the one line names). Each is a class of failure dsq once had: a llama.cpp
# abort, a hang, or an internal error (NotImplementedError, ValueError, ZeroDivisionError,
# OverflowError, TypeError, StopIteration, struct.error).
CASES = {
    "integer-weight-type": (lambda d: set_field(d, "ttype", _norm(d), 26), "type I32"),  # ggml abort
    "unknown-tensor-type": (lambda d: set_field(d, "ttype", 2, 1000), "unknown type 1000"),
    "quantization-helper-type": (lambda d: set_field(d, "ttype", 2, 15), "type Q8_K"),
    "huge-key-count": (lambda d: set_field(d, "count", 1, 1 << 62), "key count"),
    "huge-tensor-count": (lambda d: set_field(d, "count", 0, 1 << 62), "tensor count"),
    "array-past-eof": (lambda d: _array_count(d, "tokenizer.ggml.tokens", 1 << 40), "tokenizer.ggml.tokens"),
    "string-past-eof": (lambda d: _string_len(d, "general.name", 1 << 40), "general.name"),
    "alignment-zero": (lambda d: add_key(d, "general.alignment", 4, struct.pack("<I", 0)), "general.alignment"),
    "alignment-float": (lambda d: add_key(d, "general.alignment", 6, struct.pack("<f", 32.0)), "general.alignment"),
    "alignment-array": (lambda d: add_key(d, "general.alignment", 9, struct.pack("<IQI", 4, 1, 32)),
                        "general.alignment"),
    "alignment-not-power-of-two": (lambda d: add_key(d, "general.alignment", 4, struct.pack("<I", 48)),
                                   "general.alignment"),
    "dim-zero": (lambda d: set_field(d, "dim", 0, 0), "dimension 0"),
    "dim-negative": (lambda d: set_field(d, "dim", 1, -1), "overflows"),
    "dims-overflow": (lambda d: set_field(set_field(d, "dim", 0, 1 << 40), "dim", 1, 1 << 40), "overflows"),
    "too-many-dims": (lambda d: set_field(d, "n_dims", 0, 7), "7 dimensions"),
    "offset-past-eof": (lambda d: set_field(d, "offset", -1, 1 << 40), "truncated"),
    "offset-unaligned": (lambda d: set_field(d, "offset", 1, 33), "alignment"),
    "overlapping-tensors": (lambda d: set_field(d, "offset", 2, 0), "overlaps"),
    "duplicate-tensor": (lambda d: rename_tensor(d, tensor_index(d, "blk.0.attn_q.weight"), "blk.0.attn_k.weight"),
                         "appears twice"),
    "duplicate-key": (lambda d: add_key(d, "general.name", 8, struct.pack("<Q", 1) + b"x"), "appears twice"),
    "missing-token-embd": (lambda d: rename_tensor(d, 0, "token_embx.weight"), "token_embd.weight"),
    "head-count-zero": (lambda d: set_key(d, "llama.attention.head_count", 4, struct.pack("<I", 0)),
                        "llama.attention.head_count"),
    "heads-not-dividing": (lambda d: set_key(d, "llama.attention.head_count", 4, struct.pack("<I", 3)),
                           "does not divide"),  # a GGML_ASSERT in llama.cpp's graph for qwen2
    "shape-against-metadata": (lambda d: set_key(d, "llama.feed_forward_length", 4, struct.pack("<I", 256)),
                               "the metadata implies"),
    "split-part": (lambda d: add_key(d, "split.count", 2, struct.pack("<H", 3)), "split GGUF"),
    "spm-without-byte-tokens": (lambda d: _no_byte_tokens(d), "no token for byte"),  # std::out_of_range abort
    "key-of-wrong-type": (lambda d: set_key(d, "llama.embedding_length", 6, struct.pack("<f", 256.0)),
                          "llama.embedding_length"),
    "token-id-outside-vocab": (lambda d: set_key(d, "tokenizer.ggml.bos_token_id", 4, struct.pack("<I", 99999)),
                               "tokenizer.ggml.bos_token_id"),
    "unknown-value-type": (lambda d: set_field(d, "vtype", 0, 99), "unknown value type 99"),
    "bad-version": (lambda d: d[:4] + struct.pack("<I", 7) + d[8:], "version"),
    "truncated-header": (lambda d: d[:30], "truncated"),
}
# Through the CLI on both backends and quantize: one case per class of failure the issue lists.
CLI_CASES = ["integer-weight-type", "unknown-tensor-type", "huge-key-count", "array-past-eof", "alignment-zero",
             "alignment-float", "alignment-array", "dim-negative", "dims-overflow", "offset-past-eof",
             "duplicate-tensor", "missing-token-embd", "head-count-zero", "key-of-wrong-type", "truncated-header",
             "heads-not-dividing", "spm-without-byte-tokens", "shape-against-metadata", "split-part"]
COMMANDS = {"run-llama.cpp": ["run", "{f}", "-p", "hi", "-n", "2", "--ctx", "64"],
            "run-native": ["run", "{f}", "-p", "hi", "-n", "2", "--ctx", "64", "-b", "native"],
            "quantize": ["quantize", "{f}", "--type", "Q8_0", "--out", "out.gguf"]}


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> bytes:
    return seed_gguf(tmp_path_factory.mktemp("seeds"))


def test_the_seed_itself_loads(seed, tmp_path):
    p = tmp_path / "seed.gguf"
    p.write_bytes(seed)
    assert GGUFFile(p).arch == "llama"


@pytest.mark.parametrize("case", sorted(CASES))
def test_reader_refuses_naming_the_field(case, seed, tmp_path):
    damage, needle = CASES[case]
    p = tmp_path / f"{case}.gguf"
    p.write_bytes(damage(seed))
    with pytest.raises(BadModelFile) as e:
        GGUFFile(p)
    line = e.value.one_line()
    assert needle in line and "\n" not in line, line


@pytest.mark.parametrize("case", ["huge-key-count", "huge-tensor-count", "array-past-eof"])
def test_huge_counts_refuse_fast(case, seed, tmp_path):
    p = tmp_path / f"{case}.gguf"
    p.write_bytes(CASES[case][0](seed))
    t0 = time.perf_counter()
    with pytest.raises(BadModelFile):
        GGUFFile(p)
    assert time.perf_counter() - t0 < 0.25


def test_huge_string_array_in_the_builtin_model_refuses_fast(builtin_gguf, tmp_path):
    """A 262k-token vocabulary whose count claims more strings than the file has room for."""
    p = tmp_path / "huge.gguf"
    p.write_bytes(_array_count(builtin_gguf.read_bytes(), "tokenizer.ggml.tokens", (1 << 40) + 3))
    t0 = time.perf_counter()
    with pytest.raises(BadModelFile, match="tokenizer.ggml.tokens"):
        GGUFFile(p)
    assert time.perf_counter() - t0 < 0.5


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_exits_1_with_one_line(case, command, seed, tmp_path):
    damage, needle = CASES[case]
    (tmp_path / "bad.gguf").write_bytes(damage(seed))
    args = [a.replace("{f}", "bad.gguf") for a in COMMANDS[command]]
    assert_one_line_error(dsq(args, tmp_path), "bad.gguf", needle)
    assert not (tmp_path / "out.gguf").exists()
