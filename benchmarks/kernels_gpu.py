"""The Triton quantized-matmul kernels on a GPU, per format and shape, against torch bf16 F.linear
and the device's copy bandwidth, measured side by side in one run.

    python -m benchmarks.kernels_gpu [--shapes 4096x4096,14336x4096,4096x14336,28672x8192] [--m 1,16]
                                    [--formats ...] [--json out.json]

Shapes are N x K (outputs x inputs, the weight's shape). Each timing replays a CUDA graph of
calls cycling through enough copies of the weight to overflow L2, so every byte comes from HBM
and no launch overhead is counted (the runtime replays its decode step as a graph too).
Achieved bandwidth = bytes that must be read (codes + scales + x) / time. A format named with
"+q8" (int4-g128+q8, Q4_K+q8, ...) runs the int8-activation kernel (dp4a, M <= 16), x's rounding
included; "+tc" the bf16
tensor-core kernel for a few rows (kernels/triton_mma.py, int4 M <= 64), "+tcs" its variant with the
weights scaled before the MMA (Q4_0, Q4_K, any int4 group), x's preparation included in both;
"+dq" writes the weight out in bf16 and multiplies with cuBLAS (prefill), the writing included;
"+rows" runs the one-row int8-x GEMV once a row (Q6_K at 2-4 rows).
"""

from __future__ import annotations

import argparse
import json

import torch

from dsq.bench.random_models import random_packed

FORMATS = ["int4-g128", "int4-g128-actorder", "int8-channel", "fp8-channel", "fp8-block", "Q4_0", "Q5_0", "Q8_0",
           "Q4_K", "Q5_K", "Q6_K"]
L2_FLUSH_BYTES = 512 << 20


def graph_time(fns: list, reps: int = 3) -> float:
    """Seconds per call: a CUDA graph of all `fns` (one per weight copy) replayed `reps` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    loops = max(1, 64 // len(fns))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(loops):
            for f in fns:
                f()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) / 1000 / (loops * len(fns)))
    return best


def copies_for(nbytes: int) -> int:
    return max(2, min(64, -(-L2_FLUSH_BYTES // max(nbytes, 1))))


def weight_copies(p0) -> list:
    """p0 and clones of it at other addresses (same data), enough to overflow L2, so a graph of
    calls cycling through them reads HBM."""
    from dsq.kernels.packed import Packed

    return [p0] + [Packed(p0.fmt, p0.N, p0.K, **{k: v.clone() for k, v in p0.tensors().items()})
                   for _ in range(copies_for(p0.nbytes()) - 1)]


def bench_shape(fmt: str, N: int, K: int, M: int) -> dict:
    from dsq.kernels import triton_dequant, triton_gemm, triton_gemv_q8, triton_mma
    from dsq.kernels.packed import linear_ref, linear_ref_q8

    base, _, suffix = fmt.partition("+")
    kern = {"": triton_gemm.packed_linear, "q8": triton_gemv_q8.q8_linear, "rows": triton_gemv_q8.q8_rows_linear,
            "tc": triton_mma.mma_linear, "tcs": triton_mma.mma_linear_scaled,
            "dq": triton_dequant.dequant_linear}[suffix]
    q8 = suffix in ("q8", "rows")  # x rounded to int8: its own reference
    p0 = random_packed(base, N, K)
    ps = weight_copies(p0)  # copies at other addresses, so the graph's calls read HBM, not L2
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    ys = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for _ in ps]
    y = kern(x, p0)  # correctness on this shape first (and autotuning)
    ref = linear_ref_q8(x.float(), p0) if q8 else linear_ref(x.float(), p0)
    rel = float((y.float() - ref).norm() / ref.norm())
    fns = [lambda p=p, yy=yy: kern(x, p, out=yy) for p, yy in zip(ps, ys)]
    t = graph_time(fns)
    nbytes = p0.nbytes() + x.numel() * 2 + M * N * 2
    del ps, ys
    return {"format": fmt, "N": N, "K": K, "M": M, "us": t * 1e6, "bytes": nbytes, "gbs": nbytes / t / 1e9,
            "rel_err": rel}


def bench_bf16(N: int, K: int, M: int) -> dict:
    nbytes = N * K * 2
    n = copies_for(nbytes)
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(n)]
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    ys = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for _ in ws]
    fns = [lambda w=w, y=y: torch.matmul(x, w.t(), out=y) for w, y in zip(ws, ys)]
    t = graph_time(fns)
    del ws
    total = nbytes + x.numel() * 2 + M * N * 2
    return {"format": "bf16 F.linear", "N": N, "K": K, "M": M, "us": t * 1e6, "bytes": total,
            "gbs": total / t / 1e9}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336,28672x8192")
    ap.add_argument("--m", default="1,16")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    from benchmarks.decode_gpu import copy_bandwidth

    bw = copy_bandwidth()
    rows = []
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    hdr = f"{'format':20} {'N x K':>12} {'M':>3} {'us':>8} {'GB/s':>7} {'% copy':>7} {'x bf16':>7} {'rel err':>8}"
    print(hdr, flush=True)
    for shape in a.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        for M in (int(m) for m in a.m.split(",")):
            base = bench_bf16(N, K, M)
            rows.append(base)
            print(f"{base['format']:20} {shape:>12} {M:3d} {base['us']:8.1f} {base['gbs']:7.0f} "
                  f"{base['gbs'] * 1e9 / bw:7.0%} {1:7.2f}", flush=True)
            for fmt in a.formats.split(","):
                try:
                    r = bench_shape(fmt, N, K, M)
                except Exception as e:  # noqa: BLE001 - report and go on with the other formats
                    print(f"{fmt:20} {shape:>12} {M:3d} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                r["speedup_vs_bf16"] = base["us"] / r["us"]
                r["frac_copy_bw"] = r["gbs"] * 1e9 / bw
                rows.append(r)
                print(f"{fmt:20} {shape:>12} {M:3d} {r['us']:8.1f} {r['gbs']:7.0f} {r['frac_copy_bw']:7.0%} "
                      f"{r['speedup_vs_bf16']:7.2f} {r['rel_err']:8.1e}", flush=True)
                torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "copy_bw": bw, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
