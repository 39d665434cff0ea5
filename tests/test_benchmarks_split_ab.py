"""benchmarks/split_ab.py (engines in turn, round after round) on a tiny GGUF on the CPU, against a
stand-in llama-bench that reports fixed rates and logs its arguments: every round times both, with
llama-bench's placement and settings, and the ratios are dsq's measured rates over the stand-in's."""

from __future__ import annotations

import json
import stat
import sys

import pytest

from benchmarks import split_ab


def test_every_round_times_both_and_the_ratios_divide_the_runs(tiny_gguf, tmp_path, capsys):
    log = tmp_path / "calls.txt"
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nopen({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
                    "print(json.dumps([{'n_prompt': 16, 'n_gen': 0, 'avg_ts': 50.0},"
                    " {'n_prompt': 0, 'n_gen': 8, 'avg_ts': 5.0}]))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "ab.json"
    split_ab.main([str(tiny_gguf("llama", "Q8_0")), "--llama-bench", str(fake), "--splits", "0", "--rounds", "3",
                   "--threads", "2", "--prompt-tokens", "16", "--gen-tokens", "8", "--llama-args", "-ot exps=CPU",
                   "--json", str(out)])
    calls = log.read_text().splitlines()
    assert len(calls) == 3 and all("-ngl 0" in c and "-t 2" in c and "-p 16 -n 8 -r 1" in c and
                                   c.endswith("-ot exps=CPU") and "-fa" not in c for c in calls)
    row = json.loads(out.read_text())["results"][0]
    dsq = row["runs"]["dsq"]
    assert len(dsq) == 3 and all(p > 0 and d > 0 for p, d in dsq)
    ratios = sorted(d / 5.0 for _, d in dsq)
    assert row["decode"]["ratio"] == pytest.approx([ratios[1], ratios[0], ratios[2]])
    assert row["prefill"]["llama-bench"] == 50.0
    printed = capsys.readouterr().out
    assert "round 3/3" in printed and "| 0 | cpu | 5.00 |" in printed  # the head as placed: in RAM here
    assert row["head"] == "cpu" and row["dsq_vram_mib"] is None  # (no GPU here)


def test_one_head_per_split_or_one_for_all(tiny_gguf, tmp_path):
    with pytest.raises(SystemExit):
        split_ab.main([str(tiny_gguf("llama", "Q8_0")), "--llama-bench", "x", "--splits", "0,1", "--head", "cpu,0.5,0.2"])
