"""Launch each quantized matmul kernel once, at fixed tiles, for Nsight Compute to profile on a GPU
(the readings in docs/benchmarks.md: DRAM and L1 throughput, occupancy, stall reasons):

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --section MemoryWorkloadAnalysis -k regex:"_gemv|_gemm|_quant_x|_mma_t" python -m benchmarks.ncu_launch [--m 16]

M = 1: the int8-x GEMV (int4 with register prefetch on a persistent grid, one of its autotune
candidates, and pipelined through shared memory; Q8_0), the float-x GEMV (int4, FP8) and cuBLAS
bf16 beside them. M = 16: the tensor-core kernel (triton_mma, 4 and 8 warps) and the tl.dot GEMM
(int4). Shape: --shape N x K (28672x8192).
"""

from __future__ import annotations

import argparse

import torch


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", type=int, default=1, choices=[1, 16])
    ap.add_argument("--shape", default="28672x8192")
    a = ap.parse_args(argv)
    from dsq.bench.random_models import random_packed
    from dsq.kernels import triton_gemm, triton_gemv_q8

    N, K = (int(v) for v in a.shape.split("x"))
    x = torch.randn(a.m, K, device="cuda", dtype=torch.bfloat16)
    if a.m == 1:
        runs = [("int4-g128", triton_gemv_q8.q8_linear, dict(BN=1, BK=2048, STAGES=1, PREFETCH=True, PERSIST=32, num_warps=1)),
                ("int4-g128", triton_gemv_q8.q8_linear, dict(BN=2, BK=2048, STAGES=2, num_warps=1)),  # pipelined, no prefetch
                ("Q8_0", triton_gemv_q8.q8_linear, dict(BN=4, BK=1024, STAGES=2, num_warps=1)),
                ("int4-g128", triton_gemm.packed_linear, dict(BN=8, BK=1024, STAGES=3, num_warps=2)),
                ("fp8-channel", triton_gemm.packed_linear, dict(BN=8, BK=1024, STAGES=3, num_warps=2))]
    else:
        from dsq.kernels import triton_mma

        runs = [("int4-g128", triton_mma.mma_linear, dict(BN=128, BK=128, STAGES=4, num_warps=4)),
                ("int4-g128", triton_mma.mma_linear, dict(BN=128, BK=128, STAGES=3, num_warps=8)),  # 8 warps
                ("int4-g128", triton_gemm.packed_linear, dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=4))]
    for fmt, fn, cfg in runs:
        p = random_packed(fmt, N, K)
        fn(x, p, config=cfg)
        torch.cuda.synchronize()
        del p
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    torch.matmul(x, w.t())
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
