"""benchmarks/moe_layers.py and moe_table.py (what benchmarks/h200_moe.sh runs) on a tiny random
DeepSeek GGUF on the CPU and on made-up tool outputs: every part timed, the projection's
arithmetic, the table's ratios."""

from __future__ import annotations

import json

import pytest

from benchmarks import moe_cpu, moe_layers, moe_table


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dsq.bench.random_gguf import write_random_gguf

    return write_random_gguf(tmp_path_factory.mktemp("moe") / "v3.gguf", "tiny-deepseek-v3", "Q4_K_M", seed=2)


def test_layers_times_every_part_and_projects(tiny):
    r = moe_layers.run(tiny, ["cpu", "gpu"], threads=2, steps=3, prompt_tokens=8)
    assert [p["experts"] for p in r["placements"]] == ["cpu", "gpu"]
    for p in r["placements"]:
        assert {"0.attention", "0.mlp", "1.router", "1.experts", "1.shared", "2.layer", "head"} <= set(p["part_ms"])
        assert p["decode_tok_s"] > 0 and p["expert_gb_s"] > 0
    rows = moe_layers.project(r, full_layers=61, full_dense=3, cpu_bws=[100.0], gpu_slowdown=1.0)
    cpu = rows[0]
    t = r["placements"][0]["part_ms"]
    moe_ms = (t["1.layer"] + t["2.layer"]) / 2
    exp_ms = (t["1.experts"] + t["2.experts"]) / 2
    want = 1e3 / (3 * t["0.layer"] + 58 * moe_ms + t["head"])
    assert cpu["projected_tok_s_here"] == pytest.approx(want, rel=1e-2)
    faster = 1e3 / (3 * t["0.layer"] + 58 * (moe_ms - exp_ms) + t["head"]
                    + 58 * exp_ms * r["placements"][0]["expert_gb_s"] / 100.0)
    assert cpu["projected_tok_s_at_cpu_gb_s"][100.0] == pytest.approx(faster, rel=2e-2)


def test_table_ratios_and_rooflines(tmp_path):
    (tmp_path / "llama_gpu.json").write_text(json.dumps([{"n_prompt": 64, "n_gen": 0, "avg_ts": 4000.0},
                                                         {"n_prompt": 0, "n_gen": 32, "avg_ts": 200.0}]))
    (tmp_path / "dsq_gpu.json").write_text(json.dumps({"summary": [{"prefill_tok_s_median": 2000.0,
                                                                    "decode_tok_s_median": 300.0}]}))
    (tmp_path / "plan_gpu.json").write_text(json.dumps({"roofline_tok_s": 600.0, "predicted_tok_s": 250.0}))
    rows = moe_table.rows(tmp_path)
    gpu, cpu = rows
    assert gpu["decode_ratio"] == pytest.approx(1.5) and gpu["prefill_ratio"] == pytest.approx(0.5)
    assert gpu["decode_of_roofline"] == pytest.approx(0.5)
    assert cpu["llama_decode"] is None and cpu["decode_ratio"] is None  # missing files: empty cells
    md = moe_table.markdown(rows).splitlines()
    assert len(md) == 4 and "1.50x" in md[2] and md[3].count("| - ") >= 6


def test_cpu_call_against_per_expert_calls():
    """moe_cpu checks the one call against the per-expert calls on every run (it raises if they
    differ) and reports both times and the bytes the call read."""
    rows = moe_cpu.run("tiny-deepseek-v3", [1, 3], threads=1, n_expert=None, repeat=1)
    assert [r["rows"] for r in rows] == [1, 3]
    for r in rows:
        assert r["one_call_ms"] > 0 and r["per_expert_ms"] > 0 and r["one_call_gb_s"] > 0
        assert r["ratio"] == pytest.approx(r["per_expert_ms"] / r["one_call_ms"], rel=0.02)
