"""Mutation tests in CI: a few thousand seeded inputs through every reader, a few dozen through the
CLI (run on both backends, quantize, chat), each ending clean (python -m dsq.fuzz runs the same
for as long as one likes; docs/fuzzing.md)."""

from __future__ import annotations

import pytest

from dsq.fuzz.run import Tally, run_cli, run_in_process
from dsq.fuzz.targets import TARGETS

# inputs per target: about 40 s on two cores in all
BUDGET = {"gguf": 1500, "safetensors": 600, "config": 300, "template": 1500}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def _assert_clean(tally: Tally, found) -> None:
    c = tally.counts
    assert c["crash"] == c["hang"] == c["internal"] == 0, (tally.line(), sorted(p.name for p in found.glob("*")))


@pytest.mark.parametrize("name", sorted(BUDGET))
def test_mutated_inputs_end_clean(name, work, tmp_path):
    target = TARGETS[name](work / "seeds")
    tally = Tally(f"target={name}", tmp_path / "found", work / "seeds")
    run_in_process([target], BUDGET[name], seed=2024, timeout=5.0, tally=tally, work=tmp_path / "scratch",
                   progress=0)
    _assert_clean(tally, tmp_path / "found")
    assert sum(tally.counts[k] for k in ("clean", "crash", "hang", "internal")) == BUDGET[name]


def test_mutated_files_through_the_cli(work, tmp_path):
    tally = Tally("target=cli", tmp_path / "found", work / "seeds")
    run_cli(30, seed=2024, timeout=5.0, tally=tally, work=work, progress=0, fresh=False)
    _assert_clean(tally, tmp_path / "found")


def test_max_time_ends_with_the_summary(work, tmp_path, capsys):
    """--max-time stops starting inputs and still prints the summary (the long runs' time budget)."""
    import re

    from dsq.fuzz.run import main

    TARGETS["config"](work / "seeds")  # the seeds exist before the clock starts
    with pytest.raises(SystemExit) as e:
        main(["--target", "config", "--iterations", "10000000", "--max-time", "2", "--work", str(work),
              "--save", str(tmp_path / "found")])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    n = int(re.search(r"inputs=(\d+) ", last).group(1))
    assert e.value.code == 0 and last.startswith("dsq.fuzz target=config") and 0 < n < 10_000_000, last


class _Timed:
    """A fork server stand-in whose every run took `seconds`."""

    def __init__(self, seconds: float):
        self.seconds, self.limits = seconds, []

    def run(self, argv, work, timeout):
        self.limits.append(timeout)
        return {"code": 0, "signal": None, "timed_out": False, "seconds": self.seconds}


@pytest.mark.parametrize(("seed_run", "limit"), [(0.5, 5.0), (3.0, 12.0)])
def test_the_cli_limit_grows_with_a_slow_start(seed_run, limit, tmp_path):
    """A machine where a valid seed already takes 3 s through `dsq run` gives each input 4 x that."""
    from types import SimpleNamespace

    from dsq.fuzz.run import cli_limit

    target = SimpleNamespace(gguf=SimpleNamespace(seeds=[b"GGUF"]))
    assert cli_limit(target, tmp_path / "run", 5.0, {}, _Timed(seed_run)) == limit


def test_a_fork_server_slow_to_exit_is_ended(tmp_path):
    """Closing the fork server waits for its exit a while, then kills it, instead of raising."""
    import subprocess
    import sys

    from dsq.fuzz.cli_target import Zygote

    z = Zygote.__new__(Zygote)
    z.proc = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.stdin.read(); time.sleep(60)"],
                              stdin=subprocess.PIPE, text=True)
    z.close(grace=0.5)
    assert z.proc.returncode == -9


def test_probe_target_ends_clean(work, tmp_path):
    """A few mutated GGUFs through the child-process check before llama.cpp loads them."""
    target = TARGETS["probe"](work / "seeds")
    tally = Tally("target=probe", tmp_path / "found", work / "seeds")
    run_in_process([target], 4, seed=2024, timeout=60.0, tally=tally, work=tmp_path / "scratch", progress=0)
    _assert_clean(tally, tmp_path / "found")


def test_probe_target_survives_a_file_that_aborts_llama_cpp(work, tmp_path):
    """A vocabulary declared as tokenizer model 'none' aborts llama.cpp (GGML_ASSERT): the probe
    target's child takes the abort and this process goes on, the verdict a refusal."""
    from dsq.errors import BackendError
    from dsq.fuzz import mutate
    from dsq.runtime.llama_probe import check_loads

    target = TARGETS["probe"](work / "seeds")
    bad = mutate.set_string(target.seeds[0], "tokenizer.ggml.model", "none")
    target.run(bad, tmp_path)
    with pytest.raises(BackendError, match="Tokenizer not initialized"):
        check_loads(tmp_path / "input.gguf", {"call": "load", "load": {"n_ctx": 64, "vocab_only": True}})


def test_serve_target_ends_clean_and_a_dead_server_is_a_finding(work, tmp_path):
    """60 mutated requests at `dsq serve` on the tiny seed model: every one clean, /health up and
    every KV block free after. Then the server is killed: the next input is a crash, the server
    is started again, and the input after it is clean."""
    import os
    import signal

    from dsq.fuzz.serve_target import KEY, ServeTarget, request, run_serve

    tally = Tally("target=serve", tmp_path / "found", work / "seeds")
    with ServeTarget(work / "seeds", tmp_path, 5.0) as target:
        run_serve(60, seed=2024, timeout=5.0, tally=tally, work=tmp_path, progress=0, target=target)
        _assert_clean(tally, tmp_path / "found")
        assert sum(tally.counts[k] for k in ("clean", "crash", "hang", "internal")) == 60
        assert 0 < tally.counts["refused"] < 60  # some requests were served, some refused
        body = b'{"prompt": "hi", "max_tokens": 1}'
        ok = request("POST", "/v1/completions", body, [("Host", "x"), ("Authorization", f"Bearer {KEY}"),
                                                       ("Connection", "close"), ("Content-Length", str(len(body)))])
        assert target.one(ok) == ("clean", "200")
        os.killpg(target.server.proc.pid, signal.SIGKILL)
        target.server.proc.wait(30)
        assert target.one(ok)[0] == "crash"
        assert target.server.alive() and target.one(ok) == ("clean", "200")


@pytest.mark.parametrize("reply, alive, outcome", [
    (b"HTTP/1.1 200 OK\r\n\r\n{}", True, "clean"),
    (b"HTTP/1.1 400 Bad Request\r\n\r\n{}", True, "clean"),
    (b"", True, "clean"),  # closed without an answer: a request h11 cannot parse
    (b"HTTP/1.1 500 Internal Server Error\r\n\r\nboom", True, "internal"),
    (b"HTTP/1.1 503 Service Unavailable\r\n\r\n", True, "internal"),
    (None, True, "hang"),
    (b"HTTP/1.1 200 OK\r\n\r\n{}", False, "crash"),
])
def test_serve_target_classifies_answers(reply, alive, outcome):
    from dsq.fuzz.serve_target import classify

    assert classify(reply, alive)[0] == outcome
