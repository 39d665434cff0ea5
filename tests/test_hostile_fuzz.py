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
