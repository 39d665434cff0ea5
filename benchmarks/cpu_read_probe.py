"""The CPU's read rate by three probes side by side: torch's float sum (the calibration's probe before
dsq_read_sum), the C kernels' pool reading 64-bit words (kernels/cpu.py read_sum, what `dsq offload
--calibrate` measures now), and single GEMVs of a decode step's largest shapes (an 8B's Q6_K output
head and Q4_K gate/up, random blocks), whose bytes a token reads at that rate at best.

    python -m benchmarks.cpu_read_probe [--threads 8,16] [--gib 1]
"""

from __future__ import annotations

import argparse


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="", help="comma list (default: the runtime's threads)")
    ap.add_argument("--gib", type=float, default=1.0, help="buffer size of the read probes")
    a = ap.parse_args(argv)

    import torch

    from dsq.kernels import cpu
    from dsq.runtime.machine import best_seconds, measure_cpu_peak_read, measure_cpu_read, runtime_threads

    print(f"kernels: {cpu.library()[1]}")
    nbytes = int(a.gib * 2**30) // 4096 * 4096
    threads = [int(t) for t in a.threads.split(",") if t] or [runtime_threads()]
    for th in threads:
        torch.set_num_threads(th)
        torch_bw, c_bw = measure_cpu_read(th, nbytes), measure_cpu_peak_read(th, nbytes)
        c = "no C kernels" if c_bw is None else f"{c_bw / 1e9:.1f} GB/s"
        print(f"threads {th}: torch sum {torch_bw / 1e9:.1f} GB/s, C read {c}", flush=True)
        for name, qt, N, K, row in (("Q6_K head 128256x4096", "Q6_K", 128256, 4096, 16 * 210),
                                    ("Q4_K gate/up 28672x4096", "Q4_K", 28672, 4096, 16 * 144)):
            raw = torch.randint(0, 64, (N, row), dtype=torch.uint8)  # small bytes: finite fp16 scales
            xin = torch.randn(1, K)
            cpu.gguf_linear(xin, raw, qt, K, threads=th)
            s = best_seconds(lambda raw=raw, qt=qt, K=K: cpu.gguf_linear(xin, raw, qt, K, threads=th), 7)
            print(f"  {name}: {raw.numel() / s / 1e9:.1f} GB/s ({s * 1e3:.2f} ms a GEMV)", flush=True)
            del raw


if __name__ == "__main__":
    main()
