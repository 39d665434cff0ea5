"""What a new user meets through the CLI: the backend picked for dsq's own AWQ output, chat's line
editing, loop stop and stats, one-line errors for bad values and outputs, honest bench and
quantize numbers, the cache command, progress in a pipe, resume messages, install.sh, help text."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dsq.cli import app
from test_cli_errors import listing, one_line_error

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][0-9A-Za-z]|\x1b[=>]|\r")


@pytest.fixture(scope="module")
def awq_dir(tiny_dir, tmp_path_factory):
    """The tiny llama in AWQ int4, as `dsq quantize --method awq` writes it."""
    from dsq.quant import CalibSpec, QuantSpec, quantize

    out = tmp_path_factory.mktemp("awq") / "tiny-awq-w4"
    return quantize(tiny_dir("llama"), out, QuantSpec("awq", calib=CalibSpec(samples=4, seq_len=32)), eval_tokens=0)


# -- 1. dsq's own AWQ output runs: the native backend is picked for it ----------------------------------
def test_awq_output_runs_on_the_native_backend(runner, awq_dir):
    r = runner.invoke(app, ["run", str(awq_dir), "-p", "The return statement", "-n", "3", "-t", "0", "--ignore-eos",
                            "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["backend"] == "native" and len(json.loads(r.stdout)["token_ids"]) == 3
    assert "AWQ weights: running on the native backend" in r.stderr
    line = one_line_error(runner.invoke(app, ["run", str(awq_dir), "-p", "x", "--backend", "llama.cpp"]),
                          "llama.cpp cannot run", "AWQ", "--backend native")
    assert "GGUF counterpart" not in line
    r = runner.invoke(app, ["bench", str(awq_dir), "--prompt-tokens", "8", "--max-tokens", "2", "--repeat", "1"])
    assert r.exit_code == 0 and "native" in r.stdout, r.output


# -- 2. chat: line editing and history, loops stopped, stats after Ctrl-C -------------------------------
def _pty_session(args: list[str], keys: list[tuple[str, bytes]], timeout: float = 120) -> tuple[str, int]:
    """Run `dsq ARGS` on a pseudo-terminal; for each (wait_for, keys) wait until the output holds
    wait_for (after the last one found), then type keys. Returns the text seen and the exit code."""
    import fcntl
    import pty
    import select
    import struct
    import termios
    import time

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))
    env = {**os.environ, "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1", "COLUMNS": "120"}
    env.pop("DSQ_QUIET", None)
    proc = subprocess.Popen([sys.executable, "-m", "dsq", *args], stdin=slave, stdout=slave, stderr=slave, env=env,
                            close_fds=True)
    os.close(slave)
    seen, start, deadline = b"", 0, time.monotonic() + timeout

    def wait_for(needle: str) -> None:
        nonlocal seen, start
        while (at := seen.find(needle.encode(), start)) < 0:
            if time.monotonic() > deadline or proc.poll() is not None and not select.select([master], [], [], 0)[0]:
                raise AssertionError(f"no {needle!r} in {ANSI.sub('', seen.decode(errors='replace'))!r}")
            if select.select([master], [], [], 0.2)[0]:
                try:
                    seen += os.read(master, 65536)
                except OSError:
                    break
        start = at + len(needle)

    try:
        for needle, typed in keys:
            wait_for(needle)
            os.write(master, typed)
        code = proc.wait(timeout=60)
        while select.select([master], [], [], 0.1)[0]:
            try:
                seen += os.read(master, 65536)
            except OSError:
                break
    finally:
        proc.kill()
        os.close(master)
    return ANSI.sub("", seen.decode(errors="replace")), code


def test_chat_line_editing_and_history_on_a_terminal(tiny_gguf):
    """On a terminal the arrow keys edit the line and Up recalls the last one (no ^[[A)."""
    path = str(tiny_gguf("qwen2", "F16"))
    text, code = _pty_session(["chat", path, "-n", "4", "-t", "0"], [
        (">", b"class"),  # the prompt ("> ", its space drawn as a cursor move)
        ("class", b"\x1b[D\x1b[D\x1b[DX\r"),  # Left x3, then X: "clXass"
        ("tok/s", b""), (">", b"\x1b[A\r"),  # Up: the last line again
        ("tok/s", b""), (">", b"\x04"),  # Ctrl-D leaves
    ])
    assert code == 0, text
    assert "^[[" not in text and "clXass" in text
    assert text.count("tok/s") == 2, text


def test_chat_stops_a_loop_and_says_so(runner, tiny_gguf):
    """The tiny model, greedy and unpenalized, loops: the reply stops there, with a message."""
    r = runner.invoke(app, ["chat", str(tiny_gguf("qwen2", "F16")), "-t", "0", "--repeat-penalty", "1", "-n", "400"],
                      input="Hello there\n")
    assert r.exit_code == 0, r.output
    assert "stopped: the reply repeats itself" in r.stderr
    tokens = int(re.search(r"(\d+) tokens \|", r.stderr).group(1))
    assert tokens < 400


def test_chat_keeps_the_stats_line_after_ctrl_c(runner, tiny_gguf, monkeypatch):
    from dsq.runtime import conversation

    send = conversation.Conversation.send

    def interrupted_send(self, text, on_part=None):
        parts = []

        def stop_after_two(kind, s):
            parts.append(s)
            if len(parts) == 2:
                raise KeyboardInterrupt
        return send(self, text, stop_after_two)

    monkeypatch.setattr(conversation.Conversation, "send", interrupted_send)
    r = runner.invoke(app, ["chat", str(tiny_gguf("qwen2", "F16")), "-n", "50", "-t", "0"],
                      input="Hello there\n/exit\n")
    assert r.exit_code == 0, r.output
    assert re.search(r"\d+ tokens \| TTFT \d+ ms \| [\d.]+ tok/s \| stopped", r.stderr), r.stderr


def test_loop_guard():
    from dsq.runtime.conversation import LoopGuard

    g = LoopGuard(min_span=12)
    assert not any(g.feed(t) for t in range(40))  # no cycle
    g = LoopGuard(min_span=12)
    fed = [g.feed(t) for t in [7, 8, 9] * 5]
    assert fed.index(True) == 11  # four cycles of 3 make the 12-token span


# -- 3. every bad value: one line, exit 1; outputs that exist are refused --------------------------------
@pytest.mark.parametrize("args,needle", [
    (["quantize", "--method", "nonsense"], "--method"),
    (["run", "-p", "hi", "--temperature", "abc"], "--temperature"),
    (["chat", "--max-tokens", "-5"], "--max-tokens"),
    (["run", "-p", "hi", "--max-tokens", "-5"], "--max-tokens"),
    (["bench", "--repeat", "x"], "--repeat"),
    (["run", "-p", "hi", "--threads", "0"], "--threads"),
    (["quantize", "--method", "awq", "--calib-samples", "0"], "--calib-samples"),
    (["quantize", "--method", "gptq", "--calib-seq-len", "-1"], "--calib-seq-len"),
    (["quantize", "--method", "rtn", "--eval-tokens", "-5"], "--eval-tokens"),
])
def test_bad_values_one_line_exit_1(args, needle, runner, tmp_path):
    if args[0] == "quantize":
        args = args + ["--out", str(tmp_path / "q")]
    line = one_line_error(runner.invoke(app, args), needle)
    assert "╭" not in line and "Usage" not in line
    assert listing(tmp_path) == []  # refused before any work: no .partial to clean up


def test_out_under_a_file(runner, tiny_dir, tmp_path):
    (tmp_path / "afile").write_text("x")
    line = one_line_error(runner.invoke(app, ["quantize", str(tiny_dir("qwen2")), "--type", "Q8_0", "--out",
                                              str(tmp_path / "afile" / "q.gguf")]), "is a file, not a folder")
    assert "internal error" not in line
    one_line_error(runner.invoke(app, ["convert", str(tiny_dir("qwen2")), str(tmp_path / "afile" / "m.gguf")]),
                   "is a file")


@pytest.mark.parametrize("kind", ["empty file", "empty dir"])
def test_empty_outputs_are_refused(kind, runner, tiny_dir, tiny_gguf, tmp_path):
    out = tmp_path / "out"
    out.touch() if kind == "empty file" else out.mkdir()
    src = str(tiny_dir("llama"))
    for args in (["quantize", src, "--type", "Q8_0"], ["quantize", src, "--method", "rtn", "--eval-tokens", "0"],
                 ["convert", str(tiny_gguf("llama", "F16"))], ["convert", src]):
        cmd = args + ["--out", str(out)] if args[0] == "quantize" else args + [str(out)]
        one_line_error(runner.invoke(app, cmd), "already exists", "--force")
    r = runner.invoke(app, ["bench", str(tiny_gguf("llama", "F16")), "--out", str(out), "--repeat", "1"])
    one_line_error(r, "already exists", "--force")
    assert listing(tmp_path) == ["out"] and (out.is_dir() or out.stat().st_size == 0)
    assert not out.is_dir() or listing(out) == []


# -- 4. numbers that say what they are -------------------------------------------------------------------
def test_quantize_reports_every_stage_and_explains_bits(runner, builtin_hf, tmp_path):
    """The built-in model: its embedding (63% of its weights) stays 8-bit in Q4_K_M."""
    out = tmp_path / "q.gguf"
    r = runner.invoke(app, ["quantize", "--type", "Q4_K_M", "--imatrix", "--calib-samples", "2", "--calib-seq-len",
                            "32", "--out", str(out)])
    assert r.exit_code == 0, r.output
    wrote = next(ln for ln in r.stderr.splitlines() if ln.startswith("wrote"))
    total, stages = re.search(r" in ([\d.]+)s \((.*)\)$", wrote).groups()
    times = dict(re.findall(r"(importance matrix|-> GGUF|quantizing to Q4_K_M)[^,]* ([\d.]+)s", stages))
    assert set(times) == {"importance matrix", "-> GGUF", "quantizing to Q4_K_M"}, stages
    assert sum(map(float, times.values())) <= float(total) + 0.2
    assert re.search(r"Q4_K_M: [\d.]+ bits/weight, 5\.\d+ in the layers; token_embd.weight \(63% of the weights\) "
                     r"is Q8_0", wrote), wrote


def test_bench_without_a_gpu(runner, tiny_gguf, tmp_path, monkeypatch):
    """--gpu-layers 0,8 without a GPU runs once; VRAM is n/a; 3 runs give the worst, not a p99."""
    import dsq.runtime.placement as placement

    monkeypatch.setattr(placement, "detect_gpu", lambda: None)
    import dsq.bench.metrics as metrics

    monkeypatch.setattr(metrics, "gpu_used_bytes", lambda: None)
    jp = tmp_path / "b.json"
    r = runner.invoke(app, ["bench", str(tiny_gguf("llama", "Q8_0")), "-g", "0,8", "--prompt-tokens", "16",
                            "--max-tokens", "4", "--repeat", "3", "--out", str(jp)])
    assert r.exit_code == 0, r.output
    assert "runs once, as 0" in r.stderr
    rep = json.loads(jp.read_text())
    (row,) = rep["summary"]
    assert row["gpu_layers"] == "0" and row["peak_vram_mb"] is None
    assert row["decode_tok_s_p99"] is None and row["decode_tok_s_worst"] == min(x["decode_tok_s"] for x in rep["runs"])
    assert "n/a" in r.stdout and "worst" in r.stdout and "p99" not in r.stdout.replace("p99 needs", "")
    assert all(x["base_rss_mb"] > 0 and 0 < x["peak_rss_mb"] for x in rep["runs"])


def test_bench_rss_is_each_backends_own(runner, tiny_gguf, tmp_path):
    """The second backend's peak RSS is counted above what the process held before it loaded."""
    jp = tmp_path / "b.json"
    r = runner.invoke(app, ["bench", str(tiny_gguf("llama", "Q8_0")), "-b", "native,llama.cpp", "--prompt-tokens",
                            "16", "--max-tokens", "4", "--repeat", "1", "--out", str(jp)])
    assert r.exit_code == 0, r.output
    native, llama = json.loads(jp.read_text())["runs"]
    assert llama["base_rss_mb"] >= native["base_rss_mb"] * 0.9  # the process grew; that is not llama.cpp's
    assert llama["peak_rss_mb"] < llama["base_rss_mb"]  # a tiny model: far below the process itself
    assert "peak RSS: above the process before loading" in r.stdout


# -- 5. the cache: a command to see and clear it; tests keep out of the user's ---------------------------
def test_cache_command(runner, tmp_path, monkeypatch, tiny_dir):
    cache = tmp_path / "cache"
    monkeypatch.setenv("DSQ_CACHE", str(cache))
    monkeypatch.delenv("DSQ_BUILTIN_CACHE")
    (cache / "converted").mkdir(parents=True)
    (cache / "converted" / "m.gguf").write_bytes(b"x" * 2**20)
    (cache / "calibration.json").write_text("{}")
    (cache / "mine.txt").write_text("not dsq's")
    r = runner.invoke(app, ["cache"])
    assert r.exit_code == 0, r.output
    assert str(cache) in r.stdout and "converted" in r.stdout and "1.0 MiB" in r.stdout
    assert "not dsq's: left alone" in r.stdout
    r = runner.invoke(app, ["cache", "--clear"])
    assert r.exit_code == 0 and "1.0 MiB freed" in r.stderr, r.output
    assert listing(cache) == ["mine.txt"]


def test_offload_keeps_no_bandwidth_it_measured_in_passing(runner, tiny_gguf, tmp_path, monkeypatch):
    """Without --calibrate, `dsq offload` measures the CPU for this call only: a reading taken on a
    busy machine is not kept for the next one (`dsq offload --calibrate` keeps one on purpose)."""
    import dsq.runtime.machine as machine

    monkeypatch.setenv("DSQ_CACHE", str(tmp_path / "cache"))
    readings = iter([5.9e9, 21e9])
    monkeypatch.setattr(machine, "measure_cpu_read", lambda threads: next(readings))
    model = str(tiny_gguf("llama", "Q8_0"))
    for gbs in ("5.9", "21.0"):
        r = runner.invoke(app, ["offload", model, "--vram", "1G"])
        assert r.exit_code == 0, r.output
        said = " ".join(r.stdout.split())
        assert f"on the CPU ({gbs} GB/s); bandwidths CPU measured now, not kept" in said, said
    assert not (tmp_path / "cache" / "calibration.json").exists()


def test_tests_use_their_own_cache():
    from dsq.runtime.builtin import builtin_dir, cache_dir

    home = Path(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))) / "dsq"
    assert cache_dir() != home and "dsq-test-cache-" in str(cache_dir())
    assert builtin_dir().parent != cache_dir()  # the built-in model's files are shared


