"""The quality table: every quantization dsq makes of one model, scored against its float source.

    python -m benchmarks.quality_table --out docs/results/quality-builtin.json
    python -m benchmarks.quality_table --model DIR --ctx 256 --rows "RTN int4 g128,..." --out x.json

Default model: the built-in Gemma 3 270M, whose bf16 export is the reference. Each row is made
by dsq (`dsq quantize`), then scored by `dsq eval` on held-out text (never seen in calibration):
perplexity, its increase over the reference, mean KLD and top-1 agreement.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

# each row: `dsq quantize`'s options, by their flag names
ROWS = [
    ("Q8_0", dict(method="gguf", qtype="Q8_0")),
    ("Q6_K", dict(method="gguf", qtype="Q6_K")),
    ("Q5_K_M", dict(method="gguf", qtype="Q5_K_M")),
    ("Q4_K_M", dict(method="gguf", qtype="Q4_K_M")),
    ("Q4_K_M + imatrix", dict(method="gguf", qtype="Q4_K_M", imatrix=True)),
    ("Q3_K_M", dict(method="gguf", qtype="Q3_K_M")),
    ("Q2_K", dict(method="gguf", qtype="Q2_K")),
    ("RTN int4 g128", dict(method="rtn", bits=4)),
    ("AWQ int4 g128", dict(method="awq", bits=4)),
    ("GPTQ int4 g128", dict(method="gptq", bits=4)),
    ("GPTQ int4 g128 act-order", dict(method="gptq", bits=4, act_order=True)),
    ("FP8 channel", dict(method="fp8", fp8_scheme="channel")),
    ("FP8 block 128", dict(method="fp8", fp8_scheme="block")),
]


def block_bits_per_weight(path: Path, src: Path | None = None) -> float:
    """Bits per weight of the decoder blocks' Linear layers (what quantization changes); for an
    HF directory, the weights counted in `src` (the float source) where given."""
    if path.is_file():
        from dsq.formats.gguf_file import GGUFFile

        ts = [t for t in GGUFFile(path).tensors if t.name.startswith("blk.") and len(t.shape) == 2]
        return 8 * sum(t.n_bytes for t in ts) / sum(t.n_elements for t in ts)
    from dsq.formats.hf import HFModelDir

    hf = HFModelDir(path)
    cfg = hf.config
    n_bytes = n_weights = 0
    for name, t in hf.mmap_tensors().items():
        if not name.startswith("model.layers.") or "norm" in name or name.endswith(".bias"):
            continue
        n_bytes += t.numel() * t.element_size()
    if src is not None:  # any layout (MLA, experts): the source's 2-D block weights
        n_weights = sum(t.numel() for name, t in HFModelDir(src).mmap_tensors().items()
                        if name.startswith("model.layers.") and t.ndim == 2 and "norm" not in name)
        return 8 * n_bytes / n_weights
    h, f, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, (cfg.get("num_key_value_heads") or cfg["num_attention_heads"]) * hd
    n_weights = L * (h * q + 2 * h * kv + q * h + 3 * h * f)
    return 8 * n_bytes / n_weights


def make(row: dict, src: Path, work: Path, name: str, calib_samples: int) -> Path:
    """Row `name`, made by `dsq.quant.quantize` under `work`: a .gguf file or an HF directory."""
    from dsq.quant import quantize
    from dsq.quant.registry import spec_from_options

    spec = spec_from_options({**row, "calib_samples": calib_samples})
    out = work / (name.replace(" ", "_").replace("+", "plus") + Path(spec.impl.output_name(spec)).suffix)
    return quantize(src, out, spec, force=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF float model (default: the built-in model's bf16 export)")
    ap.add_argument("--work", default="/tmp/dsq-quality", help="where the artifacts are written")
    ap.add_argument("--rows", help="comma list of row names to run (default: all)")
    ap.add_argument("--calib-samples", type=int, default=128)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--ctx", type=int, default=512, help="evaluation window (at most the model's context)")
    ap.add_argument("--out", help="JSON results (rows are added as they finish)")
    a = ap.parse_args(argv)

    from dsq.eval.quality import evaluate

    if a.model:
        src = Path(a.model)
    else:
        from dsq.runtime.builtin import builtin_hf_export

        src = builtin_hf_export()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    wanted = set(a.rows.split(",")) if a.rows else None
    results = json.loads(Path(a.out).read_text()) if a.out and Path(a.out).is_file() else {"rows": []}
    results.update(model=str(src), eval_tokens=a.eval_tokens, calib_samples=a.calib_samples, ctx=a.ctx)
    base = evaluate(str(src), None, ctx=a.ctx, max_tokens=a.eval_tokens)
    results["reference_perplexity"] = base["perplexity"]
    print(f"reference {src.name}: perplexity {base['perplexity']:.4f}", flush=True)
    for name, row in ROWS:
        if wanted and name not in wanted:
            continue
        t0 = time.perf_counter()
        path = make(row, src, work, name, a.calib_samples)
        made_s = time.perf_counter() - t0
        r = evaluate(str(path), str(src), ctx=a.ctx, max_tokens=a.eval_tokens)
        size = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        rec = {"name": name, "size_mib": round(size / 2**20, 1), "block_bpw": round(block_bits_per_weight(path, src), 2),
               "perplexity": round(r["perplexity"], 4), "delta_ppl": round(r["perplexity"] - base["perplexity"], 4),
               "delta_ppl_pct": round(100 * (r["perplexity"] / base["perplexity"] - 1), 2),
               "kld": round(r["kld"], 5), "top1": round(r["top1_agreement"], 4), "tokens": r["tokens"],
               "seconds_to_make": round(made_s, 1), "backend": r["backend"]}
        results["rows"] = [x for x in results["rows"] if x["name"] != name] + [rec]
        print(json.dumps(rec), flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps(results, indent=2))
    order = {n: i for i, (n, _) in enumerate(ROWS)}
    rows = sorted(results["rows"], key=lambda x: order.get(x["name"], 99))
    print("\n| quantization | size MiB | bits/weight (blocks) | perplexity | Δppl | KLD | top-1 |\n|---|---|---|---|---|---|---|")
    print(f"| bf16 (reference) | | 16 | {base['perplexity']:.3f} | | | |")
    for x in rows:
        print(f"| {x['name']} | {x['size_mib']} | {x['block_bpw']} | {x['perplexity']:.3f} | {x['delta_ppl']:+.3f} "
              f"({x['delta_ppl_pct']:+.1f}%) | {x['kld']:.4f} | {100 * x['top1']:.1f}% |")


if __name__ == "__main__":
    main()
