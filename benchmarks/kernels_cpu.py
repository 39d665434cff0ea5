"""Read bandwidth of dsq's C CPU kernels (fused dequantize + matmul), every weight format.

    python -m benchmarks.kernels_cpu [--threads N] [--shapes 4096x4096,14336x4096] [--batch 1,16] [--json out.json]

The kernels' paths follow the environment (DSQ_CPU_ISA, DSQ_NO_VNNI, DSQ_INT8_PREFILL: kernels/README.md),
which the results record.

For each format and weight shape (N outputs x K inputs), random weights are cycled through enough
copies that they come from memory rather than the last-level cache, like a model's layers in
decode. GB/s = bytes the kernel must read (weights + scales / zeros) / time per call (the best call;
the JSON also has the median); "x torch" is the speedup over torch's float32 F.linear on the same
thread count in the same run. A large tensor copy and sum give the memory bandwidth for reference.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

FORMATS = ["int4 g128", "int8 per-channel", "fp8 channel", "fp8 block", "Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K",
           "Q6_K"]
SHAPES = "4096x4096,14336x4096,4096x14336"
_F16_FIELDS = {"Q4_0": [0], "Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
# the environment that picks the kernels' paths (kernels/README.md), kept with the results
SWITCHES = ("DSQ_CPU_ISA", "DSQ_NO_VNNI", "DSQ_INT8_PREFILL")


def _llc_bytes() -> int:
    """Size of the last-level cache (32 MiB if unknown)."""
    best = 0
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            s = f.read_text().strip()
            best = max(best, int(s[:-1]) * {"K": 2**10, "M": 2**20, "G": 2**30}[s[-1]] if s[-1].isalpha() else int(s))
        except (OSError, ValueError, KeyError):
            continue
    return best or 32 * 2**20


def random_gguf(qtype: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Random blocks (every field random, fp16 scales finite), as tests/test_kernels_ref.py."""
    from dsq.kernels.gguf_ref import BLOCKS

    per, nbytes = BLOCKS[qtype]
    b = rng.integers(0, 256, (n, k // per, nbytes), dtype=np.uint8)
    for off in _F16_FIELDS[qtype]:
        b[..., off:off + 2] = (0.01 * rng.standard_normal(b.shape[:2])).astype(np.float16).view(np.uint8).reshape(
            *b.shape[:2], 2)
    return torch.from_numpy(b.reshape(n, -1))


def make_weights(fmt: str, n: int, k: int, rng: np.random.Generator, gen: torch.Generator):
    """(call(x, out) -> y, bytes read per call) for one random weight matrix."""
    from dsq.kernels import cpu

    if fmt.startswith("int"):
        bits = 4 if fmt.startswith("int4") else 8
        g = 128 if "g128" in fmt else k
        qw = torch.randint(0, 256, (n, k * bits // 8), dtype=torch.uint8, generator=gen)
        scales = (0.01 * torch.rand(n, k // g, generator=gen) + 1e-3).half()
        zeros = torch.randint(0, 2**bits, (n, k // g), dtype=torch.uint8, generator=gen)
        nbytes = qw.numel() + scales.numel() * 2 + zeros.numel()
        return (lambda x, out: cpu.int_linear(x, qw, scales, zeros, bits, out=out)), nbytes
    if fmt.startswith("fp8"):
        w = (0.1 * torch.randn(n, k, generator=gen)).to(torch.float8_e4m3fn)
        scale = torch.rand(n, 1, generator=gen) if fmt == "fp8 channel" else \
            torch.rand(-(-n // 128), -(-k // 128), generator=gen)
        return (lambda x, out: cpu.fp8_linear(x, w, scale, out=out)), w.numel() + scale.numel() * 4
    raw = random_gguf(fmt, n, k, rng)
    return (lambda x, out: cpu.gguf_linear(x, raw, fmt, k, out=out)), raw.numel()


def time_calls(calls: list, x: torch.Tensor, out: torch.Tensor | None, budget: float) -> tuple[float, float]:
    """(best, median) seconds per call, cycling through `calls` (one per weight copy, so each call
    reads its weights from memory) for `budget` seconds and at least 10 calls. Each call is timed
    alone: on a shared machine other processes only add time, and the best call shows the kernel."""
    for c in calls:  # warm up (and page in) every copy
        c(x, out)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 10 or (time.perf_counter() - start < budget and len(times) < 5000):
        c = calls[len(times) % len(calls)]
        t0 = time.perf_counter()
        c(x, out)
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def memory_bandwidth(budget: float) -> dict:
    """GB/s of a large tensor copy (bytes read, and read + written) and of a large sum (read)."""
    n = max(64 * 2**20, 4 * _llc_bytes()) // 4
    src, dst = torch.rand(n), torch.empty(n)
    t_copy = time_calls([lambda x, out: dst.copy_(src)], src, None, budget)[0]
    t_sum = time_calls([lambda x, out: src.sum()], src, None, budget)[0]
    return {"copy_read_gb_s": 4 * n / t_copy / 1e9, "copy_read_write_gb_s": 8 * n / t_copy / 1e9,
            "sum_read_gb_s": 4 * n / t_sum / 1e9, "bytes": 4 * n}


def parse_shapes(s: str) -> list[tuple[int, int]]:
    out = []
    for part in s.split(","):
        n, k = part.lower().split("x")
        out.append((int(n), int(k)))
    return out


def run(shapes: list[tuple[int, int]], batches: list[int], formats: list[str], threads: int, budget: float,
        log=print) -> dict:
    from dsq.kernels import cpu

    torch.set_num_threads(threads)
    rng, gen = np.random.default_rng(0), torch.Generator().manual_seed(0)
    llc = _llc_bytes()
    mem = memory_bandwidth(budget)
    rows = []
    for n, k in shapes:
        xs = {m: torch.randn(m, k, generator=gen) for m in batches}
        outs = {m: torch.empty(m, n) for m in batches}
        # torch float32 baseline, one copy per ~LLC so it streams from memory too
        dense = [torch.randn(n, k, generator=gen) for _ in range(max(1, math.ceil(2 * llc / (4 * n * k))))]
        base = {m: time_calls([lambda x, out, w=w: torch.nn.functional.linear(x, w) for w in dense], xs[m], None,
                              budget)[0] for m in batches}
        del dense
        for fmt in formats:
            if fmt.startswith("Q") and k % (256 if fmt.endswith("K") else 32):
                continue
            call, nbytes = make_weights(fmt, n, k, rng, gen)
            copies = max(1, math.ceil(3 * llc / nbytes))
            calls = [call] + [make_weights(fmt, n, k, rng, gen)[0] for _ in range(copies - 1)]
            row = {"format": fmt, "n": n, "k": k, "bytes": nbytes, "copies": copies, "threads": threads,
                   "isa": cpu.library()[1]}
            for m in batches:
                t, med = time_calls(calls, xs[m], outs[m], budget)
                row[f"m{m}"] = {"ms": t * 1e3, "median_ms": med * 1e3, "gb_s": nbytes / t / 1e9,
                                "torch_ms": base[m] * 1e3, "speedup": base[m] / t}
            rows.append(row)
            del calls
            log(row)
    return {"threads": threads, "isa": cpu.library()[1], "llc_bytes": llc, "memory": mem, "batches": batches,
            "switches": {k: os.environ[k] for k in SWITCHES if k in os.environ}, "rows": rows}


def table(report: dict):
    from rich.table import Table

    mem = report["memory"]
    sw = "".join(f", {k}={v}" for k, v in report.get("switches", {}).items() if k != "DSQ_CPU_ISA")
    t = Table(title=f"dsq C CPU kernels ({report['isa']}{sw}), {report['threads']} threads", title_justify="left",
              caption=f"memory: copy {mem['copy_read_gb_s']:.1f} GB/s read ({mem['copy_read_write_gb_s']:.1f} read + "
                      f"written), sum {mem['sum_read_gb_s']:.1f} GB/s read. GB/s = weight + scale bytes / time "
                      f"(best call); x torch = time of float32 F.linear / time", caption_justify="left")
    t.add_column("format")
    t.add_column("N x K", justify="right")
    for m in report["batches"]:
        t.add_column(f"M={m} ms", justify="right")
        t.add_column(f"M={m} GB/s", justify="right")
        t.add_column(f"M={m} x torch", justify="right")
    for r in report["rows"]:
        cells = []
        for m in report["batches"]:
            c = r[f"m{m}"]
            cells += [f"{c['ms']:.3f}", f"{c['gb_s']:.1f}", f"{c['speedup']:.1f}"]
        t.add_row(r["format"], f"{r['n']} x {r['k']}", *cells)
    return t


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated NxK (outputs x inputs)")
    ap.add_argument("--batch", default="1,16", help="comma-separated rows of x (M)")
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated, from: " + ", ".join(FORMATS))
    ap.add_argument("--seconds", type=float, default=0.4, help="time budget per measurement")
    ap.add_argument("--json", help="save the results here")
    a = ap.parse_args(argv)

    from dsq.kernels import cpu
    from dsq.ui import console, out_console

    if not cpu.available():
        raise SystemExit(f"no C CPU kernels: {cpu.library()[1]}")
    formats = [f.strip() for f in a.formats.split(",")]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise SystemExit(f"unknown formats {unknown}; choose from {FORMATS}")
    batches = [int(m) for m in a.batch.split(",")]
    con = console()

    def log(row):
        cells = ", ".join(f"M={m}: {row[f'm{m}']['gb_s']:.1f} GB/s" for m in batches)
        con.print(f"  {row['format']} {row['n']}x{row['k']}: {cells}")

    report = run(parse_shapes(a.shapes), batches, formats, a.threads, a.seconds, log)
    out_console().print(table(report))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
