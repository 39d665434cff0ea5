"""One JSON and one markdown table per part of benchmarks/device_plan.sh, from the raw records it
leaves (pytest's junit XML, llama-bench's and dsq bench's JSON), with each ratio beside its goal
(docs/benchmarks.md#the-gpu-claims-in-three-device-calls).

    python -m benchmarks.device_tables tests RAW --out OUT/part1
    python -m benchmarks.device_tables race RAW --out OUT/part2
    python -m benchmarks.device_tables moe RAW --out OUT/part3

Goals (issue: the GPU claims): decode >= 1.3x llama-bench at every split, prefill >= 1.5x with
every layer on the GPU and >= 1.0x at a split, dsq's peak VRAM <= llama.cpp's + 10%.
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path

DECODE_GOAL, PREFILL_GOAL_ALL, PREFILL_GOAL_SPLIT, VRAM_GOAL = 1.3, 1.5, 1.0, 1.10
SHAPES = (("qwen2-7b", "Qwen2-7B"), ("llama3-8b", "Llama-3-8B"))


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def llama_bench_rates(path: Path) -> dict[tuple[int, str], float]:
    """{(n_gpu_layers, "prefill"|"decode"): tok/s} from llama-bench's `-o json` (its mean of -r runs)."""
    out = {}
    for r in _load(path) or []:
        kind = "prefill" if r.get("n_prompt") and not r.get("n_gen") else "decode" if r.get("n_gen") else None
        if kind:
            out[(int(r["n_gpu_layers"]), kind)] = float(r["avg_ts"])
    return out


def _layers_key(gpu_layers) -> str:
    """--gpu-layers as asked, with "all" as 99 (llama-bench's spelling)."""
    return "99" if str(gpu_layers) == "all" else str(gpu_layers)


def dsq_rows(path: Path) -> dict[str, dict]:
    """dsq bench's summary rows by --gpu-layers (_layers_key)."""
    doc = _load(path) or {}
    return {_layers_key(r["gpu_layers"]): r for r in doc.get("summary", [])}


def _ratio(a, b):
    return round(a / b, 3) if a and b else None


def _mark(ratio, goal) -> str:
    if ratio is None:
        return "-"
    return f"**{ratio:.2f}x**" if ratio >= goal else f"{ratio:.2f}x (goal {goal:g}x)"


def ab_rows(path: Path) -> dict[str, dict]:
    """benchmarks/split_ab's placements by --gpu-layers (_layers_key): the engines in turn, round after
    round, so each ratio is the median of the rounds' ratios, with their range."""
    doc = _load(path) or {}
    return {_layers_key(r["split"]): r for r in doc.get("results", [])}


def race_rows(raw: Path, tag: str) -> list[dict]:
    """Per split: both engines' decode and 512-token prefill, their ratios, dsq's share of its decode
    roofline, both engines' peak VRAM; then the all-GPU 2048-token prefill. Where the part ran the
    engines in rounds (ab_TAG.json, benchmarks/split_ab), a split's rates and ratios are the rounds'."""
    ll, ds = llama_bench_rates(raw / f"llama_{tag}.json"), dsq_rows(raw / f"dsq_{tag}.json")
    vram, ab = dsq_rows(raw / f"llama_vram_{tag}.json"), ab_rows(raw / f"ab_{tag}.json")
    rows = []
    for ngl in (99, 24, 16, 8, 0):
        d, v = ds.get(str(ngl), {}), vram.get(str(ngl), {})
        row = {"shape": tag, "gpu_layers": "all" if ngl == 99 else str(ngl), "prompt": 512,
               "llama_decode": ll.get((ngl, "decode")), "dsq_decode": d.get("decode_tok_s_median"),
               "llama_prefill": ll.get((ngl, "prefill")), "dsq_prefill": d.get("prefill_tok_s_median"),
               "dsq_head": d.get("head"), "dsq_roofline": d.get("decode_roofline_tok_s"),
               "llama_vram_mib": v.get("peak_vram_mb"), "dsq_vram_mib": d.get("peak_vram_mb")}
        row["decode_ratio"] = _ratio(row["dsq_decode"], row["llama_decode"])
        row["prefill_ratio"] = _ratio(row["dsq_prefill"], row["llama_prefill"])
        if str(ngl) in ab:
            r = ab[str(ngl)]
            row.update(rounds=len(r["runs"]["dsq"]), dsq_head=r["head"], dsq_roofline=r["roofline_tok_s"],
                       dsq_vram_mib=r["dsq_vram_mib"])
            for kind in ("decode", "prefill"):
                row[f"llama_{kind}"], row[f"dsq_{kind}"] = r[kind]["llama-bench"], r[kind]["dsq"]
                row[f"{kind}_ratio"] = round(r[kind]["ratio"][0], 3)
                row[f"{kind}_range"] = [round(x, 3) for x in r[kind]["ratio"][1:]]
        row["vram_ratio"] = _ratio(row["dsq_vram_mib"], row["llama_vram_mib"])
        if any(row[k] is not None for k in ("llama_decode", "dsq_decode", "llama_prefill", "dsq_prefill")):
            rows.append(row)  # a split this run measured (LAYERS=all measures only all on the GPU)
    ll2, ds2 = llama_bench_rates(raw / f"llama_{tag}_p2048.json"), dsq_rows(raw / f"dsq_{tag}_p2048.json")
    d2 = ds2.get("99", {})
    rows.append({"shape": tag, "gpu_layers": "all", "prompt": 2048, "llama_prefill": ll2.get((99, "prefill")),
                 "dsq_prefill": d2.get("prefill_tok_s_median"),
                 "prefill_ratio": _ratio(d2.get("prefill_tok_s_median"), ll2.get((99, "prefill")))})
    return rows


