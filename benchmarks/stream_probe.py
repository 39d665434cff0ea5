"""How fast Triton's cp.async pipeline streams int4 codes alone (no arithmetic) in tiles of BN rows x
a run of bytes a row: the floor under a tensor-core kernel's tile shape (kernels/triton_mma.py).

    python -m benchmarks.stream_probe [--shape 28672x8192] --configs 128:64:4:4:16,128:128:4:4:16

Config fields: BN:bytes_per_row:warps:stages:word_bits (16 or 32). Times replay a CUDA graph over
enough copies of the codes to overflow L2 (kernels_gpu.graph_time).
"""

from __future__ import annotations

import argparse

import triton
import triton.language as tl


@triton.jit
def _stream(lo_ptr, out_ptr, KW, s_lo, BN: tl.constexpr, TW: tl.constexpr, STAGES: tl.constexpr):
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    jh = tl.arange(0, TW)
    acc = tl.zeros((BN, TW), dtype=tl.int32)
    for kw in tl.range(0, KW, TW, num_stages=STAGES):
        acc ^= tl.load(lo_ptr + rn[:, None] * s_lo + kw + jh[None, :]).to(tl.int32)
    tl.store(out_ptr + rn, tl.sum(acc, axis=1))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="28672x8192")
    ap.add_argument("--configs", required=True)
    a = ap.parse_args(argv)
    import torch

    from benchmarks.kernels_gpu import copies_for, graph_time

    N, K = (int(v) for v in a.shape.split("x"))
    base = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device="cuda")
    codes = [base] + [base.clone() for _ in range(copies_for(base.numel()) - 1)]
    out = torch.empty(N, dtype=torch.int32, device="cuda")
    for spec in a.configs.split(","):
        bn, nbytes, warps, stages, bits = (int(v) for v in spec.split(":"))
        views = [c.view(torch.int16 if bits == 16 else torch.int32) for c in codes]
        fns = [lambda v=v: _stream[(N // bn,)](v, out, v.shape[1], v.stride(0), BN=bn, TW=nbytes * 8 // bits,
                                               STAGES=stages, num_warps=warps) for v in views]
        t = graph_time(fns)
        print(f"BN {bn:4d}, {nbytes:5d} bytes a row, {warps} warps, {stages} stages, int{bits}: "
              f"{t * 1e6:6.1f} us, {base.numel() / t / 1e12:.2f} TB/s", flush=True)


if __name__ == "__main__":
    main()
