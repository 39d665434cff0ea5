"""Wall time and peak memory of dsq's calibrated quantizers on a random-weight model.

    python -m benchmarks.quant_speed --shape llama3-8b --methods gptq,awq --samples 128 --seq-len 2048

Writes a random bf16 HF directory of the given shape (once), then quantizes it layer by layer
with each method, timing the whole `dsq.quant.quantize` call and reading the peak GPU memory
(torch's allocator) and peak process RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch


def _every_8th_block(method: str):
    """A progress callback printing every 8th block with its seconds."""
    last = [time.perf_counter()]

    def report(step) -> None:
        now = time.perf_counter()
        if step.done and step.done % 8 == 0:
            print(f"  {method} block {step.done}/{step.total} {now - last[0]:.1f}s", flush=True)
        last[0] = now

    return report


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--methods", default="gptq,awq")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--work", default="/tmp/dsq-quant-speed")
    ap.add_argument("--layers", type=int, help="override the shape's layer count (quick profiles)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    from dsq.bench.random_models import write_random_hf
    from dsq.quant import CalibSpec, QuantSpec, blocks, quantize

    work = Path(a.work)
    t = time.perf_counter()
    src = write_random_hf(a.shape, work / a.shape, a.layers)
    print(f"random {a.shape} written in {time.perf_counter() - t:.0f}s", flush=True)
    rows = []
    for method in a.methods.split(","):
        spec = QuantSpec(method, calib=CalibSpec("random", a.samples, a.seq_len))
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        blocks.PHASES.clear()
        quantize(src, work / f"{a.shape}-{method}", spec, force=True, progress=_every_8th_block(method))
        secs = time.perf_counter() - t
        row = {"method": method, "seconds": round(secs, 1), "samples": a.samples, "seq_len": a.seq_len,
               "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else 0,
               "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
               "phases_s": {k: round(v, 1) for k, v in blocks.PHASES.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps({"shape": a.shape, "rows": rows}, indent=2))
    print(f"\n{a.shape}, {a.samples} x {a.seq_len} calibration tokens, "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}")
    print(f"{'method':8} {'wall s':>8} {'peak GPU GiB':>13} {'peak RSS GiB':>13}")
    for r in rows:
        print(f"{r['method']:8} {r['seconds']:8.1f} {r['peak_gpu_gib']:13.2f} {r['peak_rss_gib']:13.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"shape": a.shape, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
