"""benchmarks/device_tables.py: the device plan's tables from its raw records, each ratio beside its goal."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks import device_tables as dt

ROOT = Path(__file__).resolve().parents[1]


def _llama(path: Path, rates: dict[int, tuple[float, float]], prompt: int = 512) -> None:
    rows = []
    for ngl, (pre, dec) in rates.items():
        rows.append({"n_gpu_layers": ngl, "n_prompt": prompt, "n_gen": 0, "avg_ts": pre})
        if dec:
            rows.append({"n_gpu_layers": ngl, "n_prompt": 0, "n_gen": 32, "avg_ts": dec})
    path.write_text(json.dumps(rows))


def _dsq(path: Path, rows: dict[str, dict]) -> None:
    path.write_text(json.dumps({"summary": [{"gpu_layers": g, **r} for g, r in rows.items()]}))


def test_race_rows_ratios_and_goals(tmp_path):
    _llama(tmp_path / "llama_qwen2-7b.json", {99: (9000.0, 250.0), 8: (1400.0, 34.0), 0: (1100.0, 24.0)})
    _llama(tmp_path / "llama_qwen2-7b_p2048.json", {99: (8000.0, 0.0)}, prompt=2048)
    _dsq(tmp_path / "dsq_qwen2-7b.json", {
        "all": {"decode_tok_s_median": 350.0, "prefill_tok_s_median": 13500.0, "peak_vram_mb": 5000.0, "head": "gpu",
                "decode_roofline_tok_s": 700.0},
        "8": {"decode_tok_s_median": 40.0, "prefill_tok_s_median": 1500.0, "peak_vram_mb": 1600.0, "head": "0.1"}})
    _dsq(tmp_path / "dsq_qwen2-7b_p2048.json", {"all": {"prefill_tok_s_median": 12800.0}})
    _dsq(tmp_path / "llama_vram_qwen2-7b.json", {"all": {"peak_vram_mb": 5200.0}, "8": {"peak_vram_mb": 1400.0}})
    rows = dt.race_rows(tmp_path, "qwen2-7b")
    by = {(r["gpu_layers"], r["prompt"]): r for r in rows}
    assert by[("all", 512)]["decode_ratio"] == pytest.approx(1.4) and by[("all", 512)]["prefill_ratio"] == 1.5
    assert by[("8", 512)]["vram_ratio"] == pytest.approx(1600 / 1400, abs=1e-3)
    assert by[("all", 2048)]["prefill_ratio"] == 1.6
    assert ("24", 512) not in by and ("16", 512) not in by  # splits neither engine ran: no row
    assert by[("0", 512)]["llama_decode"] == 24.0 and by[("0", 512)]["dsq_decode"] is None  # one engine ran: a row
    md = dt.race_markdown(rows, "H200").splitlines()
    all_row = next(ln for ln in md if ln.startswith("| qwen2-7b | all |"))
    assert "**1.40x**" in all_row and "**1.50x**" in all_row and "50% of 700.0" in all_row  # goals met: bold
    eight = next(ln for ln in md if ln.startswith("| qwen2-7b | 8 |"))
    assert "1.18x (goal 1.3x)" in eight and "1.14 (goal 1.1)" in eight and "**1.07x**" in eight  # split prefill goal 1.0
    assert any("pp2048" in ln and "**1.60x**" in ln for ln in md)


def test_race_rows_from_rounds_take_the_rounds_ratios(tmp_path):
    """With the engines run in rounds (ab_TAG.json from benchmarks/split_ab), a split's ratio is the median
    of the rounds' ratios, not the ratio of the medians, and the table shows their range."""
    runs = {"dsq": [[300.0, 30.0], [330.0, 26.0], [310.0, 33.0]], "llama-bench": [[100.0, 20.0], [100.0, 24.0], [100.0, 22.0]]}
    ratios = sorted(d / ll for (_, d), (_, ll) in zip(runs["dsq"], runs["llama-bench"]))
    row = {"split": "8", "head": "gpu", "runs": runs, "roofline_tok_s": 40.0, "dsq_vram_mib": 1500,
           "decode": {"dsq": 30.0, "llama-bench": 22.0, "ratio": [ratios[1], ratios[0], ratios[2]]},
           "prefill": {"dsq": 310.0, "llama-bench": 100.0, "ratio": [3.1, 3.0, 3.3]}}
    (tmp_path / "ab_llama3-8b.json").write_text(json.dumps({"results": [row]}))
    _dsq(tmp_path / "llama_vram_llama3-8b.json", {"8": {"peak_vram_mb": 1400.0}})
    r = next(r for r in dt.race_rows(tmp_path, "llama3-8b") if r["gpu_layers"] == "8")
    assert r["decode_ratio"] == pytest.approx(ratios[1], abs=1e-3) != pytest.approx(30.0 / 22.0, abs=1e-3)
    assert r["rounds"] == 3 and r["dsq_decode"] == 30.0 and r["llama_decode"] == 22.0 and r["dsq_head"] == "gpu"
    assert r["vram_ratio"] == pytest.approx(1500 / 1400, abs=1e-3) and r["prefill_ratio"] == 3.1
    line = next(ln for ln in dt.race_markdown([r], "H100").splitlines() if ln.startswith("| llama3-8b | 8 |"))
    assert f"({ratios[0]:.2f}-{ratios[2]:.2f}, 3 rounds)" in line and "75% of 40.0" in line
    assert "**3.10x** (3.00-3.30, 3 rounds)" in line