# -- 6. long quantization: progress in a pipe, resume and interruption messages, 16-bit parts said ------
def test_progress_in_a_pipe_and_resume_messages(runner, tiny_dir, tmp_path, monkeypatch):
    out = tmp_path / "r"
    args = ["-m", "dsq", "quantize", str(tiny_dir("llama")), "--method", "rtn", "--eval-tokens", "0", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("DSQ_QUIET", "CI")}  # CI=1 also quiets a pipe
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    assert "rtn rtn-w4: blocks: 1/2" in p.stderr and "rtn rtn-w4: blocks: 2/2" in p.stderr
    assert "kept 16-bit" in p.stderr and "MiB" in p.stderr

    import dsq.cli.quantize as q

    calls = q._Bars.__call__

    def stop_at_second_block(self, step):
        calls(self, step)
        if step.task.endswith("blocks") and step.done == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(q._Bars, "__call__", stop_at_second_block)
    again = ["quantize", str(tiny_dir("llama")), "--method", "rtn", "--eval-tokens", "0", "--out", str(tmp_path / "s")]
    r = runner.invoke(app, again)
    assert r.exit_code == 130
    assert re.search(r"interrupted; kept s\.partial \(.*1 of 2 blocks done\) to resume from: run the same "
                     r"command again to resume", r.stderr), r.stderr
    monkeypatch.setattr(q._Bars, "__call__", calls)
    r = runner.invoke(app, again)
    assert r.exit_code == 0 and "resuming from block 2 of 2" in r.stderr, r.output


