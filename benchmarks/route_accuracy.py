"""Each dispatch route's error on a GPU against float64 with exact weights, beside the error of the
bf16-rounded weight through cuBLAS (what decode_gpu's per-layer check compares with): which of the
two a "kernels vs dequantized" figure measures.

    python -m benchmarks.route_accuracy [--formats int4-g128,Q4_K,Q6_K] [--m 16,64,512]
"""

from __future__ import annotations

import argparse


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="int4-g128,Q4_K,Q6_K")
    ap.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336")
    ap.add_argument("--m", default="16,64,512")
    a = ap.parse_args(argv)
    import torch

    from dsq.bench.random_models import random_packed
    from dsq.kernels import dispatch, packed

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    torch.manual_seed(0)
    for fmt in a.formats.split(","):
        for shape in a.shapes.split(","):
            N, K = (int(v) for v in shape.split("x"))
            p = random_packed(fmt, N, K)
            W = packed.dequantize(p).double()
            for M in (int(m) for m in a.m.split(",")):
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                exact = x.double() @ W.t()
                ref = (x @ W.to(torch.bfloat16).t()).double()
                y = dispatch.packed_linear(x, p).double()
                print(f"{fmt:10} {shape:>11} M={M:4} route {dispatch.gpu_kernel(p, M, x.dtype):10} "
                      f"kernel vs exact {rel(y, exact):.1e}   bf16-weight cuBLAS vs exact {rel(ref, exact):.1e}   "
                      f"kernel vs bf16-weight {rel(y, ref):.1e}", flush=True)


if __name__ == "__main__":
    main()
