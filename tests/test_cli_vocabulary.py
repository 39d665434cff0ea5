"""One vocabulary across the commands: --json prints JSON, -o/--out writes a file, -n/--max-tokens
is tokens to generate, --ctx the context; old spellings still work with a note; usage errors name
the subcommand's help; GPU-less runs say so; small messages (convert's "wrote", SIGTERM)."""

from __future__ import annotations

import json

import pytest

from dsq.cli import app
from test_cli_errors import one_line_error

BENCH = ["--prompt-tokens", "8", "--repeat", "1"]


def _notes(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("note: ") and " is now " in ln]


# -- --json prints, -o/--out writes, -n generates --------------------------------------------------------
def test_bench_json_is_a_flag_and_out_writes_the_file(runner, tiny_gguf, tmp_path):
    path = str(tiny_gguf("llama", "Q8_0"))
    r = runner.invoke(app, ["bench", path, "--json", "-n", "2", *BENCH])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)  # stdout holds the JSON alone, the table went to stderr
    assert report["settings"]["gen_tokens"] == 2 and [x["gen_tokens"] for x in report["runs"]] == [2]
    assert not _notes(r.stderr)
    out = tmp_path / "b.json"
    r = runner.invoke(app, ["bench", path, "-o", str(out), "--max-tokens", "2", *BENCH])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["settings"]["gen_tokens"] == 2 and f"wrote {out}" in r.stderr
    assert not r.stdout.lstrip().startswith("{")


def test_old_bench_spellings_still_work_with_a_note(runner, tiny_gguf, tmp_path):
    out = tmp_path / "old.json"
    r = runner.invoke(app, ["bench", str(tiny_gguf("llama", "Q8_0")), "--gen-tokens", "2", "--json", str(out), *BENCH])
    assert r.exit_code == 0, r.output
    assert _notes(r.stderr) == ["note: --gen-tokens is now --max-tokens", "note: --json is now --out"]
    assert json.loads(out.read_text())["settings"]["gen_tokens"] == 2


@pytest.mark.parametrize("args, note, flag", [
    (["offload", "--measure", "--gen-tokens", "0"], "--gen-tokens is now --max-tokens", "--max-tokens"),
    (["eval", "--max-tokens", "-1"], "--max-tokens is now --tokens", "--tokens"),
    (["eval", "--ctx", "8"], "--ctx is now --window", "--window"),
])
def test_old_spellings_are_renamed_before_their_values_are_checked(runner, args, note, flag):
    """Each old spelling maps to its new flag (a bad value then names the new one), before any work."""
    r = runner.invoke(app, args)
    assert _notes(r.stderr) == [f"note: {note}"]
    assert r.exit_code == 1 and f"error: invalid value for {flag}:" in r.stderr and "evaluating" not in r.output


def test_eval_bad_counts_fail_before_any_work(runner):
    one_line_error(runner.invoke(app, ["eval", "--tokens", "-1"]), "invalid value for --tokens")
    one_line_error(runner.invoke(app, ["eval", "--window", "600", "--tokens", "100"]), "--tokens >= --window")


def test_usage_errors_name_the_subcommands_help(runner):
    r = runner.invoke(app, ["bench", "--max-tokens"])
    assert r.exit_code == 2 and r.stderr.strip().endswith("See 'dsq bench --help'"), r.stderr
    r = runner.invoke(app, ["offload", "--nope"])
    assert r.exit_code == 2 and "See 'dsq offload --help'" in r.stderr, r.stderr
    r = runner.invoke(app, ["rnu"])
    assert "Did you mean 'run'? See 'dsq --help'" in r.stderr, r.stderr


@pytest.mark.parametrize("cmd", [["run", "-p", "hi"], ["chat"], ["bench"]])
def test_kv_dtype_is_one_option(runner, cmd):
    """--kv-dtype takes the same values everywhere; fp8 (a paged-cache format) is refused in one line
    where it does not apply, before loading."""
    one_line_error(runner.invoke(app, [*cmd, "--kv-dtype", "fp9"]), "invalid value for --kv-dtype", "fp8, bf16")
    one_line_error(runner.invoke(app, [*cmd, "--kv-dtype", "fp8"]), "--kv-dtype fp8 is dsq serve's", "bf16")


def test_serve_takes_the_shared_kv_dtype(runner):
    one_line_error(runner.invoke(app, ["serve", "--kv-dtype", "fp9"]), "invalid value for --kv-dtype")
    r = runner.invoke(app, ["serve", "--help"])
    assert "fp8" in r.stdout


