"""What the GPU's int8-activation GEMV costs in quality: the same model with and without every
quantized matmul's input rounded to int8 per 32 elements (what `_gemv_q8` computes,
kernels/packed.py linear_ref_q8), scored on real text. Runs on the CPU (the rounding is emulated
in torch around dsq's C kernels), on the built-in model by default.

    python -m benchmarks.act_q8 [--model PATH.gguf] [--tokens 2048] [--ctx 256] [--json out.json]

Reports perplexity with x in float32, rounded to int8 per 32, and rounded to bf16 (what a bf16
model's matmuls see anyway: the yardstick), and per position the KL divergence of each from
the float32 one and how often their top-1 tokens agree.
"""

from __future__ import annotations

import argparse
import json
import math
from contextlib import contextmanager

import torch


@contextmanager
def rounded_activations(how: str = "int8", qtypes: set[str] | None = None):
    """Inside: every GGUF matmul (of `qtypes`, or all) sees x rounded to int8 per 32 elements
    (how="int8", the GPU's int8-activation GEMV) or to bf16 (how="bf16", what a bf16 model's
    matmuls see anyway: the yardstick)."""
    from dsq.kernels import dispatch, packed

    orig = dispatch.gguf_linear

    def rounded(x, raw, qtype, in_features, bias=None):
        if (qtypes is None or qtype in qtypes) and in_features % 32 == 0:
            x = (packed.dequantize_x_q8(x) if how == "int8" else x.to(torch.bfloat16)).to(x.dtype)
        return orig(x, raw, qtype, in_features, bias)

    dispatch.gguf_linear = rounded
    try:
        yield
    finally:
        dispatch.gguf_linear = orig


def compare(model, ids: list[int], ctx: int, qtypes: set[str] | None = None) -> dict:
    """Float x against int8 x and against bf16 x, window by window (ctx tokens each)."""
    r = {"tokens": 0, "ppl_float": 0.0}
    for how in ("int8", "bf16"):
        r.update({f"ppl_{how}x": 0.0, f"kld_{how}x": 0.0, f"top1_{how}x": 0.0})
    for s in range(0, len(ids) - ctx + 1, ctx):
        win = ids[s:s + ctx]
        t = torch.tensor(win[1:])
        lf = torch.from_numpy(model.logits(win)).double().log_softmax(-1)[:-1]
        r["ppl_float"] -= float(lf.gather(1, t[:, None]).sum())
        for how in ("int8", "bf16"):
            with rounded_activations(how, qtypes):
                lq = torch.from_numpy(model.logits(win)).double().log_softmax(-1)[:-1]
            r[f"ppl_{how}x"] -= float(lq.gather(1, t[:, None]).sum())
            r[f"kld_{how}x"] += float((lf.exp() * (lf - lq)).sum())
            r[f"top1_{how}x"] += int((lf.argmax(-1) == lq.argmax(-1)).sum())
        r["tokens"] += len(t)
    n = r["tokens"]
    if n == 0:
        raise ValueError(f"need at least {ctx} tokens")
    for k in list(r):
        if k.startswith("ppl_"):
            r[k] = math.exp(r[k] / n)
        elif k != "tokens":
            r[k] /= n
    return r


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a GGUF (default: the built-in model)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    import pydoc_data.topics

    from dsq.runtime.engine import load

    model = load(a.model, backend="native", ctx=a.ctx)
    text = "\n\n".join(pydoc_data.topics.topics.values())
    ids = model.tokenize(text)[: a.tokens]
    r = compare(model, ids, a.ctx)
    print(f"{r['tokens']} tokens, perplexity with float x {r['ppl_float']:.4f}")
    for how in ("int8", "bf16"):
        print(f"  x rounded to {how:4}: perplexity {r[f'ppl_{how}x']:.4f} "
              f"({(r[f'ppl_{how}x'] / r['ppl_float'] - 1) * 100:+.2f}%), mean KL from float x "
              f"{r[f'kld_{how}x']:.2e}, top-1 agreement {r[f'top1_{how}x']:.2%}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
