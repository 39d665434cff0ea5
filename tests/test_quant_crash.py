"""Killed, interrupted and out-of-space quantization: whatever instant a run dies, the next run of
the same command finishes the job with the result an uninterrupted run gives, nothing that looks
complete appears before it is, and nothing is left behind.

Kills (dsq.quant.faults: with DSQ_FAULT=NAME the process SIGKILLs itself at point NAME) run as
`python -m dsq quantize` subprocesses on the tiny llama (2 blocks), chained: each rerun resumes what
the last kill left and is killed at the next point, then a last rerun finishes. After every kill
the progress record must describe only complete files, and OUT must not exist unless the kill came
after the rename. Points per method:
- awq (calibrated, and the cheapest to calibrate): all of them: calibration, each block (after its
  file, before its record), each finalizing step (rest tensors, first shard link, index, config,
  tokenizer files, dsq_quant.json), the eval, the card, the rename, the cleanup;
- gptq: a block, the tokenizer files, the cleanup;  fp8: a block, dsq_quant.json, the card;
- rtn, with --force over an existing OUT: a block, the index, the eval, the rename;
- gguf + imatrix: the importance matrix, the float conversion, llama.cpp's quantizer, the rename,
  the cleanup.
In this process (no kill needed): bit-exact resume from every block of the 3-block gemma3 for
rtn/gptq/awq/fp8 and from each step of gguf + imatrix, --force over damaged work, and a full disk:
refused up front, injected ENOSPC mid-run (DSQ_FAULT=enospc:NAME), and a real 8 MiB tmpfs filled
mid-run (DSQ_FAULT=fill:NAME) where mounting is allowed.

Everything computes on one torch thread, in this process and in the subprocesses alike: on a
shared 2-core machine that is several times faster than two, and the results compared are made
the same way.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsq.cli import app
from dsq.quant import CalibSpec, GGUFSpec, QuantSpec, evals_of, quantize

ROOT = Path(__file__).resolve().parents[1]
CALIB = ["--calib-samples", "4", "--calib-seq-len", "32"]
LAYER_ARGS = [*CALIB, "--eval-tokens", "64"]
GGUF_ARGS = ["--type", "Q4_K_M", "--imatrix", *CALIB]

LAYER_CHAINS = {
    "awq": ["calib", "block:0", "block:1", "finalize:rest", "finalize:link", "finalize:index", "finalize:config",
            "finalize:tokenizer", "finalize:record", "eval", "finalize:card", "finalize:rename", "finalize:cleanup"],
    "gptq": ["block:1", "finalize:tokenizer", "finalize:cleanup"],
    "fp8": ["block:0", "finalize:record", "finalize:card"],
    "rtn": ["block:0", "finalize:index", "eval", "finalize:rename"],
}
GGUF_CHAIN = ["gguf:imatrix", "gguf:convert", "gguf:quantize", "gguf:rename", "gguf:cleanup"]


def dsq_quantize(src: Path, out: Path, args: list[str], fault: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSQ_FAULT")}
    env.update(DSQ_QUIET="1", OMP_NUM_THREADS="1", **({"DSQ_FAULT": fault} if fault else {}))
    return subprocess.run([sys.executable, "-m", "dsq", "quantize", str(src), "--out", str(out), *args], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def tensors(out: Path):
    """An artifact's content: every tensor of an HF directory, a GGUF's bytes."""
    from safetensors.torch import load_file

    if out.is_file():
        return out.read_bytes()
    found = {}
    for f in sorted(out.glob("*.safetensors")):
        found.update(load_file(str(f)))
    return found


def same(a, b) -> bool:
    if isinstance(a, bytes):
        return a == b
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def partial_of(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def one_line_error(r, *needles: str) -> None:
    """A user error: exit code 1 and one line on stderr that holds each needle."""
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert "internal error" not in lines[0] and all(n in lines[0] for n in needles), lines[0]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def reference(tiny_dir, tmp_path_factory):
    """method -> the content of an uninterrupted `python -m dsq quantize` run (a GGUF for "gguf")."""
    made: dict = {}

    def get(method: str):
        if method not in made:
            out = tmp_path_factory.mktemp("ref") / ("m.gguf" if method == "gguf" else method)
            args = GGUF_ARGS if method == "gguf" else ["--method", method, *LAYER_ARGS]
            r = dsq_quantize(tiny_dir("llama"), out, args)
            assert r.returncode == 0, r.stderr
            made[method] = tensors(out)
        return made[method]

    return get


def check_record(partial: Path) -> None:
    """The progress record describes only complete files."""
    from dsq.quant.staging import STAGE_FILES, _readable

    if not (partial / "state.json").is_file():
        return
    st = json.loads((partial / "state.json").read_text())
    assert all(_readable(partial / "blocks" / f"block-{i:05d}.safetensors") for i in range(st["done"])), st
    if st["hidden"]:
        assert _readable(partial / st["hidden"]), st
    stage = partial / "stage"
    if st["phase"] in ("staged", "ready") and stage.exists():
        assert all((stage / f).is_file() for f in STAGE_FILES), st
        index = json.loads((stage / STAGE_FILES[0]).read_text())
        assert all(_readable(stage / f) for f in set(index["weight_map"].values()))


# -- kills, through the CLI in subprocesses ----------------------------------------------------
@pytest.mark.parametrize("method", list(LAYER_CHAINS))
def test_layer_method_killed_at_each_phase(method, tiny_dir, reference, tmp_path):
    out, force = tmp_path / method, method == "rtn"
    args = ["--method", method, *LAYER_ARGS] + (["--force"] if force else [])
    if force:  # an old artifact stays in place until the new one replaces it
        out.mkdir()
        (out / "old").write_text("x")
    for point in LAYER_CHAINS[method]:
        r = dsq_quantize(tiny_dir("llama"), out, args, fault=point)
        assert r.returncode == -signal.SIGKILL, (point, r.stderr)
        assert set(listing(tmp_path)) <= {out.name, partial_of(out).name}, point
        published = point == "finalize:cleanup"
        assert out.exists() == (published or force), point
        if out.exists():
            assert (out / "old").exists() != published and (evals_of(out) is not None) == published, point
        check_record(partial_of(out))
    if force:  # without --force the half-made run over an existing OUT is refused and kept
        r = dsq_quantize(tiny_dir("llama"), out, args[:-1])
        assert r.returncode == 1 and "already exists" in r.stderr and partial_of(out).is_dir()
    r = dsq_quantize(tiny_dir("llama"), out, args)
    assert r.returncode == 0, r.stderr
    assert "KLD" in r.stderr and listing(tmp_path) == [out.name]
    assert same(tensors(out), reference(method))
    assert set(evals_of(out)) >= {"perplexity", "KLD"} and "KLD" in (out / "README.md").read_text()


def test_gguf_imatrix_killed_at_each_step(tiny_dir, reference, tmp_path):
    out = tmp_path / "m.gguf"
    work = tmp_path / ".m.gguf.dsq-work"
    for point in GGUF_CHAIN:
        r = dsq_quantize(tiny_dir("llama"), out, GGUF_ARGS, fault=point)
        assert r.returncode == -signal.SIGKILL, (point, r.stderr)
        assert set(listing(tmp_path)) <= {out.name, work.name}, point
        assert out.exists() == (point == "gguf:cleanup"), point
    r = dsq_quantize(tiny_dir("llama"), out, GGUF_ARGS)
    assert r.returncode == 0, r.stderr
    assert listing(tmp_path) == [out.name] and same(tensors(out), reference("gguf"))


# -- resume is bit-exact -------------------------------------------------------------------------
def stop_after(k: int):
    def progress(step):
        if step.done == k:
            raise KeyboardInterrupt
    return progress


@pytest.mark.parametrize("method,kind", [("rtn", "gemma3"), ("gptq", "gemma3"), ("awq", "gemma3"), ("fp8", "gemma3"),
                                         ("gptq", "deepseek_v3")])
def test_resume_from_any_block_is_bit_exact(method, kind, tiny_dir, tmp_path):
    """3 blocks each; deepseek_v3: a dense block kept 16-bit, then two MoE blocks whose experts
    are calibrated on their routed tokens (their record in the card resumes too)."""
    src = tiny_dir(kind)
    spec = QuantSpec(method, calib=CalibSpec(samples=4, seq_len=32), min_expert_tokens=16)
    full = tensors(quantize(src, tmp_path / "full", spec, eval_tokens=0))
    assert same(tensors(quantize(src, tmp_path / "again", spec, eval_tokens=0)), full)
    for k in (1, 2):
        out = tmp_path / f"from-{k}"
        with pytest.raises(KeyboardInterrupt):
            quantize(src, out, spec, eval_tokens=0, progress=stop_after(k))
        assert partial_of(out).is_dir() and not out.exists()
        seen = []
        quantize(src, out, spec, eval_tokens=0, progress=seen.append)
        assert [s.done for s in seen if not s.note] == [0, *range(k + 1, 4)]  # the finished blocks were not redone
        assert [s.note for s in seen if s.note] == [f"resuming from block {k + 1} of 3: an earlier run finished {k} "
                                                    f"(kept in {out.name}.partial)"]
        assert same(tensors(out), full)
        assert experts_of(out) == experts_of(tmp_path / "full") and (experts_of(out) is None) == (kind != "deepseek_v3")


def experts_of(out: Path) -> dict | None:
    return json.loads((out / "dsq_quant.json").read_text()).get("experts")


def test_gguf_imatrix_resume_is_bit_exact(tiny_dir, tmp_path):
    src = tiny_dir("llama")
    spec = GGUFSpec("Q4_K_M", imatrix=True, calib=CalibSpec(samples=4, seq_len=32))
    full = quantize(src, tmp_path / "full.gguf", spec).read_bytes()
    assert quantize(src, tmp_path / "again.gguf", spec).read_bytes() == full
    for stop, rest in (("-> GGUF", 2), ("quantizing to", 1)):
        out = tmp_path / f"{rest}.gguf"

        def interrupt(step, stop=stop):
            if stop in step.task:
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            quantize(src, out, spec, progress=interrupt)
        tasks = []
        quantize(src, out, spec, progress=lambda s: tasks.append(s.task or s.note) if s.task not in tasks else None)
        reused = "importance matrix" + (" and float GGUF" if rest == 1 else "")
        assert tasks[0] == f"resuming: reusing the {reused} an earlier run left in .{out.name}.dsq-work"
        assert len(tasks) == 1 + rest  # the importance matrix (and the float GGUF) came from the last run
        assert out.read_bytes() == full
    assert sorted(listing(tmp_path)) == ["1.gguf", "2.gguf", "again.gguf", "full.gguf"]


# -- --force over damaged work ----------------------------------------------------------------------
def test_force_recovers_layer_run(tiny_dir, tmp_path):
    src = tiny_dir("llama")
    spec = QuantSpec("rtn")
    want = tensors(quantize(src, tmp_path / "clean", spec, eval_tokens=0))
    out = tmp_path / "q"
    with pytest.raises(KeyboardInterrupt):
        quantize(src, out, spec, eval_tokens=0, progress=stop_after(1))
    partial = partial_of(out)
    # blocks the record lists are gone (an older finalize renamed them), a half-built stage, an old OUT
    (partial / "blocks" / "block-00000.safetensors").rename(partial / "model-00001-of-00003.safetensors")
    (partial / "stage").mkdir()
    out.mkdir()
    assert same(tensors(quantize(src, out, spec, eval_tokens=0, force=True)), want)
    assert sorted(listing(tmp_path)) == ["clean", "q"]
    # a damaged record and a truncated block: the run starts clean
    with pytest.raises(KeyboardInterrupt):
        quantize(src, tmp_path / "r", spec, eval_tokens=0, progress=stop_after(1))
    block = partial_of(tmp_path / "r") / "blocks" / "block-00000.safetensors"
    block.write_bytes(block.read_bytes()[:1000])
    assert same(tensors(quantize(src, tmp_path / "r", spec, eval_tokens=0)), want)
    (tmp_path / "s.partial").mkdir()
    (tmp_path / "s.partial" / "state.json").write_text("{not json")
    assert same(tensors(quantize(src, tmp_path / "s", spec, eval_tokens=0)), want)
    assert sorted(listing(tmp_path)) == ["clean", "q", "r", "s"]


def test_force_recovers_gguf_run(tiny_dir, reference, tmp_path):
    spec = GGUFSpec("Q4_K_M", imatrix=True, calib=CalibSpec(samples=4, seq_len=32))
    out = tmp_path / "m.gguf"
    out.write_bytes(b"old")
    work = tmp_path / ".m.gguf.dsq-work"
    work.mkdir()
    (work / "float.gguf").write_bytes(b"GGUF truncated")
    (work / "imatrix.safetensors").write_bytes(b"junk")
    (work / ".quantized.gguf.abc123.partial").write_bytes(b"half")
    (work / "state.json").write_text('{"float": "stale"}')
    quantize(tiny_dir("llama"), out, spec, force=True)
    assert listing(tmp_path) == ["m.gguf"] and out.read_bytes() == reference("gguf")


# -- a full disk -----------------------------------------------------------------------------------
def test_disk_full_errors_are_recognised():
    import errno

    from safetensors import SafetensorError

    from dsq.quant.space import is_disk_full

    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                        'message: "No space left on device" })'))
    assert is_disk_full(OSError("32768 requested and 1440 written"))  # numpy's tofile
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))


@pytest.mark.parametrize("args", [["--method", "gptq", *CALIB], ["--type", "Q8_0"]], ids=["gptq", "gguf"])
def test_too_little_space_refused_up_front(args, runner, tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("dsq.quant.space.free_bytes", lambda path: 1 << 20)
    r = runner.invoke(app, ["quantize", str(tiny_dir("llama")), *args, "--out", str(tmp_path / "o")])
    one_line_error(r, "not enough disk space", "1.0 MiB free", "MiB, ")
    assert listing(tmp_path) == []


def test_disk_full_mid_run_layer(runner, tiny_dir, tmp_path, monkeypatch):
    out = tmp_path / "q"
    args = ["quantize", str(tiny_dir("llama")), "--method", "rtn", "--eval-tokens", "0", "--out", str(out)]
    monkeypatch.setenv("DSQ_FAULT", "enospc:block:0")  # nothing finished: nothing to keep
    one_line_error(runner.invoke(app, args), "disk filled up", "more", "removed the partial files")
    assert listing(tmp_path) == []
    monkeypatch.setenv("DSQ_FAULT", "enospc:finalize:config")
    one_line_error(runner.invoke(app, args), "disk filled up", "kept q.partial", "2 of 2 blocks", "to resume")
    assert listing(tmp_path) == ["q.partial"] and not (partial_of(out) / "stage").exists()
    monkeypatch.delenv("DSQ_FAULT")
    assert runner.invoke(app, args).exit_code == 0 and listing(tmp_path) == ["q"]
    assert same(tensors(out), tensors(quantize(tiny_dir("llama"), tmp_path / "clean", QuantSpec("rtn"), eval_tokens=0)))


def test_disk_full_mid_run_gguf(runner, tiny_dir, reference, tmp_path, monkeypatch):
    out = tmp_path / "m.gguf"
    args = ["quantize", str(tiny_dir("llama")), *GGUF_ARGS, "--out", str(out)]
    monkeypatch.setenv("DSQ_FAULT", "enospc:gguf:quantize")
    one_line_error(runner.invoke(app, args), "disk filled up", "kept float.gguf and imatrix.safetensors")
    assert listing(tmp_path) == [".m.gguf.dsq-work"]
    monkeypatch.delenv("DSQ_FAULT")
    assert runner.invoke(app, args).exit_code == 0
    assert listing(tmp_path) == ["m.gguf"] and out.read_bytes() == reference("gguf")


@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB tmpfs, where this machine lets the tests mount one."""
    disk = tmp_path / "disk"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()})")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_real_full_disk(small_disk, runner, tiny_dir, reference, monkeypatch):
    """Writers meeting a really full disk (safetensors, Python, llama.cpp): one line each, and
    the rerun after space is freed finishes with the uninterrupted result."""
    filler = small_disk / "filler"
    monkeypatch.setenv("DSQ_FAULT_FILL", str(filler))
    filler.write_bytes(bytes(7 << 20))
    layer = ["quantize", str(tiny_dir("llama")), "--method", "rtn", *LAYER_ARGS, "--out", str(small_disk / "q")]
    one_line_error(runner.invoke(app, layer), "not enough disk space")
    cases = [(layer, "fill:calib", "removed the partial files"),  # safetensors' writer
             (layer, "fill:finalize:rest", "kept q.partial"),  # Python's
             (["quantize", str(tiny_dir("llama")), *GGUF_ARGS, "--out", str(small_disk / "m.gguf")],
              "fill:gguf:quantize", "kept float.gguf")]  # llama.cpp's quantizer
    for args, fault, kept in cases:
        filler.unlink()
        monkeypatch.setenv("DSQ_FAULT", fault)
        one_line_error(runner.invoke(app, args), "disk filled up", kept)
    filler.unlink()
    monkeypatch.delenv("DSQ_FAULT")
    assert runner.invoke(app, layer).exit_code == 0 and runner.invoke(app, cases[-1][0]).exit_code == 0
    assert listing(small_disk) == ["m.gguf", "q"]
    assert same(tensors(small_disk / "q"), reference("rtn"))
    assert (small_disk / "m.gguf").read_bytes() == reference("gguf")
