"""A prompt chunk through one MoE layer's routed experts on the GPU: the grouped paths
(GPUStackedExperts._grouped, dispatch.grouped_experts), fused (dispatch.MOE_FUSED: the experts'
quantized weights read straight into the tensor cores, one launch a projection) and written out (slabs
of experts dequantized to bf16 for torch's grouped GEMM), against the loop over chosen experts they
replaced (one packed_linear per projection and expert, its rows found on the device) and against
the (token, expert) pairs that shorter chunks take (up to GPUStackedExperts.PAIRS_ROWS), V2-Lite's
shape (64 experts, top 6, hidden 2048, 1408 intermediate rows an expert: gate/up Q4_K, down Q8_0, as a
Q4_K_M file keeps a weight whose rows of 1408 are no whole K-quant blocks), random blocks, random routing.

    python -m benchmarks.moe_prefill [--tokens 512,128] [--repeat 10]

Prints each path's best wall ms a call (synced), the others' time over the fused path's, and each path's largest difference from the loop relative to the loop's largest output
(the pairs round x to int8 as the decode GEMV does) (docs/benchmarks.md#the-gpu-claims-in-three-device-calls).
"""

from __future__ import annotations

import argparse
import time


def _loop(moe, x, ids, w):
    """The loop the grouped GEMMs replaced: each chosen expert's rows found by nonzero (a host sync),
    its three GEMMs, weighted and added into its tokens."""
    import torch

    from dsq.kernels import dispatch
    from dsq.models.base import act_mul

    N = {name: moe.weight(name).N // moe.n_expert for name in ("gate_up", "down")}
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        rows, slot = (ids == e).nonzero(as_tuple=True)
        g, u = dispatch.packed_linear(x[rows], moe.weight("gate_up").rows(e * N["gate_up"], (e + 1) * N["gate_up"])
                                      ).chunk(2, dim=-1)
        y = dispatch.packed_linear(act_mul(moe.act, g, u), moe.weight("down").rows(e * N["down"], (e + 1) * N["down"]))
        out.index_add_(0, rows, (y * w[rows, slot, None]).to(out.dtype))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="512,128")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--device", default="cuda", help="cpu: a check of the script (the loop's path both ways)")
    a = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from dsq.kernels import dispatch, packed
    from dsq.models.deepseek_model import GPUStackedExperts

    E, k, H, inter = 64, 6, 2048, 1408
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def blocks(qtype, rows, K):
        per, nbytes = {"Q4_K": (256, 144), "Q8_0": (32, 34)}[qtype]
        raw = torch.randint(0, 64, (rows, K // per * nbytes), dtype=torch.uint8)  # small bytes: finite fp16 scales
        return packed.from_gguf(raw, qtype, K, device=dev)

    moe = GPUStackedExperts(blocks("Q4_K", E * 2 * inter, H), None, None, blocks("Q8_0", E * H, inter), E, F.silu,
                            "random")
    for T in (int(t) for t in a.tokens.split(",")):
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16) * 0.1
        ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(T)])
        w = torch.rand(T, k, device=dev)
        moe.PAIRS_ROWS = T  # a call of T rows takes the pairs; _grouped is called directly
        def grouped(fused):
            def run():
                dispatch.MOE_FUSED = fused
                try:
                    return moe._grouped(x, ids, w, None)
                finally:
                    dispatch.MOE_FUSED = True
            return run

        runs = {"fused": grouped(True), "written out": grouped(False), "loop": lambda: _loop(moe, x, ids, w),
                "pairs": lambda: moe(x, ids, w)}
        best, outs = {}, {}
        for name, fn in runs.items():
            outs[name] = fn()  # compiles
            sync()
            ts = []
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                fn()
                sync()
                ts.append(time.perf_counter() - t0)
            best[name] = 1e3 * min(ts)
        ref = outs["loop"].float()
        diff = {n: float((o.float() - ref).abs().max() / ref.abs().max()) for n, o in outs.items() if n != "loop"}
        f = best["fused"]
        print(f"{T} tokens: fused {f:.2f} ms, " + ", ".join(f"{n} {best[n]:.2f} ms ({best[n] / f:.1f}x)" for n in
                                                          ("written out", "loop", "pairs"))
              + "; largest difference from the loop, of its largest output: "
              + ", ".join(f"{n} {d:.1e}" for n, d in diff.items()), flush=True)
    from dsq.kernels.triton_common import autotune_choices

    for kernel, picks in autotune_choices().items():  # which tiles the fused kernels' autotuner chose
        if "grouped" in kernel:
            for key, cfg in picks.items():
                print(f"{kernel} [{key}]: {cfg}")


if __name__ == "__main__":
    main()
