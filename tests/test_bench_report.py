from __future__ import annotations

import pytest

from dsq.bench.report import summarize


def test_summary_median_and_tail():
    recs = [dict(backend="llama.cpp", gpu_layers="0", gpu_layers_effective=0, prompt_tokens=8, gen_tokens=4,
                 prefill_tok_s=p, decode_tok_s=d, ttft_ms=t, tpot_ms=1000 / d, peak_rss_mb=r, peak_vram_mb=0.0)
            for p, d, t, r in [(100, 10, 80, 5), (200, 20, 40, 7), (300, 30, 27, 6)]]
    (row,) = summarize(recs)
    assert row["decode_tok_s_median"] == 20 and row["prefill_tok_s_median"] == 200
    assert row["decode_tok_s_p99"] == pytest.approx(10.2)  # slow tail of a rate: its 1st percentile
    assert row["ttft_ms_p99"] == pytest.approx(79.2)  # slow tail of a latency: its 99th percentile
    assert row["peak_rss_mb"] == 7 and row["runs"] == 3
