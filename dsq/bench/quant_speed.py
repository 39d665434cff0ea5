"""Wall time and peak memory of dsq's calibrated quantizers on a random-weight model.

    python -m dsq.bench.quant_speed --shape llama3-8b --methods gptq,awq --samples 128 --seq-len 2048

Writes a random bf16 HF directory of the given shape (once), then quantizes it layer by layer
with each method, timing the whole `quantize_model` call and reading the peak GPU memory
(torch's allocator) and peak process RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch


def write_random_model(shape: str, out: Path, layers: int | None = None) -> Path:
    from safetensors.torch import save_file

    from dsq.bench.decode_gpu import SHAPES
    from dsq.models.base import ModelArgs, Transformer

    if (out / "config.json").is_file():
        return out
    s = dict(SHAPES[shape])
    if layers:
        s["num_hidden_layers"] = layers
    args = ModelArgs(**s)
    out.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = Transformer(args)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # random numbers for 8B weights: seconds on a GPU
    g = torch.Generator(device=dev).manual_seed(0)
    shard, n, index = {}, 0, {}

    def flush():
        nonlocal shard, n
        name = f"model-{n:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        index.update({k: name for k in shard})
        shard, n = {}, n + 1

    for name, p in model.named_parameters():
        if name == "lm_head.weight" and args.tie_word_embeddings:
            continue
        t = torch.randn(p.shape, generator=g, device=dev)
        t = (1 + 0.05 * t) if "norm" in name else 0.02 * t
        shard[name] = t.to(torch.bfloat16).cpu()
        if sum(x.numel() for x in shard.values()) > 1_000_000_000:
            flush()
    if shard:
        flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    cfg = {"model_type": "qwen2" if shape.startswith("qwen2") else "llama", "architectures": ["LlamaForCausalLM"],
           "hidden_size": s["hidden_size"], "intermediate_size": s["intermediate_size"],
           "num_hidden_layers": s["num_hidden_layers"], "num_attention_heads": s["num_attention_heads"],
           "num_key_value_heads": s["num_key_value_heads"], "head_dim": s["head_dim"], "vocab_size": s["vocab_size"],
           "rms_norm_eps": s["rms_norm_eps"], "max_position_embeddings": s["max_position_embeddings"],
           "rope_scaling": {k: v for k, v in s["rope"].items() if k != "rope_theta"}, "rope_theta": s["rope"]["rope_theta"],
           "tie_word_embeddings": s.get("tie_word_embeddings", False), "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--methods", default="gptq,awq")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--work", default="/tmp/dsq-quant-speed")
    ap.add_argument("--layers", type=int, help="override the shape's layer count (quick profiles)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    from dsq.quant import driver
    from dsq.quant.driver import QuantSpec, quantize_model

    work = Path(a.work)
    t = time.perf_counter()
    src = write_random_model(a.shape, work / a.shape, a.layers)
    print(f"random {a.shape} written in {time.perf_counter() - t:.0f}s", flush=True)
    rows = []
    for method in a.methods.split(","):
        spec = QuantSpec(method, calib="random", calib_samples=a.samples, calib_seq_len=a.seq_len)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        driver.PHASES.clear()
        quantize_model(src, work / f"{a.shape}-{method}", spec, force=True,
                       on_block=lambda i, n, dt: print(f"  {method} block {i}/{n} {dt:.1f}s", flush=True) if i % 8 == 0 else None)
        secs = time.perf_counter() - t
        row = {"method": method, "seconds": round(secs, 1), "samples": a.samples, "seq_len": a.seq_len,
               "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else 0,
               "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
               "phases_s": {k: round(v, 1) for k, v in driver.PHASES.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps({"shape": a.shape, "rows": rows}, indent=2))
    print(f"\n{a.shape}, {a.samples} x {a.seq_len} calibration tokens, "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}")
    print(f"{'method':8} {'wall s':>8} {'peak GPU GiB':>13} {'peak RSS GiB':>13}")
    for r in rows:
        print(f"{r['method']:8} {r['seconds']:8.1f} {r['peak_gpu_gib']:13.2f} {r['peak_rss_gib']:13.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"shape": a.shape, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
