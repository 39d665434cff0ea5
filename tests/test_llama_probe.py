"""Files dsq's own checks pass but llama.cpp aborts on (GGML_ASSERT, no message): each is first
loaded in a child process (dsq.runtime.llama_probe), so the CLI on both backends and the quantizer
ends with one line naming the file and llama.cpp's last words, exit 1; the verdict is kept in the
cache by path, size and mtime and read instead of probing again."""

from __future__ import annotations

import json
import os
import struct

import pytest

from dsq.errors import BackendError
from dsq.runtime import llama_probe
from hostile import add_key, assert_one_line_error, dsq, seed_gguf, set_string

RUN = {"run-llama.cpp": ["run", "bad.gguf", "-p", "hi", "-n", "2", "--ctx", "64", "-b", "llama.cpp"],
       "run-native": ["run", "bad.gguf", "-p", "hi", "-n", "2", "--ctx", "64", "-b", "native"]}
QUANTIZE = ["quantize", "bad.gguf", "--type", "Q8_0", "--out", "out.gguf"]


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    from dsq.fuzz.seeds import bpe_gguf_seed

    root = tmp_path_factory.mktemp("seeds")
    return {"q8": seed_gguf(root), "f16": bpe_gguf_seed(root).read_bytes()}


def _experts_without_used(d: bytes) -> bytes:
    """An expert count with no experts-per-token count: load_hparams' GGML_ASSERT(n_expert_used_max > 0)."""
    return add_key(d, "qwen2.expert_count", 4, struct.pack("<I", 4))


# name -> (seed, damage, what llama.cpp printed)
CASES = {
    "tokenizer-none": ("q8", lambda d: set_string(d, "tokenizer.ggml.model", "none"), "Tokenizer not initialized"),
    "tokenizer-bert": ("q8", lambda d: set_string(d, "tokenizer.ggml.model", "bert"), "SIGABRT"),
    "experts-without-used": ("f16", _experts_without_used, "GGML_ASSERT(n_expert_used_max > 0)"),
}


# the native backend loads only the vocabulary through llama.cpp, which the expert counts do not reach
PAIRS = [(case, command) for case in sorted(CASES) for command in sorted(RUN)
         if (case, command) != ("experts-without-used", "run-native")]


@pytest.mark.parametrize(("case", "command"), PAIRS)
def test_run_exits_1_with_llama_cpps_words(case, command, seeds, tmp_path):
    seed, damage, said = CASES[case]
    (tmp_path / "bad.gguf").write_bytes(damage(seeds[seed]))
    assert_one_line_error(dsq(RUN[command], tmp_path), "llama.cpp crashed on bad.gguf", said)


def test_quantizer_exits_1_with_llama_cpps_words(seeds, tmp_path):
    (tmp_path / "bad.gguf").write_bytes(_experts_without_used(seeds["f16"]))
    assert_one_line_error(dsq(QUANTIZE, tmp_path), "llama.cpp crashed on bad.gguf", "n_expert_used_max > 0")
    assert not (tmp_path / "out.gguf").exists()


def test_the_verdict_is_cached_and_read_back(seeds, tmp_path):
    """The second run reads the kept verdict (its detail changed here shows through) instead of
    probing again."""
    (tmp_path / "bad.gguf").write_bytes(CASES["tokenizer-none"][1](seeds["q8"]))
    assert_one_line_error(dsq(RUN["run-native"], tmp_path), "Tokenizer not initialized")
    (kept,) = (tmp_path / ".dsq-cache" / "probed").glob("*.json")
    v = json.loads(kept.read_text())
    assert v["ok"] is False and v["key"]["path"] == str((tmp_path / "bad.gguf").resolve())
    kept.write_text(json.dumps(dict(v, detail="the kept verdict")))
    assert_one_line_error(dsq(RUN["run-native"], tmp_path), "(the kept verdict)")


def test_a_changed_file_is_probed_again(seeds, tmp_path, monkeypatch):
    monkeypatch.setenv("DSQ_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("DSQ_LLAMA_PROBE", raising=False)
    f = tmp_path / "m.gguf"
    f.write_bytes(seeds["q8"])
    what = {"call": "load", "load": {"n_ctx": 64, "vocab_only": True}}
    llama_probe.check_loads(f, what)
    assert len(list((tmp_path / "cache" / "probed").glob("*.json"))) == 1
    llama_probe.check_loads(f, what)  # kept: no second verdict
    assert len(list((tmp_path / "cache" / "probed").glob("*.json"))) == 1
    f.write_bytes(CASES["tokenizer-none"][1](seeds["q8"]))
    os.utime(f, ns=(1, 1))  # same path, new size and mtime
    with pytest.raises(BackendError, match="Tokenizer not initialized"):
        llama_probe.check_loads(f, what)
    assert len(list((tmp_path / "cache" / "probed").glob("*.json"))) == 2


def test_the_builtin_model_is_probed_once(builtin_gguf, tmp_path):
    """`dsq run` on the built-in model: one verdict for its vocabulary (native backend), kept and
    reused by the next start."""
    args = ["run", "-p", "hi", "-n", "1", "--ctx", "64", "-b", "native"]
    p = dsq(args, tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    (kept,) = (tmp_path / ".dsq-cache" / "probed").glob("*.json")
    v = json.loads(kept.read_text())
    assert v["ok"] is True and v["key"]["path"] == str(builtin_gguf.resolve())
    mtime = kept.stat().st_mtime_ns
    assert dsq(args, tmp_path, timeout=300).returncode == 0
    assert [kept] == list((tmp_path / ".dsq-cache" / "probed").glob("*.json")) and kept.stat().st_mtime_ns == mtime
