"""Batched decode speed on a GPU: B sequences at a time through NativeModel.generate_batch.

decode_gpu's model (random weights, no file, no tokenizer) in one format; each batch size's step
is captured once.

    python -m benchmarks.batch_gpu [--format q4_k_m] [--batch 2,4,8,16] [--compile] [--q6k-gemm]

--q6k-gemm times each batch size again with Q5/Q6_K above one row sent to their tl.dot GEMM
instead of their routes in kernels/dispatch.py (one int8-x GEMV a row at 2-4 rows, the bf16 weight
through cuBLAS from 5), the step captured again for it, and then the dispatcher's routes once
more, so a machine's drift between the runs shows (docs/benchmarks.md#batched-decode).
"""

from __future__ import annotations

import argparse

from benchmarks.decode_gpu import FORMATS
from dsq.bench.random_models import SHAPES


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--format", default="q4_k_m", choices=FORMATS)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batch", default="2,4,8,16")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=48)
    ap.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    ap.add_argument("--q6k-gemm", action="store_true", help="also time Q5/Q6_K above one row on their tl.dot GEMM")
    a = ap.parse_args(argv)
    import torch

    from benchmarks.decode_gpu import NullTokenizer, to_format
    from dsq.bench.random_models import random_transformer
    from dsq.kernels import dispatch
    from dsq.runtime.generate import GenStats
    from dsq.runtime.native import NativeModel
    from dsq.runtime.sampling import SamplingParams

    model, _ = random_transformer(a.shape)
    to_format(model, a.format)
    model.fuse_projections()
    nm = NativeModel.from_model(model, {"model_type": "llama"}, NullTokenizer(), n_ctx=max(1024, a.prompt_tokens + a.gen_tokens),
                                gpu_layers=-1, cuda_graph=True, fuse=False, compile="default" if a.compile else False)
    current = dispatch.gpu_kernel

    def gemm(p, rows, dtype):  # Q5/Q6_K above one row: their tl.dot GEMM
        kind = current(p, rows, dtype)
        return "float" if p.fmt.hi_bits and kind in ("q8_rows", "dequant") and rows < dispatch.DEQUANT_MIN_ROWS else kind

    routes = [("current", current)] + ([("Q5/Q6_K GEMM", gemm), ("current again", current)] if a.q6k_gemm else [])
    g = torch.Generator().manual_seed(0)
    greedy = SamplingParams(temperature=0.0)
    try:
        for B in (int(b) for b in a.batch.split(",")):
            prompts = [torch.randint(100, 30000, (a.prompt_tokens,), generator=g).tolist() for _ in range(B)]
            cells = []
            for name, route in routes:
                dispatch.gpu_kernel = route
                nm._batch = None  # capture this route's step
                nm.generate_batch(prompts, greedy, 8, ignore_eos=True)
                st = GenStats()
                nm.generate_batch(prompts, greedy, a.gen_tokens, ignore_eos=True, stats=st)
                cells.append(f"{name} {st.decode_tok_s:7.1f} tok/s ({st.tpot_ms:.2f} ms a step)")
            print(f"batch {B:3}: " + "   ".join(cells), flush=True)
    finally:
        dispatch.gpu_kernel = current


if __name__ == "__main__":
    main()
