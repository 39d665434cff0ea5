"""Where a native model's VRAM goes, at each split, measured as `dsq bench` measures its peak
(device-wide, above the CUDA context): after load, the GPU tensors by part (token embedding,
layers, final norm + output head, KV cache) against torch's allocated and reserved bytes and the
device's used bytes; then one bench-shaped generation (prompt, then greedy tokens), with the peak
allocated / reserved / device figures it reached. device - reserved is memory outside torch's
allocator (kernel images, library workspaces); peak allocated - allocated after load is the
prompt's and the step's transient buffers; graph_pools_reserved is what the captured steps' private
pools hold (after the generation). A host-mapped embedding (runtime/host_mapped.py) counts
in `embed` but not in VRAM.

    python -m benchmarks.vram_parts MODEL.gguf --gpu-layers 0,8,24,all [--prompt-tokens 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os


def _gpu_bytes(module) -> int:
    seen, n = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t.is_cuda and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            n += t.numel() * t.element_size()
    return n


def _private_pool_bytes() -> int:
    """Bytes torch's allocator reserves in private pools (the captured CUDA graphs' memory), which
    no allocation outside the graph can reuse."""
    import torch

    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot() if tuple(seg.get("segment_pool_id", (0, 0)))
               != (0, 0))


def parts(nm) -> dict[str, int]:
    """GPU bytes of the native model's parts."""
    m = nm.model
    cache = sum(t.numel() * t.element_size() for t in list(nm.cache.k) + list(nm.cache.v) if t.is_cuda)
    return {"embed": _gpu_bytes(m.model.embed_tokens), "layers": _gpu_bytes(m.model.layers),
            "norm_head": _gpu_bytes(m.model.norm) + _gpu_bytes(m.lm_head), "kv_cache": cache}


def one(model: str, gl: str, prompt_tokens: int, gen_tokens: int, threads: int | None) -> dict:
    import torch

    from dsq.bench.metrics import PeakMemory, gpu_used_bytes, release_memory
    from dsq.bench.runner import _generate, bench_ctx, bench_prompts
    from dsq.runtime.engine import load
    from dsq.runtime.sampling import SamplingParams

    mib = lambda b: round(b / 2**20)  # noqa: E731
    release_memory()
    torch.cuda.reset_peak_memory_stats()
    base = gpu_used_bytes() or 0
    a0 = torch.cuda.memory_allocated()
    with PeakMemory(baseline_gpu=base) as lm:
        nm = load(model, backend="native", ctx=bench_ctx(None, prompt_tokens, gen_tokens), threads=threads,
                  gpu_layers=gl)
    torch.cuda.synchronize()
    rec = {"gpu_layers": gl, "load_peak_allocated": mib(torch.cuda.max_memory_allocated() - a0),
           "load_peak_reserved": mib(torch.cuda.max_memory_reserved()),
           "load_peak_device": mib(lm.peak_gpu or 0), "allocated": mib(torch.cuda.memory_allocated() - a0),
           "reserved": mib(torch.cuda.memory_reserved()), "device": mib((gpu_used_bytes() or 0) - base)}
    rec.update({k: mib(v) for k, v in parts(nm).items()})
    torch.cuda.reset_peak_memory_stats()
    prompts = bench_prompts(nm, prompt_tokens, 1)
    greedy = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
    with PeakMemory(baseline_gpu=base) as gm:
        nm.reset()
        _generate(nm, prompts, greedy, gen_tokens)
    torch.cuda.synchronize()
    rec["graph_pools_reserved"] = mib(_private_pool_bytes())
    rec.update({"gen_peak_allocated": mib(torch.cuda.max_memory_allocated() - a0),
                "gen_peak_reserved": mib(torch.cuda.max_memory_reserved()), "gen_peak_device": mib(gm.peak_gpu or 0),
                "after_allocated": mib(torch.cuda.memory_allocated() - a0),
                "after_reserved": mib(torch.cuda.memory_reserved()),
                "after_device": mib((gpu_used_bytes() or 0) - base)})
    del nm
    release_memory()
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--gpu-layers", default="0,8,24,all")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from dsq.bench.metrics import cuda_context_bytes

    ctx = cuda_context_bytes()
    print(f"CUDA context: {ctx / 2**20:.0f} MiB; alloc conf {os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}")
    recs = []
    for gl in a.gpu_layers.split(","):
        r = one(a.model, gl, a.prompt_tokens, a.gen_tokens, a.threads)
        recs.append(r)
        print("  ".join(f"{k}={v}" for k, v in r.items()), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "context_mib": round((ctx or 0) / 2**20), "splits": recs}, f, indent=1)


if __name__ == "__main__":
    main()
