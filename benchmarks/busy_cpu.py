"""Native CPU decode against llama.cpp on an idle and on a busy machine: `dsq bench -b
native,llama.cpp` on a model (the built-in one unless given), once idle and once beside a CPU hog
(a busy loop in another process pinned to one core, bounded in time and stopped when the bench
ends). Prints each engine's decode and prefill tok/s and native / llama.cpp per condition
(docs/benchmarks.md#cpu-decode). The environment passes through: DSQ_CPU_ISA picks the native
kernels' build, LLAMA_CPP_LIB_PATH llama.cpp's libraries.

    python -m benchmarks.busy_cpu                                  # built-in model, 64 + 64 tokens
    python -m benchmarks.busy_cpu --repeat 5 --json busy.json
    DSQ_CPU_ISA=avx2 LLAMA_CPP_LIB_PATH=$(.ci/llama_avx2.sh) python -m benchmarks.busy_cpu
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOG = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])}) if hasattr(os, "sched_setaffinity") else None
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    sum(range(10000))
"""


def start_hog(core: int, seconds: float) -> subprocess.Popen:
    """A busy loop on `core` in its own process, ending by itself after `seconds` at the latest."""
    return subprocess.Popen([sys.executable, "-c", HOG, str(core), str(seconds)])


def hog_core() -> int:
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return cores[-1]


def run_bench(args, json_path: Path) -> list[dict]:
    cmd = ["dsq", "bench", *([args.model] if args.model else []), "-b", "native,llama.cpp",
           "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens),
           "--repeat", str(args.repeat), "--json", str(json_path),
           *(["--threads", str(args.threads)] if args.threads else [])]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL if args.quiet else None)
    return json.loads(json_path.read_text())


def rows(report: dict) -> dict[str, dict]:
    return {r["backend"]: r for r in report["summary"]}


def measure(args) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cond in args.conditions.split(","):
            hog = start_hog(args.hog_core, args.hog_seconds) if cond == "busy" else None
            try:
                if hog:
                    time.sleep(0.5)  # the hog running before the first token
                out[cond] = run_bench(args, Path(tmp) / f"{cond}.json")
            finally:
                if hog:
                    hog.terminate()
                    hog.wait()
    return out


def table(results: dict, hog_core: int) -> str:
    lines = ["| condition | native decode tok/s | llama.cpp decode tok/s | ratio | native prefill tok/s "
             "| llama.cpp prefill tok/s | ratio |", "|---|---|---|---|---|---|---|"]
    for cond, report in results.items():
        r = rows(report)
        n, ll = r["native"], r["llama.cpp"]
        d = [n["decode_tok_s_median"], ll["decode_tok_s_median"]]
        p = [n["prefill_tok_s_median"], ll["prefill_tok_s_median"]]
        name = f"busy (hog on CPU {hog_core})" if cond == "busy" else cond
        lines.append(f"| {name} | {d[0]:.1f} | {d[1]:.1f} | {d[0] / d[1]:.2f}x | {p[0]:.0f} | {p[1]:.0f} "
                     f"| {p[0] / p[1]:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="a model dsq bench takes (default: the built-in model)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, help="both engines' threads (default: dsq's)")
    ap.add_argument("--conditions", default="idle,busy", help="idle, busy or both, in that order")
    ap.add_argument("--hog-core", type=int, default=None, help="the CPU the hog runs on (default: the last one)")
    ap.add_argument("--hog-seconds", type=float, default=1800, help="the hog's bound, if the bench outlives it")
    ap.add_argument("--json", type=Path, help="write every condition's dsq bench report here")
    ap.add_argument("--quiet", action="store_true", help="hide dsq bench's own tables")
    args = ap.parse_args(argv)
    if args.hog_core is None:
        args.hog_core = hog_core()
    results = measure(args)
    print(table(results, args.hog_core))
    if args.json:
        args.json.write_text(json.dumps({"hog_core": args.hog_core, "conditions": results}, indent=1))


if __name__ == "__main__":
    main()