def _f(x, nd=1) -> str:
    return "-" if x is None else f"{x:,.{nd}f}" if isinstance(x, float) else str(x)


def _span(row: dict, kind: str) -> str:
    """The rounds' range of a ratio, where the engines ran in rounds; "" otherwise."""
    lo_hi = row.get(f"{kind}_range")
    return f" ({lo_hi[0]:.2f}-{lo_hi[1]:.2f}, {row['rounds']} rounds)" if lo_hi else ""


def race_markdown(rows: list[dict], gpu: str) -> str:
    lines = [f"Card: {gpu}", "",
             "| shape | -g | dsq head | llama-bench decode | dsq decode | ratio | dsq % roofline | llama-bench prefill "
             "| dsq prefill | ratio | llama.cpp VRAM MiB | dsq VRAM MiB | VRAM ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["prompt"] != 512:
            continue
        roof = f"{100 * r['dsq_decode'] / r['dsq_roofline']:.0f}% of {r['dsq_roofline']:.1f}" \
            if r.get("dsq_roofline") and r.get("dsq_decode") else "-"
        pre_goal = PREFILL_GOAL_ALL if r["gpu_layers"] == "all" else PREFILL_GOAL_SPLIT
        vr = r.get("vram_ratio")
        lines.append(f"| {r['shape']} | {r['gpu_layers']} | {r.get('dsq_head') or '-'} | {_f(r['llama_decode'])} | "
                     f"{_f(r['dsq_decode'])} | {_mark(r['decode_ratio'], DECODE_GOAL)}{_span(r, 'decode')} | {roof} | "
                     f"{_f(r['llama_prefill'], 0)} | {_f(r['dsq_prefill'], 0)} | "
                     f"{_mark(r['prefill_ratio'], pre_goal)}{_span(r, 'prefill')} | "
                     f"{_f(r['llama_vram_mib'], 0)} | {_f(r['dsq_vram_mib'], 0)} | "
                     f"{'-' if vr is None else (f'**{vr:.2f}**' if vr <= VRAM_GOAL else f'{vr:.2f} (goal {VRAM_GOAL:g})')} |")
    lines += ["", "| shape | all-GPU prefill, 2048-token prompt | llama-bench | dsq | ratio |", "|---|---|---|---|---|"]
    for r in rows:
        if r["prompt"] == 2048:
            lines.append(f"| {r['shape']} | pp2048 | {_f(r['llama_prefill'], 0)} | {_f(r['dsq_prefill'], 0)} | "
                         f"{_mark(r['prefill_ratio'], PREFILL_GOAL_ALL)} |")
    return "\n".join(lines) + "\n"


def test_rows(xml: Path) -> list[dict]:
    """Per test file: passed, failed (errors included), skipped, and the failures' names."""
    files: dict[str, dict] = {}
    root = ET.parse(xml).getroot() if xml.exists() else ET.Element("testsuites")
    for case in root.iter("testcase"):
        name = (case.get("classname") or "?").split(".")[-1] + ".py"
        f = files.setdefault(name, {"file": name, "passed": 0, "failed": 0, "skipped": 0, "failures": []})
        if case.find("failure") is not None or case.find("error") is not None:
            f["failed"] += 1
            f["failures"].append(case.get("name"))
        elif case.find("skipped") is not None:
            f["skipped"] += 1
        else:
            f["passed"] += 1
    return sorted(files.values(), key=lambda f: f["file"])


def tests_markdown(rows: list[dict], gpu: str) -> str:
    lines = [f"Card: {gpu}", "", "| test file | passed | failed | skipped | failures |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['file']} | {r['passed']} | {r['failed']} | {r['skipped']} | {', '.join(r['failures']) or ''} |")
    total = {k: sum(r[k] for r in rows) for k in ("passed", "failed", "skipped")}
    lines.append(f"| all | {total['passed']} | {total['failed']} | {total['skipped']} | |")
    return "\n".join(lines) + "\n"


def moe_rows(raw: Path) -> list[dict]:
    """V2-Lite with its routed experts on the GPU and in RAM (llama-bench -ot exps=CPU), then dsq serve
    against llama-server under the same load."""
    rows = []
    for e in ("gpu", "cpu"):
        ll, d = llama_bench_rates(raw / f"llama_v2l_{e}.json"), dsq_rows(raw / f"dsq_v2l_{e}.json").get("99", {})
        row = {"what": f"V2-Lite, experts on the {e.upper()}" if e == "gpu" else "V2-Lite, experts in RAM",
               "llama_decode": ll.get((99, "decode")), "dsq_decode": d.get("decode_tok_s_median"),
               "llama_prefill": ll.get((99, "prefill")), "dsq_prefill": d.get("prefill_tok_s_median"),
               "dsq_roofline": d.get("decode_roofline_tok_s"), "dsq_vram_mib": d.get("peak_vram_mb")}
        row["decode_ratio"] = _ratio(row["dsq_decode"], row["llama_decode"])
        row["prefill_ratio"] = _ratio(row["dsq_prefill"], row["llama_prefill"])
        rows.append(row)
    serve = {}
    for eng in ("dsq", "llama-server"):
        doc = _load(raw / f"serve_{eng}.json") or {}
        levels = doc.get("levels") or [] if isinstance(doc, dict) else []
        serve[eng] = next((lv for lv in levels if lv.get("concurrency") == 32), {})
    rows.append({"what": "serve, 32 concurrent, 64 requests of 128 tokens", "serve": serve,
                 "throughput_ratio": _ratio(_tput(serve.get("dsq")), _tput(serve.get("llama-server")))})
    try:  # benchmarks.moe_prefill: a line a chunk size
        chunks = [ln for ln in (raw / "moe_prefill.txt").read_text().splitlines() if ln.split(" ")[0].isdigit()]
    except OSError:
        chunks = []
    rows.append({"what": "one MoE layer's prompt chunk (benchmarks.moe_prefill)", "lines": chunks})
    return rows


def _tput(s: dict | None) -> float | None:
    if not s:
        return None
    return float(s["output_tok_s"]) if s.get("output_tok_s") else None


def engines_table(rows: list[dict], gpu: str) -> list[str]:
    """The card, then a row a placement: both engines' decode and prefill, their ratios, dsq's share of
    its decode roofline and its VRAM (the rows of moe_rows and multi_rows)."""
    lines = [f"Card: {gpu}", "", "| placement | llama-bench decode | dsq decode | ratio | dsq % roofline | "
             "llama-bench prefill | dsq prefill | ratio | dsq VRAM MiB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        roof = f"{100 * r['dsq_decode'] / r['dsq_roofline']:.0f}% of {r['dsq_roofline']:.1f}" \
            if r.get("dsq_roofline") and r.get("dsq_decode") else "-"
        lines.append(f"| {r['what']} | {_f(r['llama_decode'])} | {_f(r['dsq_decode'])} | "
                     f"{_mark(r['decode_ratio'], DECODE_GOAL)} | {roof} | {_f(r['llama_prefill'], 0)} | "
                     f"{_f(r['dsq_prefill'], 0)} | {_mark(r['prefill_ratio'], PREFILL_GOAL_ALL)} | "
                     f"{_f(r['dsq_vram_mib'], 0)} |")
    return lines


def moe_markdown(rows: list[dict], gpu: str) -> str:
    lines = engines_table(rows[:2], gpu)
    s = rows[2]
    lines += ["", f"{s['what']}: output tok/s dsq {_f(_tput(s['serve'].get('dsq')))}, llama-server "
              f"{_f(_tput(s['serve'].get('llama-server')))} (ratio {_f(s['throughput_ratio'], 2)})", ""]
    for eng, summ in s["serve"].items():
        lines.append(f"- {eng}: " + ", ".join(f"{k} {summ[k]}" for k in ("failures", "qps", "output_tok_s", "ttft_p50_ms",
                                                                      "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")
                                             if k in (summ or {})))
    if rows[3]["lines"]:
        lines += ["", f"{rows[3]['what']}:", ""] + [f"- {ln}" for ln in rows[3]["lines"]]
    return "\n".join(lines) + "\n"


def multi_rows(raw: Path) -> list[dict]:
    """Two GPUs: each model split by layers over both (dsq --tensor-split 1,1 against llama-bench -sm
    layer -ts 1,1), then the 8B served tensor-parallel (--tp 2), on one GPU, and by llama-server -sm row."""
    rows = []
    for tag in ("llama3-8b", "v2l"):
        ll, d = llama_bench_rates(raw / f"llama_layers2_{tag}.json"), dsq_rows(raw / f"dsq_layers2_{tag}.json").get("99", {})
        row = {"what": f"{tag}, layers over two GPUs", "llama_decode": ll.get((99, "decode")),
               "dsq_decode": d.get("decode_tok_s_median"), "llama_prefill": ll.get((99, "prefill")),
               "dsq_prefill": d.get("prefill_tok_s_median"), "dsq_roofline": d.get("decode_roofline_tok_s"),
               "dsq_vram_mib": d.get("peak_vram_mb")}
        row["decode_ratio"] = _ratio(row["dsq_decode"], row["llama_decode"])
        row["prefill_ratio"] = _ratio(row["dsq_prefill"], row["llama_prefill"])
        rows.append(row)
    serve = {}
    for eng in ("dsq-tp2", "dsq-1gpu", "llama-server-row"):
        doc = _load(raw / f"serve_{eng}.json") or {}
        levels = doc.get("levels") or [] if isinstance(doc, dict) else []
        serve[eng] = next((lv for lv in levels if lv.get("concurrency") == 32), {})
    rows.append({"what": "llama3-8b served, 32 concurrent, 64 requests of 128 tokens", "serve": serve,
                 "tp2_over_one_gpu": _ratio(_tput(serve["dsq-tp2"]), _tput(serve["dsq-1gpu"])),
                 "tp2_over_llama_row": _ratio(_tput(serve["dsq-tp2"]), _tput(serve["llama-server-row"]))})
    return rows


def multi_markdown(rows: list[dict], gpu: str) -> str:
    lines = engines_table(rows[:2], gpu)
    s = rows[2]
    lines += ["", f"{s['what']}: output tok/s " + ", ".join(f"{k} {_f(_tput(v))}" for k, v in s["serve"].items())
              + f"; --tp 2 over one GPU {_f(s['tp2_over_one_gpu'], 2)}, over llama-server -sm row "
              f"{_f(s['tp2_over_llama_row'], 2)}", ""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=["tests", "race", "moe", "multi"])
    ap.add_argument("raw", type=Path, help="the folder of raw records device_plan.sh wrote")
    ap.add_argument("--out", type=Path, required=True, help="OUT/partN: writes partN.json and partN.md")
    a = ap.parse_args(argv)
    gpu = (a.raw / "gpu.txt").read_text().strip().replace("\n", "; ") if (a.raw / "gpu.txt").exists() else "?"
    if a.part == "tests":
        rows = test_rows(a.raw / "tests.xml")
        md = tests_markdown(rows, gpu)
    elif a.part == "race":
        rows = [r for tag, _ in SHAPES for r in race_rows(a.raw, tag)]
        md = race_markdown(rows, gpu)
    elif a.part == "multi":
        rows = multi_rows(a.raw)
        md = multi_markdown(rows, gpu)
    else:
        rows = moe_rows(a.raw)
        md = moe_markdown(rows, gpu)
    calib = _load(a.raw / "calibration.json")
    a.out.with_suffix(".json").write_text(json.dumps({"card": gpu, "rows": rows, "calibration": calib}, indent=1))
    a.out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()

