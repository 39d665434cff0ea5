"""Where a DeepSeek decode step's time goes, per layer and per part, with the routed experts on the
GPU or in RAM (--experts), and what that projects to for a full-depth model.

    python -m benchmarks.moe_layers V3SLICE.gguf --experts cpu,gpu [--threads N] [--steps 16] [--json out.json]

For each placement (every layer and the head on the GPU, the experts where --experts says): greedy
decode tok/s over --steps tokens (the captured step where there is one), then the same steps
eagerly with a device sync around each part (so the parts add the syncs' and the eager launches'
cost; the tok/s figure has neither): per layer its attention, router,
routed experts (in RAM: the C call and the hidden state's trip, one sync), shared experts, or its
dense MLP; and the head. The routed experts' bytes a token reads (from the file's block types)
over their time gives the bandwidth the C kernel reached.

Projection (printed, not measured): a model of `--full-layers` layers, `--full-dense` of them dense,
as one dense layer of the slice times the dense count, one MoE layer times the rest, plus the
embedding and head; with the experts in RAM also at other CPU bandwidths (--cpu-bw, GB/s the
experts' C call would reach there, the GPU part as measured here): the experts' time scaled by
this host's reached bandwidth over that one. Its assumptions: the same per-layer work at every
depth (the cache as short as here), the GPU part's time unchanged on the smaller GPU that holds
it (a 24 GB card reads ~4.8x slower than an H200, which --gpu-slowdown scales).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.split_profile import _decode_rate, timing_hooks  # the same two-run greedy rate and hooks


def _parts(model) -> list[tuple[str, object]]:
    """(name, module) of every part timed: per layer attention and MLP pieces, then the head."""
    from dsq.models.deepseek_model import MoE

    out = []
    for i, layer in enumerate(model.model.layers):
        out.append((f"{i}.attention", layer.self_attn))
        if isinstance(layer.mlp, MoE):
            out += [(f"{i}.router", layer.mlp.gate), (f"{i}.experts", layer.mlp.experts)]
            if layer.mlp.shared_experts is not None:
                out.append((f"{i}.shared", layer.mlp.shared_experts))
            out.append((f"{i}.moe", layer.mlp))
        else:
            out.append((f"{i}.mlp", layer.mlp))
        out.append((f"{i}.layer", layer))
    return out + [("head", model.lm_head)]


def _part_times(m, prompt: list[int], steps: int) -> dict[str, float]:
    """Median ms per part over `steps` eager decode steps, a sync before and after each part (the
    experts in RAM then run one after the shared experts, not beside them: MoE.overlap)."""
    import torch

    from dsq.models.deepseek_model import MoE

    from dsq.runtime.generate import GenStats
    from dsq.runtime.sampling import SamplingParams

    marks, hooks = timing_hooks(_parts(m.model))
    MoE.overlap = False
    graph, m._graph = m._graph, None  # eager steps: the hooks see each part
    try:
        m.reset()
        with torch.inference_mode():
            for _ in m.stream(prompt, SamplingParams(temperature=0), steps, GenStats(), ignore_eos=True):
                pass
    finally:
        MoE.overlap, m._graph = True, graph
        for h in hooks:
            h.remove()
    n = len(prompt) and 1  # the prefill's marks come first: drop them
    return {k: statistics.median(v[n:]) for k, v in marks.items() if len(v) > n}


def _expert_bytes_per_token(path: Path) -> dict[int, float]:
    """Per MoE layer: bytes of routed experts a token reads (its n_used of n_expert)."""
    from dsq.runtime.model_shape import load_shape

    s = load_shape(path)
    return {i: e * s.n_expert_used / s.n_expert for i, e in enumerate(s.expert_bytes or []) if e}


def run(path: Path, experts: list[str], threads: int | None, steps: int, prompt_tokens: int) -> dict:
    from dsq.bench.runner import bench_prompt
    from dsq.runtime.native import NativeModel

    per_tok = _expert_bytes_per_token(path)
    out = {"model": path.name, "expert_bytes_per_token": per_tok, "placements": []}
    for ex in experts:
        m = NativeModel(path, "gguf", n_ctx=prompt_tokens + steps + 8, gpu_layers="all", threads=threads, experts=ex)
        prompt = bench_prompt(m, prompt_tokens)
        rate = _decode_rate(m, prompt, steps)
        parts = _part_times(m, prompt, steps)
        moe = [i for i in per_tok if f"{i}.experts" in parts]
        reached = [per_tok[i] / (parts[f"{i}.experts"] / 1e3) / 1e9 for i in moe]
        out["placements"].append({"experts": m.experts, "decode_tok_s": round(rate, 2), "part_ms": parts,
                                  # three significant figures: a tiny model's experts on a busy machine read well under 0.1 GB/s
                                  "expert_gb_s": float(f"{statistics.median(reached):.3g}") if reached else None})
        del m
    return out


def project(r: dict, full_layers: int, full_dense: int, cpu_bws: list[float], gpu_slowdown: float) -> list[dict]:
    """tok/s of a full-depth model from one placement's per-layer times (see the module docstring)."""
    rows = []
    for p in r["placements"]:
        t = p["part_ms"]
        dense = [t[k] for k in t if k.endswith(".layer") and f"{k.split('.')[0]}.mlp" in t]
        moe = [int(k.split(".")[0]) for k in t if k.endswith(".moe")]
        if not dense or not moe:
            continue
        d_ms = statistics.median(dense)
        moe_ms = statistics.median(t[f"{i}.layer"] for i in moe)
        exp_ms = statistics.median(t[f"{i}.experts"] for i in moe)
        rest = moe_ms - exp_ms  # attention, router, shared experts, norms on the GPU
        head = t.get("head", 0.0)

        def tok_s(experts_ms: float) -> float:
            gpu = (full_dense * d_ms + (full_layers - full_dense) * rest + head) * gpu_slowdown
            return 1e3 / (gpu + (full_layers - full_dense) * experts_ms)

        parts_ms = sum(t[k] for k in t if k.endswith(".layer")) + head
        row = {"experts": p["experts"], "dense_layer_ms": round(d_ms, 3), "moe_layer_ms": round(moe_ms, 3),
               "experts_ms": round(exp_ms, 3), "head_ms": round(head, 3),
               # the slice's step: as decoded (captured where it can be) and as its timed parts add up
               # (eager, a sync around each): the parts' overhead, which the projection carries too
               "slice_step_ms": round(1e3 / p["decode_tok_s"], 3) if p["decode_tok_s"] else None,
               "slice_parts_ms": round(parts_ms, 3),
               "projected_tok_s_here": round(tok_s(exp_ms), 2)}
        if p["experts"] == "cpu" and p["expert_gb_s"]:
            row["projected_tok_s_at_cpu_gb_s"] = {bw: round(tok_s(exp_ms * p["expert_gb_s"] / bw), 2)
                                                  for bw in cpu_bws}
        rows.append(row)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--experts", default="cpu,gpu")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--full-layers", type=int, default=61, help="the projected model's layers (V3 / R1: 61)")
    ap.add_argument("--full-dense", type=int, default=3, help="of which dense (V3 / R1: 3)")
    ap.add_argument("--cpu-bw", default="80,200,400", help="CPU bandwidths (GB/s) the experts' call would reach")
    ap.add_argument("--gpu-slowdown", type=float, default=1.0, help="the GPU part's time scaled by this")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    r = run(a.model, [e for e in a.experts.split(",") if e], a.threads, a.steps, a.prompt_tokens)
    r["projection"] = project(r, a.full_layers, a.full_dense, [float(b) for b in a.cpu_bw.split(",")],
                              a.gpu_slowdown)
    r["assumptions"] = (f"{a.full_layers} layers, {a.full_dense} dense; each layer as the slice's; the GPU part's "
                        f"time x {a.gpu_slowdown}; experts in RAM at the CPU bandwidths listed")
    for p in r["placements"]:
        print(f"== experts {p['experts']}: decode {p['decode_tok_s']} tok/s"
              + (f", routed experts read at {p['expert_gb_s']} GB/s" if p["expert_gb_s"] else ""))
        for k, v in p["part_ms"].items():
            print(f"   {k:16s} {v:8.3f} ms")
    for row in r["projection"]:
        print(f"projection ({r['assumptions']}): {row}")
    if a.json:
        a.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
