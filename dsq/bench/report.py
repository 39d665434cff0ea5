"""Bench reports: summary statistics (median, and the slow tail: p99 from 100 runs, the worst run
below that), a rich table, JSON, and a plot for sweeps."""

from __future__ import annotations

import json
from pathlib import Path

METRICS = ("prefill_tok_s", "decode_tok_s", "ttft_ms", "tpot_ms")
P99_RUNS = 100  # runs a p99 needs before it is more than the worst run


def _pct(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else 0.0


def summarize(records: list[dict]) -> list[dict]:
    """One row per (backend, gpu_layers, batch): of each metric the median, the worst run and,
    from P99_RUNS runs, the p99 (None below that); peak memory (VRAM None without a GPU)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["backend"], str(r["gpu_layers"]), r.get("batch", 1)), []).append(r)
    rows = []
    for (backend, gl, batch), rs in groups.items():
        row = {"backend": backend, "gpu_layers": gl, "gpu_layers_effective": rs[0]["gpu_layers_effective"],
               "batch": batch, "runs": len(rs), "prompt_tokens": rs[0]["prompt_tokens"],
               "gen_tokens": rs[0]["gen_tokens"]}
        for m in METRICS:
            row.update(_stats(m, [r[m] for r in rs]))
        row["peak_rss_mb"] = max(r["peak_rss_mb"] for r in rs)
        row["base_rss_mb"] = max(r.get("base_rss_mb", 0.0) for r in rs)
        vram = [r["peak_vram_mb"] for r in rs if r.get("peak_vram_mb") is not None]
        row["peak_vram_mb"] = max(vram) if vram else None
        row["head"] = rs[0].get("head", "gpu")
        row["experts"] = rs[0].get("experts", "gpu")
        each = [r["peak_vram_mb_per_gpu"] for r in rs if r.get("peak_vram_mb_per_gpu")]
        row["peak_vram_mb_per_gpu"] = [max(g) for g in zip(*each)] if each else None
        row["tensor_split"] = rs[0].get("tensor_split")
        rows.append(row)
    return rows


def _stats(metric: str, vals: list[float]) -> dict:
    """Median, worst and p99 of one metric: the slow tail of a rate is its low end, of a latency its high end."""
    rate = metric.endswith("tok_s")
    p99 = round(_pct(vals, 1 if rate else 99), 3) if len(vals) >= P99_RUNS else None
    return {f"{metric}_median": round(_pct(vals, 50), 3), f"{metric}_worst": (min if rate else max)(vals),
            f"{metric}_p99": p99}


def tail_name(rows: list[dict]) -> str:
    """What the table's second figure is: p99 where every row has it, else the worst run."""
    return "p99" if rows and all(r.get("runs", 0) >= P99_RUNS for r in rows) else "worst"


def _fmt(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def by_split(rows: list[dict]) -> list[dict]:
    """The rows grouped by split (and batch), each group's backends in the order they ran."""
    keys = list(dict.fromkeys(_split_key(r) for r in rows))
    return sorted(rows, key=lambda r: keys.index(_split_key(r)))


def _split_key(row: dict) -> tuple[str, int]:
    return str(row["gpu_layers"]), row.get("batch", 1)


def ratios(rows: list[dict], first: str, second: str) -> list[dict]:
    """first / second median tok/s (decode, prefill) at each split and batch both backends ran."""
    other = {_split_key(r): r for r in rows if r["backend"] == second}
    out = []
    for r in rows:
        o = other.get(_split_key(r))
        if r["backend"] == first and o is not None:
            out.append({"gpu_layers": str(r["gpu_layers"]), "batch": r.get("batch", 1),
                        "decode": _ratio(r, o, "decode_tok_s"), "prefill": _ratio(r, o, "prefill_tok_s")})
    return out


def _ratio(a: dict, b: dict, metric: str) -> float | None:
    den = b[f"{metric}_median"]
    return round(a[f"{metric}_median"] / den, 3) if den else None


def vram_cell(mib: float | None) -> str:
    return "n/a" if mib is None else f"{mib:.0f}"


def vram_caption(context_bytes: int | None) -> str:
    """What the peak VRAM column counts (bench.metrics.cuda_context_bytes: the CUDA context is made
    before the first configuration, so it is in no row)."""
    if context_bytes is None:
        return "peak VRAM: GPU memory in use above what the process held before the configuration (n/a: no GPU)"
    held = f" ({context_bytes / 2**20:.0f} MiB)" if context_bytes else ""
    return (f"peak VRAM: above the CUDA context{held}, made before the first configuration; one-time "
            "library workspaces count where first made")


def table(rows: list[dict], title: str, context_bytes: int | None = None):
    """Median / worst (or p99) per configuration; with two backends, grouped by split with their ratio."""
    from rich.table import Table

    batched = any(r.get("batch", 1) > 1 for r in rows)
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    pair = backends[:2] if len(backends) >= 2 else None
    tail = tail_name(rows)
    caption = ("median / p99 over the runs (p99: the slow tail)" if tail == "p99" else
               f"median / worst of the runs (a p99 needs {P99_RUNS}+ runs)")
    if batched:
        caption += "; with a batch, tok/s count every sequence and TPOT is one step"
    if pair:
        caption += f"; ratio: {pair[0]} / {pair[1]} tok/s at the same split"
    rss = "peak RSS: above the process before loading (Python, libraries, what earlier configurations left)"
    t = Table(title=title, title_justify="left", caption=f"{caption}\n{rss}\n{vram_caption(context_bytes)}")
    cols = ["backend", "gpu layers"] + (["batch"] if batched else []) + [
        "prefill tok/s", "decode tok/s", "TTFT ms", "TPOT ms", "peak RSS MiB", "peak VRAM MiB"]
    cols += ["decode ratio", "prefill ratio"] if pair else []
    roofline = any(r.get("decode_roofline_tok_s") for r in rows)
    cols += ["decode roofline"] if roofline else []
    if roofline:
        t.caption += ("\ndecode roofline: the bytes a token reads on each device over this machine's calibrated "
                      "bandwidths (dsq offload --calibrate), and the median's share of it")
    for col in cols:
        t.add_column(col, justify="left" if col == "backend" else "right")
    ratio_of = {(x["gpu_layers"], x["batch"]): x for x in ratios(rows, *pair)} if pair else {}
    for r in by_split(rows) if pair else rows:
        cells = [f"{_fmt(r[m + '_median'])} / {_fmt(r[f'{m}_{tail}'])}" for m in METRICS]
        t.add_row(r["backend"], _gpu_layers_cell(r), *([str(r.get("batch", 1))] if batched else []), *cells,
                  f"{r['peak_rss_mb']:.0f}", vram_cell(r["peak_vram_mb"]), *_ratio_cells(r, pair, ratio_of),
                  *([_roofline_cell(r)] if roofline else []))
    return t


def _roofline_cell(row: dict) -> str:
    """A row's decode roofline (tok/s) and the median's share of it, where it has one."""
    roof = row.get("decode_roofline_tok_s")
    if not roof:
        return ""
    return f"{_fmt(roof)} ({100 * row['decode_tok_s_median'] / roof:.0f}%)"


def _gpu_layers_cell(row: dict) -> str:
    """--gpu-layers as asked, with what it became where that differs ("auto (24)", "99 (all)")."""
    gl, eff = str(row["gpu_layers"]), row["gpu_layers_effective"]
    shown = "all" if eff < 0 else str(eff)
    return gl if shown == gl else f"{gl} ({shown})"


def _ratio_cells(row: dict, pair: list[str] | None, ratio_of: dict) -> list[str]:
    """The ratio columns of a row: filled on the first backend's row of each split."""
    if pair is None:
        return []
    ratio = ratio_of.get(_split_key(row)) if row["backend"] == pair[0] else None
    if ratio is None:
        return ["", ""]
    return [f"{ratio[k]:.2f}x" if ratio[k] is not None else "" for k in ("decode", "prefill")]


def write_json(path: Path, report: dict) -> None:
    from dsq.formats.hf import atomic_output_file

    with atomic_output_file(Path(path), force=True) as tmp:
        tmp.write_text(json.dumps(report, indent=2) + "\n")


def plot_kind(rows: list[dict]) -> str | None:
    """What a plot of these rows can show: "gpu_layers" or "batch" (tok/s against that sweep, a line
    per backend), "backends" (one configuration, the backends side by side as bars), or None (one
    backend at one configuration: a single point says nothing a table does not)."""
    layers = {str(r["gpu_layers"]) for r in rows}
    if len(layers) > 1:
        return "gpu_layers"
    if len({r.get("batch", 1) for r in rows}) > 1:
        return "batch"
    return "backends" if len({r["backend"] for r in rows}) > 1 else None


def figure(rows: list[dict], title: str, predicted: dict[tuple[str, str], float] | None = None):
    """The matplotlib figure of plot_kind(rows) (None where there is nothing to plot): decode and
    prefill tok/s; `predicted` ((backend, gpu layers) -> decode tok/s, the offload model) drawn
    beside each backend's measured decode in a --gpu-layers sweep. The legend names what is drawn,
    the title what is shown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kind = plot_kind(rows)
    if kind is None:
        return None
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for metric, ax in zip(("decode_tok_s", "prefill_tok_s"), axes):
        name = metric.replace("_tok_s", " tok/s")
        if kind == "backends":
            ys = [next(r for r in rows if r["backend"] == b)[f"{metric}_median"] for b in backends]
            bars = ax.bar(backends, ys, color=[f"C{i}" for i in range(len(backends))])
            ax.bar_label(bars, fmt="%.1f", fontsize=8)
            ax.set_xlabel("backend")
        else:
            for backend in backends:
                rs = [r for r in rows if r["backend"] == backend]
                xs = [str(r.get(kind, 1)) for r in rs]
                ys = [r[f"{metric}_median"] for r in rs]
                (line,) = ax.plot(xs, ys, marker="o", label=f"{backend} measured")
                for x, y in zip(xs, ys):
                    ax.annotate(f"{y:.0f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center",
                                fontsize=8)
                if metric == "decode_tok_s" and predicted and kind == "gpu_layers":
                    _plot_predicted(ax, backend, xs, predicted, line.get_color())
            ax.set_xlabel(f"--{kind.replace('_', '-')}")
            ax.legend()
        ax.set_ylabel(name)
        ax.set_title(name)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    shown = ("by backend at --gpu-layers " + next(iter({str(r['gpu_layers']) for r in rows})) if kind == "backends"
             else f"against --{kind.replace('_', '-')}")
    fig.suptitle(f"{title}\ndecode and prefill tok/s {shown}")
    fig.tight_layout()
    return fig


def plot(rows: list[dict], path: Path, title: str, predicted: dict[tuple[str, str], float] | None = None) -> bool:
    """figure() written to `path` as a PNG; False (nothing written) where there is nothing to plot."""
    import matplotlib.pyplot as plt

    from dsq.formats.hf import atomic_output_file

    fig = figure(rows, title, predicted)
    if fig is None:
        return False
    with atomic_output_file(Path(path), force=True) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return True


def _plot_predicted(ax, backend: str, xs: list[str], predicted: dict[tuple[str, str], float], color) -> None:
    """The offload model's decode tok/s at the measured splits, dashed, each point marked (one alone shows too)."""
    pts = [(x, predicted[(backend, x)]) for x in xs if (backend, x) in predicted]
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle="--", marker="x", color=color, alpha=0.7,
                label=f"{backend} predicted")