# -- no GPU: said once, and the JSON says where the layers are ------------------------------------------
@pytest.fixture
def no_gpu(monkeypatch):
    import dsq.runtime.placement as placement

    monkeypatch.setattr(placement, "detect_gpu", lambda *a, **k: None)


@pytest.mark.parametrize("layers", ["99", "all"])
def test_gpu_layers_without_a_gpu_says_so(runner, tiny_gguf, no_gpu, layers):
    r = runner.invoke(app, ["run", str(tiny_gguf("llama", "Q8_0")), "-p", "hi", "-n", "2", "-g", layers, "--json"])
    assert r.exit_code == 0, r.output
    assert [ln for ln in r.stderr.splitlines() if "GPU" in ln] == ["note: no GPU: running on the CPU"]
    assert json.loads(r.stdout)["gpu_layers"] == 0
    r = runner.invoke(app, ["run", str(tiny_gguf("llama", "Q8_0")), "-p", "hi", "-n", "2", "--json"])
    assert "GPU" not in r.stderr  # nothing asked of a GPU, nothing to say


def test_bench_gpu_layers_without_a_gpu_runs_and_records_0(runner, tiny_gguf, no_gpu):
    r = runner.invoke(app, ["bench", str(tiny_gguf("llama", "Q8_0")), "-g", "all", "-n", "2", *BENCH, "--json"])
    assert r.exit_code == 0, r.output
    assert "note: no GPU: running on the CPU (--gpu-layers all runs as 0)" in r.stderr
    report = json.loads(r.stdout)
    assert [x["gpu_layers_effective"] for x in report["runs"]] == [0] and report["settings"]["gpu_layers"] == ["0"]