def test_awq_card_and_size_say_what_stays_16_bit(awq_dir):
    from dsq.quant.registry import get_method

    said = get_method("awq").describe(awq_dir)
    assert re.match(r"[\d.]+ MiB, of which [\d.]+ MiB \(\d+%\) are the embeddings", said), said
    card = (awq_dir / "README.md").read_text()
    assert "example.invalid" not in card and "by dsq" in card


# -- 7. install.sh: flags, build progress, no apt without asking -----------------------------------------
def _bash(script: str, stdin=subprocess.DEVNULL) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"source {ROOT / 'install.sh'}; {script}"], capture_output=True, text=True,
                          stdin=stdin, timeout=60)


def test_install_sh_flags_and_durations():
    p = subprocess.run(["bash", str(ROOT / "install.sh"), "--help"], capture_output=True, text=True)
    assert p.returncode == 0 and "--with-qemu" in p.stdout and "--no-apt" in p.stdout
    suite = re.search(r"test suite then takes about (\d+) minutes", (ROOT / "README.md").read_text()).group(1)
    assert "about 7 minutes on two idle cores" in p.stdout and f"about {suite} minutes" in p.stdout  # as the README
    p = subprocess.run(["bash", str(ROOT / "install.sh"), "--bogus"], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0
    assert "DSQ_INSTALL_APT=yes" in (ROOT / ".ci" / "run").read_text()  # CI installs them unattended


def test_install_sh_build_progress(tmp_path):
    log = tmp_path / "build.log"
    steps = "; ".join(f"echo '[{i}/50] Building C object ggml{i}.o'" for i in range(1, 51))
    p = _bash(f"{{ echo configuring; {steps}; }} | build_progress {log}")
    lines = p.stdout.splitlines()
    assert p.returncode == 0 and len(lines) == 11, p.stdout  # the first step, then each tenth
    assert lines[-1].startswith("install.sh:   compiling llama.cpp: 50 of 50 steps (")
    assert len(log.read_text().splitlines()) == 51  # the whole log is kept


def _install_llama(tmp_path, installed: str, *, rebuild: str = "no", builds: str = "llama-cpp-python 0.3.36: AVX2; no GPU offload"):
    """install_llama_cpp with llama-cpp-python reported as `installed` ("" for none) and pip stood in
    for: the pip arguments it got (or None if it ran no pip), and what install.sh printed."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    calls = tmp_path / "pip-args"
    p = _bash(f"""PY=python3 REBUILD_LLAMA={rebuild} CMAKE_ARGS_GIVEN= TMPDIR={tmp_path}
        have_gpu() {{ return 1; }}
        state={tmp_path}/state; printf '%s' {shlex.quote(installed)} > $state
        llama_build() {{ cat $state; }}
        pipi() {{ echo "$@" > {calls}; echo 'Building wheel for llama-cpp-python (pyproject.toml)';
                  echo '[1/2] cc a.c'; echo '[2/2] cc b.c'; printf '%s' {shlex.quote(builds)} > $state; }}
        install_llama_cpp""")
    assert p.returncode == 0 or "error:" in p.stdout, p.stdout + p.stderr
    return (calls.read_text().split() if calls.exists() else None), p


def test_install_sh_builds_llama_cpp_from_source_every_time(tmp_path):
    """No wheel from pip's cache or an index (a cached one had the AMX path on): --no-binary and no
    cache, and it says what it built."""
    args, p = _install_llama(tmp_path, "")
    assert "--no-binary" in args and args[args.index("--no-binary") + 1] == "llama-cpp-python"
    assert "--no-cache-dir" in args and "--force-reinstall" not in args
    assert "built llama-cpp-python 0.3.36: AVX2; no GPU offload in " in p.stdout
    assert "-DGGML_AMX_INT8=OFF" in p.stdout or not _x86()


def _x86() -> bool:
    import platform

    return platform.machine() in ("x86_64", "AMD64")


def test_install_sh_keeps_its_own_build_and_replaces_another(tmp_path):
    args, p = _install_llama(tmp_path / "a", "llama-cpp-python 0.3.36: AVX2 AVX512; no GPU offload")
    assert args is None and "keeping the installed llama-cpp-python 0.3.36" in p.stdout
    args, p = _install_llama(tmp_path / "b", "llama-cpp-python 0.3.36: AVX2 AVX512 AMX_INT8; no GPU offload")
    assert "--force-reinstall" in args and "replacing llama-cpp-python 0.3.36" in p.stdout and "AMX" in p.stdout
    args, p = _install_llama(tmp_path / "c", "llama-cpp-python 0.3.36: AVX2; no GPU offload", rebuild="yes")
    assert "--force-reinstall" in args and "--no-binary" in args
    # a build that still has AMX after building (flags that did not apply) is an error, not a success
    args, p = _install_llama(tmp_path / "d", "", builds="llama-cpp-python 0.3.36: AVX2 AMX_INT8; no GPU offload")
    assert p.returncode == 1 and "does not have the flags asked for" in p.stdout


def test_install_sh_cpu_flags_name_each_instruction_set():
    p = _bash("cpu_cmake_args")
    if not _x86():  # elsewhere llama.cpp's own defaults (no x86 flags to name)
        assert p.returncode == 0 and p.stdout.strip() == ""
        return
    flags = dict(a.removeprefix("-D").split("=") for a in p.stdout.split())
    assert flags["GGML_NATIVE"] == "OFF" and flags["GGML_AMX_INT8"] == "OFF" and flags["GGML_AMX_TILE"] == "OFF"
    cpu = open("/proc/cpuinfo").read().split()
    assert flags["GGML_AVX2"] == ("ON" if "avx2" in cpu else "OFF")
    assert flags["GGML_AVX512"] == ("ON" if "avx512f" in cpu else "OFF")


def test_install_sh_does_not_run_apt_without_asking():
    p = _bash("APT=ask; apt_allowed pkgs || echo refused")
    assert "refused" in p.stdout and "pass --with-qemu" in p.stdout
    p = _bash("APT=no; apt_allowed pkgs || echo refused")
    assert "refused" in p.stdout
    p = _bash("APT=yes; apt_allowed pkgs && echo allowed")
    assert "allowed" in p.stdout


# -- 8. rough edges ---------------------------------------------------------------------------------------
def test_help_is_not_hard_wrapped_and_shows_no_bool(runner):
    for cmd in ("run", "chat", "quantize", "convert", "eval", "offload", "bench", "cache", "serve"):
        r = runner.invoke(app, [cmd, "--help"], env={"COLUMNS": "200"}, terminal_width=200)
        assert r.exit_code == 0 and "<bool>" not in r.stdout, cmd
    r = runner.invoke(app, ["quantize", "--help"], env={"COLUMNS": "200"}, terminal_width=200)
    assert "then llama.cpp's quantizer makes the K-quants (a float GGUF is accepted too). rtn/awq" in r.stdout


def test_progress_fits_a_narrow_terminal(monkeypatch):
    import io

    from rich.console import Console

    from dsq.ui import progress_bar

    monkeypatch.delenv("DSQ_QUIET")
    monkeypatch.delenv("CI", raising=False)  # CI with stderr not a terminal quiets progress
    buf = io.StringIO()
    con = Console(file=buf, width=50, force_terminal=True, color_system=None)
    with progress_bar(con) as p:
        task = p.add_task("gptq gptq-w4: blocks: model.layers.12.mlp.down_proj", total=28)
        p.update(task, completed=7)
    last = [ANSI.sub("", ln) for ln in re.split(r"[\r\n]", buf.getvalue()) if ANSI.sub("", ln).strip()][-1]
    assert "7/28" in last and len(last) <= 50 and "…" in last


def test_random_gguf_qwen2_shape(runner, tmp_path):
    from dsq.bench import random_gguf

    out = tmp_path / "q2.gguf"
    random_gguf.main([str(out), "--shape", "qwen2-1.5b", "--layers", "1", "--mix", "Q8_0"])
    r = runner.invoke(app, ["run", str(out), "-p", "hi", "-n", "2", "--ignore-eos", "--json"])
    assert r.exit_code == 0, r.output


def test_recipe_without_model_offline_and_uncached(runner, tmp_path, monkeypatch):
    """A recipe given no MODEL fetches the repo it names (tests/test_hub.py); offline, with the
    repo not in the Hugging Face cache, it says so and writes nothing."""
    from huggingface_hub import constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    one_line_error(runner.invoke(app, ["quantize", "--recipe", "r1-distill-qwen-32b"]),
                   "HF_HUB_OFFLINE=1: using the Hugging Face cache only, and it holds no cached copy of "
                   "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", "Unset HF_HUB_OFFLINE")
    assert listing(tmp_path) == []
