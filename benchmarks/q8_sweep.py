"""The int8-activation kernels at fixed tile configs on a GPU, per format and shape, against torch
bf16 F.linear in the same run: the sweep behind their autotune candidates (the int8-x GEMV;
--m 2..4: its MR rows of x).

    python -m benchmarks.q8_sweep [--formats int4-g128,Q4_K,Q8_0] [--shapes 28672x8192,4096x4096,4096x14336]

Same timing as kernels_gpu (CUDA graphs over weight copies that overflow L2; x's int8 rounding
kernel included); GB/s counts the weight's bytes only.
"""

from __future__ import annotations

import argparse

import torch

CANDIDATES = [(4, 1024, 1, 3), (2, 1024, 1, 3), (4, 2048, 1, 3), (4, 512, 1, 3), (2, 2048, 1, 2), (4, 1024, 1, 4),
              (4, 2048, 2, 3), (8, 2048, 2, 3), (2, 4096, 1, 2), (4, 1024, 1, 2), (1, 2048, 1, 3), (8, 1024, 1, 3),
              (32, 512, 4, 3), (16, 1024, 4, 3), (16, 512, 4, 3), (8, 1024, 2, 3), (8, 512, 1, 3),
              (16, 512, 2, 3),  # (BN, BK, warps, stages)
              # stages 0: PREFETCH, the next tile's loads held in registers (no shared memory)
              (1, 1024, 1, 0), (2, 1024, 1, 0), (4, 1024, 1, 0), (8, 1024, 1, 0), (1, 2048, 1, 0),
              (2, 2048, 1, 0), (4, 2048, 2, 0), (2, 2048, 2, 0), (8, 2048, 2, 0), (4, 4096, 4, 0),
              # a fifth field: PERSIST, programs per SM walking several row tiles each
              (1, 1024, 1, 0, 32), (2, 1024, 1, 0, 32), (1, 2048, 1, 0, 32), (1, 2048, 1, 0, 16), (1, 4096, 1, 0)]

def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="int4-g128,Q4_K,Q8_0")
    ap.add_argument("--shapes", default="28672x8192,4096x4096,4096x14336")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--configs", help="BN:BK:warps:stages[:persist],... instead of the built-in candidates "
                                      "(stages 0: PREFETCH; persist: programs per SM)")
    a = ap.parse_args(argv)
    cands = CANDIDATES
    if a.configs:
        cands = [tuple(int(v) for v in c.split(":")) for c in a.configs.split(",")]
    from benchmarks.kernels_gpu import bench_bf16, graph_time, weight_copies
    from dsq.bench.random_models import random_packed
    from dsq.kernels import triton_gemv_q8 as T
    from dsq.kernels.packed import linear_ref_q8

    for shape in a.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        base = bench_bf16(N, K, a.m)
        print(f"== {shape} bf16 {base['us']:.1f} us", flush=True)
        for fmt in a.formats.split(","):
            p0 = random_packed(fmt, N, K)
            ps = weight_copies(p0)
            x = torch.randn(a.m, K, device="cuda", dtype=torch.bfloat16)
            ref = linear_ref_q8(x.float(), p0)
            ys = [torch.empty(a.m, N, device="cuda", dtype=torch.bfloat16) for _ in ps]
            for bn, bk, w, st, *persist in cands:
                cfg = {"BN": bn, "BK": bk, "STAGES": max(st, 1), "num_warps": w}
                if st == 0:
                    cfg["PREFETCH"] = True
                if persist and persist[0]:
                    cfg["PERSIST"] = persist[0]
                y = T.q8_linear(x, p0, config=cfg)
                rel = float((y.float() - ref).norm() / ref.norm())
                t = graph_time([lambda p=p, yy=yy: T.q8_linear(x, p, out=yy, config=cfg)
                                for p, yy in zip(ps, ys)])
                print(f"  {fmt:10} {str(cfg):62} {t * 1e6:7.1f} us {p0.nbytes() / t / 1e9:6.0f} GB/s "
                      f"{base['us'] / (t * 1e6):5.2f}x rel {rel:.0e}", flush=True)
            del ps, ys
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