def test_offload_without_a_gpu_plans_for_the_cpu(runner, tiny_gguf, no_gpu):
    r = runner.invoke(app, ["offload", str(tiny_gguf("llama", "Q8_0")), "--json", "--cpu-bw", "20"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["gpu_layers"] == 0 and plan["vram_budget"] == 0
    assert {layer["device"] for layer in plan["layers"]} == {"CPU"}
    assert "no GPU: planning for the CPU" in r.stderr


@pytest.mark.parametrize("backend", ["llama.cpp", "native"])
def test_offload_json_counts_layers_not_past_the_model(runner, tiny_gguf, backend):
    r = runner.invoke(app, ["offload", str(tiny_gguf("llama", "Q8_0")), "-b", backend, "-g", "99", "--vram", "8G",
                            "--json", "--gpu-bw", "1000", "--cpu-bw", "20"])
    plan = json.loads(r.stdout)
    assert plan["gpu_layers"] == plan["n_layer"] == len(plan["layers"])


# -- bench --plot: only where it says something ----------------------------------------------------------
def test_bench_plot_of_one_point_is_not_drawn(runner, tiny_gguf, tmp_path):
    png = tmp_path / "p.png"
    r = runner.invoke(app, ["bench", str(tiny_gguf("llama", "Q8_0")), "-n", "2", *BENCH, "--plot", str(png)])
    assert r.exit_code == 0, r.output
    assert not png.exists()
    assert [ln for ln in r.stderr.splitlines() if "plot" in ln] == [
        f"note: one backend at one configuration: nothing to plot, {png} not written (a --gpu-layers or --batch "
        "sweep, or two backends, make a plot)"]


# -- the model card's evaluation: quick by default, and said -------------------------------------------
def test_quantize_card_evaluation_is_quick_by_default_and_says_so(runner, tiny_dir, tmp_path):
    from dsq.quant.spec import QUICK_EVAL_TOKENS

    out = tmp_path / "q"
    r = runner.invoke(app, ["quantize", str(tiny_dir("llama")), "--method", "rtn", "--out", str(out)])
    assert r.exit_code == 0, r.output
    record = json.loads((out / "dsq_quant.json").read_text())["eval"]
    assert record["evaluation"] == "quick" and 0 < record["tokens"] <= QUICK_EVAL_TOKENS
    card = (out / "README.md").read_text()
    assert f"## Evaluation (quick: {record['tokens']} held-out tokens" in card and "--eval full" in card
    assert f"(quick evaluation, {record['tokens']} tokens)" in r.stderr
    r = runner.invoke(app, ["quantize", str(tiny_dir("llama")), "--method", "rtn", "--eval", "none",
                            "--out", str(tmp_path / "n")])
    assert r.exit_code == 0 and "Evaluation" not in (tmp_path / "n" / "README.md").read_text()
    one_line_error(runner.invoke(app, ["quantize", str(tiny_dir("llama")), "--method", "rtn", "--eval", "fast",
                                       "--out", str(tmp_path / "x")]), "--eval 'fast'", "quick, full, none")
    assert not (tmp_path / "x").exists()


def test_batched_evaluation_scores_as_one_window_at_a_time(tiny_dir):
    from dsq.eval.quality import evaluate

    path = str(tiny_dir("llama"))
    one = evaluate(path, path, ctx=64, max_tokens=256, batch=1)
    both = evaluate(path, path, ctx=64, max_tokens=256, batch=4)
    assert both["windows"] == one["windows"] == 4
    assert both["perplexity"] == pytest.approx(one["perplexity"], rel=1e-4) and both["kld"] < 1e-6


# -- small things ----------------------------------------------------------------------------------------
def test_sigterm_during_quantize_says_what_it_kept(tiny_dir, tmp_path):
    """SIGTERM (a scheduler, `kill`) stops a quantization as Ctrl-C does: one line, its work kept."""
    import os
    import subprocess
    import sys

    out = tmp_path / "s"
    script = f"""
import os, signal, sys
import dsq.cli.quantize as q
from dsq.cli import app
calls = q._Bars.__call__
def term_at_second_block(self, step):
    calls(self, step)
    if step.task.endswith("blocks") and step.done == 1:
        os.kill(os.getpid(), signal.SIGTERM)
q._Bars.__call__ = term_at_second_block
sys.argv = ["dsq", "quantize", {str(tiny_dir("llama"))!r}, "--method", "rtn", "--eval", "none", "--out", {str(out)!r}]
app()
"""
    env = {**os.environ, "DSQ_QUIET": "1"}
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 143, (p.returncode, p.stderr)
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("terminated; kept s.partial") and "run the same command again to resume" in last, p.stderr
    assert "Traceback" not in p.stderr and not out.exists()


def test_quantize_summary_and_card_give_one_size(runner, tiny_dir, tmp_path):
    import re

    out = tmp_path / "q"
    r = runner.invoke(app, ["quantize", str(tiny_dir("llama")), "--method", "rtn", "--eval", "none",
                            "--out", str(out)])
    assert r.exit_code == 0, r.output
    said = re.search(rf"wrote {re.escape(str(out))} \(([\d.]+ MiB),", r.stderr.replace("\n", " ")).group(1)
    assert f"| size | {said} |" in (out / "README.md").read_text()


def test_convert_says_what_it_wrote(runner, tiny_gguf, tmp_path):
    out = tmp_path / "hf"
    r = runner.invoke(app, ["convert", str(tiny_gguf("llama", "Q8_0")), str(out)])
    assert r.exit_code == 0, r.output
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2**20
    assert f"wrote {out} ({size:.1f} MiB)" in r.stderr.replace("\n", "")
    assert r.stdout.strip() == str(out)  # stdout: the path alone, for scripts


def test_greedy_chat_stops_at_the_second_repeat_of_a_line(runner, tiny_gguf, monkeypatch):
    from types import SimpleNamespace

    from dsq.runtime.llama_cpp_backend import LlamaCppModel

    def looping(self, ids, sampling, max_tokens, stats):
        for i, piece in enumerate(["I like ", "cats.\n", "\n"] + ["I like ", "cats.\n"] * 8):
            yield SimpleNamespace(text=piece, token_id=100 + i)

    monkeypatch.setattr(LlamaCppModel, "stream", looping)
    r = runner.invoke(app, ["chat", str(tiny_gguf("qwen2", "F16")), "-t", "0", "-b", "llama.cpp"],
                      input="Hello there\n/exit\n")
    assert r.exit_code == 0, r.output
    assert r.stdout.count("I like cats.") == 3 and "stopped: the reply repeats itself" in r.stderr


# -- the table of shared options -------------------------------------------------------------------------
def test_the_shared_options_table_is_true(runner):
    """docs/cli.md's table: every command it lists for an option takes that option."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    table = text.split("| option | meaning | commands |")[1].split("\n\n")[0]
    helps: dict[str, str] = {}
    checked = 0
    for row in table.splitlines()[2:]:
        option, _, commands = [c.strip() for c in row.strip("|").split(" | ")]
        flags = re.findall(r"--[a-z][a-z-]*", option)
        for cmd in re.findall(r"\b(run|chat|eval|offload|bench|serve|quantize|convert)\b", commands.split("(")[0]):
            if cmd not in helps:
                r = runner.invoke(app, [cmd, "--help"], env={"COLUMNS": "200"})
                helps[cmd] = r.stdout
            for flag in flags:
                assert re.search(rf"{flag}\b", helps[cmd]), (cmd, flag)
                checked += 1
    assert checked > 40
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "docs/cli.md" in readme and "--gen-tokens" not in readme