def test_test_rows_from_junit(tmp_path):
    (tmp_path / "tests.xml").write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.test_native_cuda" name="a"/>'
        '<testcase classname="tests.test_native_cuda" name="b"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_serve" name="c"><skipped/></testcase>'
        '</testsuite></testsuites>')
    rows = dt.test_rows(tmp_path / "tests.xml")
    assert rows == [{"file": "test_native_cuda.py", "passed": 1, "failed": 1, "skipped": 0, "failures": ["b"]},
                    {"file": "test_serve.py", "passed": 0, "failed": 0, "skipped": 1, "failures": []}]
    assert "| all | 1 | 1 | 1 | |" in dt.tests_markdown(rows, "H200")


def test_moe_rows_and_serve(tmp_path):
    _llama(tmp_path / "llama_v2l_gpu.json", {99: (5000.0, 200.0)})
    _dsq(tmp_path / "dsq_v2l_gpu.json", {"all": {"decode_tok_s_median": 400.0, "prefill_tok_s_median": 4000.0}})
    for eng, tput in (("dsq", 900.0), ("llama-server", 600.0)):
        (tmp_path / f"serve_{eng}.json").write_text(json.dumps(
            {"levels": [{"concurrency": 8, "output_tok_s": 1.0}, {"concurrency": 32, "output_tok_s": tput, "failures": 0}]}))
    rows = dt.moe_rows(tmp_path)
    assert rows[0]["decode_ratio"] == 2.0 and rows[0]["prefill_ratio"] == 0.8
    assert rows[1]["dsq_decode"] is None  # experts in RAM: not run here
    assert rows[2]["throughput_ratio"] == 1.5
    assert rows[3]["lines"] == [] and "moe_prefill" not in dt.moe_markdown(rows, "H200")  # not run here
    assert "ratio 1.50" in dt.moe_markdown(rows, "H200")
    line = "512 tokens: grouped 2.00 ms, loop 60.00 ms (30.0x), pairs 9.00 ms (4.5x); largest difference ..."
    (tmp_path / "moe_prefill.txt").write_text("warning: something\n" + line + "\n")
    rows = dt.moe_rows(tmp_path)
    assert rows[3]["lines"] == [line] and f"- {line}" in dt.moe_markdown(rows, "H200")


def test_multi_rows_two_gpus(tmp_path):
    _llama(tmp_path / "llama_layers2_llama3-8b.json", {99: (8000.0, 200.0)})
    _dsq(tmp_path / "dsq_layers2_llama3-8b.json", {"all": {"decode_tok_s_median": 260.0, "prefill_tok_s_median": 16000.0}})
    for eng, tput in (("dsq-tp2", 1200.0), ("dsq-1gpu", 800.0), ("llama-server-row", 400.0)):
        (tmp_path / f"serve_{eng}.json").write_text(json.dumps({"levels": [{"concurrency": 32, "output_tok_s": tput}]}))
    rows = dt.multi_rows(tmp_path)
    assert rows[0]["decode_ratio"] == 1.3 and rows[0]["prefill_ratio"] == 2.0
    assert rows[1]["dsq_decode"] is None  # V2-Lite: not run here
    assert rows[2]["tp2_over_one_gpu"] == 1.5 and rows[2]["tp2_over_llama_row"] == 3.0
    md = dt.multi_markdown(rows, "2x H100")
    assert "| llama3-8b, layers over two GPUs | 200.0 | 260.0 | **1.30x** |" in md and "over llama-server -sm row 3.00" in md


def test_the_device_plan_parses():
    r = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "device_plan.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
