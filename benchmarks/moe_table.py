"""The MoE side-by-side of benchmarks/h200_moe.sh as one table: llama-bench and dsq bench on the
same GGUF, all on the GPU and with the routed experts in RAM, with dsq/llama.cpp ratios and the
offload plan's roofline and prediction for each placement.

    python -m benchmarks.moe_table DIR

DIR holds llama_{gpu,cpu}.json (llama-bench -o json), dsq_{gpu,cpu}.json (dsq bench --json) and
plan_{gpu,cpu}.json (dsq offload -b native --experts ... --json); a missing file leaves its cells
empty.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def llama_rates(runs) -> tuple[float | None, float | None]:
    """(prefill, decode) tok/s of llama-bench's JSON records (-p N -n M: one record each)."""
    pp = tg = None
    for r in runs or []:
        if r.get("n_gen", 0) == 0 and r.get("n_prompt", 0) > 0:
            pp = float(r["avg_ts"])
        elif r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0:
            tg = float(r["avg_ts"])
    return pp, tg


def dsq_rates(report) -> tuple[float | None, float | None]:
    """(prefill, decode) median tok/s of dsq bench's JSON (its first summary row)."""
    if not report or not report.get("summary"):
        return None, None
    row = report["summary"][0]
    return row.get("prefill_tok_s_median"), row.get("decode_tok_s_median")


def rows(d: Path) -> list[dict]:
    out = []
    for kind, label in (("gpu", "all on the GPU"), ("cpu", "experts in RAM")):
        lp, lt = llama_rates(_load(d / f"llama_{kind}.json"))
        dp, dt = dsq_rates(_load(d / f"dsq_{kind}.json"))
        plan = _load(d / f"plan_{kind}.json") or {}
        out.append({"placement": label, "llama_prefill": lp, "llama_decode": lt, "dsq_prefill": dp, "dsq_decode": dt,
                    "prefill_ratio": dp / lp if dp and lp else None, "decode_ratio": dt / lt if dt and lt else None,
                    "roofline": plan.get("roofline_tok_s"), "predicted": plan.get("predicted_tok_s"),
                    "decode_of_roofline": dt / plan["roofline_tok_s"] if dt and plan.get("roofline_tok_s") else None})
    return out


def _cell(x, ratio: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}x" if ratio else f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def markdown(table: list[dict]) -> str:
    head = ("| placement | llama.cpp prefill | dsq prefill | ratio | llama.cpp decode | dsq decode | ratio | "
            "roofline | plan's prediction | dsq / roofline |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in table:
        lines.append(f"| {r['placement']} | {_cell(r['llama_prefill'])} | {_cell(r['dsq_prefill'])} | "
                     f"{_cell(r['prefill_ratio'], True)} | {_cell(r['llama_decode'])} | {_cell(r['dsq_decode'])} | "
                     f"{_cell(r['decode_ratio'], True)} | {_cell(r['roofline'])} | {_cell(r['predicted'])} | "
                     f"{_cell(r['decode_of_roofline'], True)} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", type=Path)
    a = ap.parse_args(argv)
    t = rows(a.dir)
    print("tok/s (decode: batch 1; roofline: the plan's bytes per token at the machine's bandwidths)")
    print(markdown(t))
    (a.dir / "moe_table.json").write_text(json.dumps(t, indent=2))


if __name__ == "__main__":
    main()
