"""Bench reports: summary statistics (median, p99), a rich table, JSON, and a plot for sweeps."""

from __future__ import annotations

import json
from pathlib import Path

METRICS = ("prefill_tok_s", "decode_tok_s", "ttft_ms", "tpot_ms")


def _pct(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else 0.0


def summarize(records: list[dict]) -> list[dict]:
    """One row per (backend, gpu_layers): median and p99 of each metric, peak memory."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["backend"], str(r["gpu_layers"]), r.get("batch", 1)), []).append(r)
    rows = []
    for (backend, gl, batch), rs in groups.items():
        row = {"backend": backend, "gpu_layers": gl, "gpu_layers_effective": rs[0]["gpu_layers_effective"],
               "batch": batch, "runs": len(rs), "prompt_tokens": rs[0]["prompt_tokens"],
               "gen_tokens": rs[0]["gen_tokens"]}
        for m in METRICS:
            vals = [r[m] for r in rs]
            row[f"{m}_median"] = round(_pct(vals, 50), 3)
            # p99 of a rate is its slow tail (1st percentile); of a latency, its 99th
            row[f"{m}_p99"] = round(_pct(vals, 1 if m.endswith("tok_s") else 99), 3)
        row["peak_rss_mb"] = max(r["peak_rss_mb"] for r in rs)
        row["peak_vram_mb"] = max(r["peak_vram_mb"] for r in rs)
        rows.append(row)
    return rows


def _fmt(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def table(rows: list[dict], title: str):
    from rich.table import Table

    batched = any(r.get("batch", 1) > 1 for r in rows)
    caption = "median / p99 over the runs (p99: the slow tail)"
    if batched:
        caption += "; with a batch, tok/s count every sequence and TPOT is one step"
    t = Table(title=title, title_justify="left", caption=caption)
    cols = ["backend", "gpu layers"] + (["batch"] if batched else []) + [
        "prefill tok/s", "decode tok/s", "TTFT ms", "TPOT ms", "peak RSS MiB", "peak VRAM MiB"]
    for col in cols:
        t.add_column(col, justify="left" if col == "backend" else "right")
    for r in rows:
        gl = str(r["gpu_layers"])
        if gl != str(r["gpu_layers_effective"]) and r["gpu_layers_effective"] >= 0:
            gl += f" ({r['gpu_layers_effective']})"
        cells = [f"{_fmt(r[m + '_median'])} / {_fmt(r[m + '_p99'])}" for m in METRICS]
        t.add_row(r["backend"], gl, *([str(r.get("batch", 1))] if batched else []), *cells,
                  f"{r['peak_rss_mb']:.0f}", f"{r['peak_vram_mb']:.0f}")
    return t


def write_json(path: Path, report: dict) -> None:
    from dsq.formats.hf import atomic_output_file

    with atomic_output_file(Path(path), force=True) as tmp:
        tmp.write_text(json.dumps(report, indent=2) + "\n")


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Decode and prefill tok/s against --gpu-layers (or against --batch, when only it varies),
    one line per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dsq.formats.hf import atomic_output_file

    by_batch = len({r.get("batch", 1) for r in rows}) > 1 and len({str(r["gpu_layers"]) for r in rows}) == 1
    key, label = ("batch", "--batch") if by_batch else ("gpu_layers", "--gpu-layers")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for metric, ax in zip(("decode_tok_s", "prefill_tok_s"), axes):
        for backend in dict.fromkeys(r["backend"] for r in rows):
            rs = [r for r in rows if r["backend"] == backend]
            xs = [str(r.get(key, 1)) for r in rs]
            ys = [r[f"{metric}_median"] for r in rs]
            ax.plot(xs, ys, marker="o", label=backend)
            for x, y in zip(xs, ys):
                ax.annotate(f"{y:.0f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
        ax.set_xlabel(label)
        ax.set_ylabel(metric.replace("_tok_s", " tok/s"))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    with atomic_output_file(Path(path), force=True) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
