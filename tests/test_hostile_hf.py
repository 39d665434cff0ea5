"""Damaged HF directories: config.json values of the wrong type, sign or size, and safetensors
headers that lie. dsq refuses each with one line naming the field; `dsq run -b native` and
`dsq quantize` exit 1 with that line."""

from __future__ import annotations

import json
import math

import pytest

from dsq.errors import BadModelFile, UnsupportedModel
from dsq.formats.config_check import check_config
from dsq.formats.hf import HFModelDir, mmap_safetensors
from dsq.formats.safetensors_file import read_header
from hostile import assert_one_line_error, dsq, edit_config, hf_copy, safetensors_with_header


@pytest.fixture(scope="module")
def seed_dir(tmp_path_factory):
    from dsq.fuzz.seeds import hf_seed

    return hf_seed(tmp_path_factory.mktemp("seeds"))


# config.json: name -> (changes, what the one line names). Each once surfaced as an internal error
# ("Storage size calculation overflowed", "negative dimension", TypeError, ZeroDivisionError).
CONFIGS = {
    "hidden-size-string": ({"hidden_size": "256"}, "hidden_size"),
    "hidden-size-negative": ({"hidden_size": -256}, "hidden_size"),
    "hidden-size-overflow": ({"hidden_size": 1 << 40}, "hidden_size"),
    "layers-float": ({"num_hidden_layers": 2.5}, "num_hidden_layers"),
    "heads-zero": ({"num_attention_heads": 0}, "num_attention_heads"),
    "kv-heads-not-dividing": ({"num_key_value_heads": 3}, "num_key_value_heads"),
    "head-dim-odd": ({"head_dim": 63}, "head_dim"),
    "vocab-null": ({"vocab_size": None}, "vocab_size"),
    "eps-nan": ({"rms_norm_eps": math.nan}, "rms_norm_eps"),
    "rope-theta-negative": ({"rope_theta": -1.0}, "rope_theta"),
    "tie-embeddings-string": ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    "rope-scaling-list": ({"rope_scaling": [1, 2]}, "rope_scaling"),
    "rope-scaling-without-factor": ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor is missing"),
    "rope-yarn-without-context": ({"rope_scaling": {"type": "yarn", "factor": 4.0}},
                                  "rope_scaling.original_max_position_embeddings is missing"),
    "rope-mscale-string": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": "1",
                                             "original_max_position_embeddings": 64}}, "rope_scaling.mscale"),
    "quantization-bits": ({"quantization_config": {"quant_method": "gptq", "bits": 5}}, "bits"),
    "dims-past-the-weights": ({"hidden_size": 1 << 16, "intermediate_size": 1 << 20, "head_dim": 64}, "weights"),
}
CLI_CONFIGS = ["hidden-size-string", "hidden-size-negative", "hidden-size-overflow", "heads-zero", "vocab-null",
               "dims-past-the-weights", "rope-scaling-without-factor"]


def _weight_bytes(d):
    return sum(f.stat().st_size for f in d.glob("*.safetensors"))


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_config_refused_naming_the_field(case, seed_dir, tmp_path):
    changes, needle = CONFIGS[case]
    d = edit_config(hf_copy(seed_dir, tmp_path / "m"), **changes)
    cfg = json.loads((d / "config.json").read_text())
    with pytest.raises(BadModelFile) as e:
        HFModelDir(d)
        check_config(cfg, "config.json", weight_bytes=_weight_bytes(d))
    assert needle in e.value.one_line(), e.value.one_line()


def test_an_unknown_rope_type_is_refused(seed_dir):
    cfg = json.loads((seed_dir / "config.json").read_text())
    with pytest.raises(UnsupportedModel, match="rope_scaling type 'dynamic' is not supported"):
        check_config(dict(cfg, rope_scaling={"type": "dynamic", "factor": 2.0}), "config.json")


def test_required_fields_come_from_the_caller(seed_dir):
    cfg = json.loads((seed_dir / "config.json").read_text())
    check_config(cfg, "config.json", required=("hidden_size",), weight_bytes=_weight_bytes(seed_dir))
    with pytest.raises(BadModelFile, match="is missing hidden_size"):
        check_config({k: v for k, v in cfg.items() if k != "hidden_size"}, "config.json", required=("hidden_size",))


@pytest.mark.parametrize("command", ["run-native", "quantize"])
@pytest.mark.parametrize("case", CLI_CONFIGS)
def test_cli_refuses_a_bad_config(case, command, seed_dir, tmp_path):
    changes, needle = CONFIGS[case]
    edit_config(hf_copy(seed_dir, tmp_path / "m"), **changes)
    args = (["run", "m", "-p", "hi", "-n", "2", "--ctx", "64", "-b", "native"] if command == "run-native"
            else ["quantize", "m", "--type", "Q8_0", "--out", "out.gguf"])
    assert_one_line_error(dsq(args, tmp_path), needle)
    assert not (tmp_path / "out.gguf").exists()


def _first(h):
    return next(k for k in h if k != "__metadata__")


