from __future__ import annotations

import pytest

from dsq.bench.report import summarize


def test_summary_median_and_tail():
    recs = [dict(backend="llama.cpp", gpu_layers="0", gpu_layers_effective=0, prompt_tokens=8, gen_tokens=4,
                 prefill_tok_s=p, decode_tok_s=d, ttft_ms=t, tpot_ms=1000 / d, peak_rss_mb=r, peak_vram_mb=0.0)
            for p, d, t, r in [(100, 10, 80, 5), (200, 20, 40, 7), (300, 30, 27, 6)]]
    (row,) = summarize(recs)
    assert row["decode_tok_s_median"] == 20 and row["prefill_tok_s_median"] == 200
    assert row["decode_tok_s_worst"] == 10 and row["ttft_ms_worst"] == 80  # the slow tail: low rate, high latency
    assert row["decode_tok_s_p99"] is None and row["ttft_ms_p99"] is None  # 3 runs make no p99
    assert row["peak_rss_mb"] == 7 and row["runs"] == 3 and row["peak_vram_mb"] == 0.0
    many = [dict(recs[0], decode_tok_s=float(d), ttft_ms=float(d)) for d in range(1, 101)]
    (row,) = summarize(many)
    assert row["decode_tok_s_p99"] == pytest.approx(1.99)  # slow tail of a rate: its 1st percentile
    assert row["ttft_ms_p99"] == pytest.approx(99.01)  # of a latency: its 99th


def _row(backend, gl, decode, prefill=100.0):
    return {"backend": backend, "gpu_layers": gl, "gpu_layers_effective": -1 if gl == "all" else int(gl), "batch": 1,
            "decode_tok_s_median": decode, "prefill_tok_s_median": prefill}


def test_rows_grouped_by_split_with_ratios():
    from dsq.bench.report import by_split, ratios

    rows = [_row("native", "0", 20), _row("native", "all", 300), _row("llama.cpp", "0", 10, 50),
            _row("llama.cpp", "all", 250)]
    assert [(r["backend"], r["gpu_layers"]) for r in by_split(rows)] == [
        ("native", "0"), ("llama.cpp", "0"), ("native", "all"), ("llama.cpp", "all")]
    assert ratios(rows, "native", "llama.cpp") == [
        {"gpu_layers": "0", "batch": 1, "decode": 2.0, "prefill": 2.0},
        {"gpu_layers": "all", "batch": 1, "decode": 1.2, "prefill": 1.0}]


def test_plot_draws_the_prediction_dashed(tmp_path, monkeypatch):
    """One dashed line per backend at the splits it ran, in the colour of its measured line."""
    import matplotlib.pyplot as plt

    from dsq.bench.report import plot

    rows = [{**r, "prefill_tok_s_median": 1.0} for r in
            [_row("native", "0", 20), _row("native", "8", 30), _row("llama.cpp", "0", 10), _row("llama.cpp", "8", 15)]]
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    predicted = {("native", "0"): 22.0, ("native", "8"): 33.0, ("llama.cpp", "0"): 11.0, ("llama.cpp", "8"): 14.0}
    plot(rows, tmp_path / "p.png", "t", predicted)
    decode = figs[0].axes[0]
    dashed = [ln for ln in decode.get_lines() if ln.get_linestyle() == "--"]
    assert [list(ln.get_ydata()) for ln in dashed] == [[22.0, 33.0], [11.0, 14.0]]
    solid = [ln for ln in decode.get_lines() if ln.get_linestyle() == "-"]
    assert [ln.get_color() for ln in solid] == [ln.get_color() for ln in dashed]
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_draws_only_what_says_something():
    """One backend at one configuration: no figure. Two backends at one: bars, named on the axis,
    no legend. A sweep: every legend entry is something drawn (a lone predicted point is marked)."""
    import matplotlib.pyplot as plt

    from dsq.bench.report import figure

    assert figure([_row("native", "0", 20)], "t") is None
    fig = figure([_row("native", "0", 20), _row("llama.cpp", "0", 10)], "t")
    decode = fig.axes[0]
    assert [p.get_height() for p in decode.patches] == [20, 10] and decode.get_legend() is None
    assert [t.get_text() for t in decode.get_xticklabels()] == ["native", "llama.cpp"]
    assert "decode and prefill tok/s by backend at --gpu-layers 0" in fig._suptitle.get_text()
    plt.close(fig)
    fig = figure([_row("native", "0", 20), _row("native", "8", 30)], "t", {("native", "8"): 33.0})
    decode = fig.axes[0]
    drawn = {ln.get_label(): ln for ln in decode.get_lines()}
    labels = [t.get_text() for t in decode.get_legend().get_texts()]
    assert labels == ["native measured", "native predicted"]
    for label in labels:
        ln = drawn[label]
        assert len(ln.get_xdata()) > 1 or ln.get_marker() not in (None, "None", "", " "), label
    assert "against --gpu-layers" in fig._suptitle.get_text()
    plt.close(fig)
