"""Every input the fuzzer (python -m dsq.fuzz) ever found, kept in tests/regressions/ and replayed:
in-process findings through their reader, CLI findings through `python -m dsq` in a child process.
Each must now end clean: loaded, or refused with exit 1 and one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsq.errors import DsqError
from dsq.fuzz import regression
from dsq.fuzz.targets import TARGETS
from hostile import dsq

REGRESSIONS = sorted((Path(__file__).parent / "regressions").glob("*.json"))


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> dict[str, bytes]:
    return regression.seed_files(tmp_path_factory.mktemp("seeds"))


def test_there_are_regressions():
    assert REGRESSIONS


@pytest.mark.parametrize("path", REGRESSIONS, ids=lambda p: p.stem)
def test_replay(path, seeds, tmp_path):
    try:
        note, files = regression.load(path, seeds)
    except LookupError as e:
        pytest.fail(f"{path.name}: {e} (dsq.fuzz.seeds changed: rerun the fuzzer to regenerate it)")
    if note["target"] == "serve":  # a request at `dsq serve` (dsq.fuzz.serve_target)
        from dsq.fuzz.serve_target import ServeTarget

        (data,) = files.values()
        with ServeTarget(tmp_path / "seeds", tmp_path, 5.0) as target:
            assert target.one(data)[0] == "clean" and target.check()[0] == "clean"
        return
    if note["target"] in TARGETS:
        target = TARGETS[note["target"]](tmp_path / "seeds")
        (data,) = files.values()
        try:
            target.run(data, tmp_path)
        except DsqError:
            pass
        return
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    (tmp_path / "model").mkdir(exist_ok=True)
    stdin = note.get("stdin") or ("hi\n/exit\n" if note["command"][0] == "chat" else "")
    p = dsq(note["command"], tmp_path, stdin=stdin, timeout=60)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode in (0, 1), (p.returncode, p.stderr[-2000:])
    assert not [ln for ln in lines if "internal error" in ln or "Traceback" in ln], p.stderr[-2000:]
    if p.returncode == 1:
        assert len([ln for ln in lines if ln.startswith("error: ")]) == 1, p.stderr[-2000:]
