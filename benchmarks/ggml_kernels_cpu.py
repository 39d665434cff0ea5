"""dsq's GGUF CPU kernels against the ggml kernels llama.cpp runs for the same work, one core, weights
in cache, best of many calls (ggml_kernels_cpu.c says what is compared). Builds the probe with the
system's C compiler, then runs it per shape; a ratio above 1 is dsq faster. The kernels' build
follows DSQ_CPU_ISA, the int8 prefill tiles DSQ_INT8_PREFILL (docs/benchmarks.md#cpu-kernels).

    DSQ_CPU_ISA=avx2 python -m benchmarks.ggml_kernels_cpu --ggml $(.ci/llama_avx2.sh)
    DSQ_CPU_ISA=avx2 DSQ_INT8_PREFILL=1 python -m benchmarks.ggml_kernels_cpu --ggml $(.ci/llama_avx2.sh) \\
        --shapes 128x1536,64x8960 --m 64
    DSQ_CPU_ISA=avx2 python -m benchmarks.ggml_kernels_cpu --ggml $(.ci/llama_avx2.sh) --shapes 17920x1536 \
        --copies 8 --reps 40                                # weights from DRAM, as in decode
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ggml", required=True, help="the folder of llama.cpp's libggml-cpu.so")
    ap.add_argument("--shapes", default="256x1536,512x1536,64x8960", help="NxK, N a multiple of 8, K of 256")
    ap.add_argument("--m", type=int, default=1, help="rows of x (1, or a multiple of 4)")
    ap.add_argument("--reps", type=int, default=0, help="calls per kernel (default: 400 at M=1, 20 above)")
    ap.add_argument("--copies", type=int, default=1,
                    help="copies of each weight, called in turn (enough of them: every call reads DRAM)")
    args = ap.parse_args(argv)

    from dsq.kernels import cpu

    lib, isa = cpu.library()
    if lib is None:
        raise SystemExit(f"error: no CPU kernels ({isa})")
    so = lib._name
    src = Path(__file__).with_name("ggml_kernels_cpu.c")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "probe"
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-o", str(exe), str(src), "-ldl",
                        "-Wl,--no-as-needed", "-lm"], check=True)
        print(f"native kernels {isa}, DSQ_INT8_PREFILL={os.environ.get('DSQ_INT8_PREFILL', '')!r}; "
              f"ggml from {args.ggml}; load average {Path('/proc/loadavg').read_text().split()[:3]}")
        reps = args.reps or (400 if args.m == 1 else 20)
        for shape in args.shapes.split(","):
            n, k = shape.split("x")
            subprocess.run([str(exe), so, str(Path(args.ggml) / "libggml-cpu.so"), n, k, str(args.m), str(reps),
                            str(args.copies)],
                           check=True)


if __name__ == "__main__":
    main()