# safetensors headers: name -> (edit, what the one line names)
HEADERS = {
    "unknown-dtype": (lambda h: {**h, _first(h): {**h[_first(h)], "dtype": "Q4"}}, "dtype"),
    "dtype-not-a-string": (lambda h: {**h, _first(h): {**h[_first(h)], "dtype": ["F32"]}}, "dtype"),
    "negative-shape": (lambda h: {**h, _first(h): {**h[_first(h)], "shape": [-1, 4]}}, "shape"),
    "shape-not-matching-bytes": (lambda h: {**h, _first(h): {**h[_first(h)], "shape": [3, 3]}}, "need"),
    "offsets-past-eof": (lambda h: {**h, _first(h): {**h[_first(h)], "data_offsets": [0, 1 << 40]}}, "outside"),
    "offsets-reversed": (lambda h: {**h, _first(h): {**h[_first(h)], "data_offsets": [8, 0]}}, "outside"),
    "overlap": (lambda h: _overlap(h), "overlaps"),
    "metadata-not-strings": (lambda h: {**h, "__metadata__": {"format": 1}}, "__metadata__"),
    "not-an-object": (lambda h: [1, 2], "not a JSON object"),
}


def _overlap(h):
    names = [k for k in h if k != "__metadata__"]
    a, b = sorted(names, key=lambda k: h[k]["data_offsets"][0])[:2]
    h = dict(h)
    nbytes = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
    h[b] = {**h[b], "data_offsets": [h[a]["data_offsets"][0], h[a]["data_offsets"][0] + nbytes]}
    return h


@pytest.mark.parametrize("case", sorted(HEADERS))
def test_safetensors_header_refused(case, seed_dir, tmp_path):
    edit, needle = HEADERS[case]
    d = hf_copy(seed_dir, tmp_path / "m")
    safetensors_with_header(d / "model.safetensors", edit)
    with pytest.raises(BadModelFile) as e:
        read_header(d / "model.safetensors")
    assert needle in e.value.one_line(), e.value.one_line()
    with pytest.raises(BadModelFile):
        mmap_safetensors(d / "model.safetensors")


@pytest.mark.parametrize("length", [1 << 62, 1 << 40, 7])
def test_header_length_lies(length, seed_dir, tmp_path):
    p = tmp_path / "x.safetensors"
    data = (seed_dir / "model.safetensors").read_bytes()
    p.write_bytes(length.to_bytes(8, "little") + data[8:])
    with pytest.raises(BadModelFile, match="header"):
        read_header(p)


def test_repeated_tensor_name_refused(seed_dir, tmp_path):
    p = tmp_path / "x.safetensors"
    data = (seed_dir / "model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    text = data[8:8 + n].decode().rstrip()
    first = text.index('"', 1)
    dup = text[:-1] + "," + text[1:text.index("}", first) + 1] + "}"
    new = dup.encode() + b" " * (-len(dup) % 8)
    p.write_bytes(len(new).to_bytes(8, "little") + new + data[8 + n:])
    with pytest.raises(BadModelFile, match="twice"):
        read_header(p)


@pytest.mark.parametrize("command", ["run-native", "quantize"])
@pytest.mark.parametrize("case", ["unknown-dtype", "offsets-past-eof", "overlap"])
def test_cli_refuses_a_bad_header(case, command, seed_dir, tmp_path):
    edit, needle = HEADERS[case]
    d = hf_copy(seed_dir, tmp_path / "m")
    safetensors_with_header(d / "model.safetensors", edit)
    args = (["run", "m", "-p", "hi", "-n", "2", "--ctx", "64", "-b", "native"] if command == "run-native"
            else ["quantize", "m", "--type", "Q8_0", "--out", "out.gguf"])
    assert_one_line_error(dsq(args, tmp_path), "model.safetensors", needle)
    assert not (tmp_path / "out.gguf").exists()


def test_index_naming_a_file_outside_the_directory(seed_dir, tmp_path):
    d = hf_copy(seed_dir, tmp_path / "m")
    names = list(read_header(d / "model.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {names[0]: "../../etc/passwd"}}))
    with pytest.raises(BadModelFile, match="not a file name"):
        HFModelDir(d).weight_map


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json"])
def test_broken_json_beside_the_config(name, seed_dir, tmp_path):
    d = hf_copy(seed_dir, tmp_path / "m")
    (d / name).write_text("{not json")
    p = dsq(["run", "m", "-p", "hi", "-n", "2", "--ctx", "64", "-b", "native"], tmp_path)
    assert_one_line_error(p, name)


def test_quantize_into_a_pipe_fails_with_one_line(seed_dir, tmp_path):
    """Without DSQ_QUIET, a refused input's steps printed into a pipe before the refusal are held
    back: the error is the only line."""
    import os
    import subprocess
    import sys

    d = hf_copy(seed_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["intermediate_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    env = dict(os.environ, DSQ_CACHE=str(tmp_path / "cache"), GGML_NO_BACKTRACE="1")
    for k in ("DSQ_QUIET", "CI", "DSQ_DEBUG"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-m", "dsq", "quantize", "m", "--type", "Q8_0", "--out", "out.gguf"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert_one_line_error(p, "intermediate_size")


def test_held_lines_are_written_on_success_and_after_the_hold():
    import io

    from dsq.cli.quantize import HeldLines

    out = io.StringIO()
    held = HeldLines(out, hold_s=60)
    held.write("step 1\n")
    assert out.getvalue() == ""
    held.release()
    held.write("step 2\n")
    assert out.getvalue() == "step 1\nstep 2\n"
    dropped = HeldLines(out := io.StringIO(), hold_s=60)
    dropped.write("step 1\n")
    dropped.discard()
    assert out.getvalue() == ""
    late = HeldLines(out := io.StringIO(), hold_s=0)
    late.write("step 1\n")
    assert out.getvalue() == "step 1\n"
