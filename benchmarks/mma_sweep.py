"""Fixed tile configs of the tensor-core kernel (kernels/triton_mma.py) on a GPU, against torch bf16
F.linear in the same run: the sweep behind its autotune candidates.

    python -m benchmarks.mma_sweep [--shapes 28672x8192,4096x14336] [--m 16,4] \\
        --configs 128:128:4:4,64:128:4:3:4:2

Config fields: BN:BK:warps:stages[:split[:ng[:maxnreg]]]. Each time replays a CUDA graph of calls
over enough weight copies to overflow L2 (kernels_gpu.graph_time); x's preparation is included.
A config whose output is off the float reference by more than 1e-2 is flagged ERR.
"""

from __future__ import annotations

import argparse


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="28672x8192,14336x4096,4096x14336,4096x4096")
    ap.add_argument("--m", default="16,4")
    ap.add_argument("--format", default="int4-g128")
    ap.add_argument("--configs", required=True)
    a = ap.parse_args(argv)
    import torch

    from benchmarks.kernels_gpu import bench_bf16, graph_time, weight_copies
    from dsq.bench.random_models import random_packed
    from dsq.kernels import triton_mma
    from dsq.kernels.packed import linear_ref

    keys = ["BN", "BK", "num_warps", "STAGES", "SPLIT", "NG", "maxnreg"]
    cfgs = [dict(zip(keys, (int(v) for v in c.split(":")))) for c in a.configs.split(",")]
    for shape in a.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        p0 = random_packed(a.format, N, K)
        ps = weight_copies(p0)
        for M in (int(m) for m in a.m.split(",")):
            bf = bench_bf16(N, K, M)["us"]
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ys = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for _ in ps]
            ref = linear_ref(x.float(), p0)
            row = []
            for cfg in cfgs:
                name = ":".join(str(v) for v in cfg.values())
                try:
                    y = triton_mma.mma_linear(x, p0, config=cfg)
                    err = float((y.float() - ref).norm() / ref.norm())
                    t = graph_time([lambda p=p, yy=yy, c=cfg: triton_mma.mma_linear(x, p, out=yy, config=c)
                                    for p, yy in zip(ps, ys)]) * 1e6
                    row.append(f"{name} {t:6.1f}us {bf / t:4.2f}x{' ERR %.1e' % err if err > 1e-2 else ''}")
                except Exception as e:  # noqa: BLE001 - a config that does not compile or launch: say so, go on
                    row.append(f"{name} failed ({type(e).__name__})")
            print(f"{N}x{K} M={M} bf16 {bf:6.1f}us | " + " | ".join(row), flush=True)
        del ps


if __name__ == "__main__":
    main()
