"""How much does one C call per CPU decoder layer (dsq_layer_decode, dsq/runtime/fused_layer.py) save
against the op-by-op eager decode step, per layer and for a whole step?

    python -m benchmarks.layer_decode [--shape llama3-8b] [--layers 32] [--threads N] [--json out.json]
    python -m benchmarks.layer_decode --gguf MODEL.gguf [--gpu-layers 8] [--threads N]

Without --gguf: random GGUF blocks of the shape in llama.cpp's Q4_K_M mix (q/k/o/gate/up Q4_K, v and
down Q6_K where llama.cpp gives them more bits, dsq.bench.random_gguf's rule), built in memory
(~132 MB a layer at 8B), an 8B output head in Q6_K and a 256-token float embedding (not timed:
the decode step starts after it). Times, at cache position --pos, one layer (forward_layers over
layer 0) and the whole step (--layers layers, final norm, head), each fused and op by op, medians
and best of --repeat calls, the two variants alternated call by call. With --gguf: the file through NativeModel (all on
the CPU, or split with --gpu-layers, where the CPU part is what changes), its real decode step
(`_decode`) timed both ways. Prints ms per layer and per step, their ratio, and the largest
difference between the two variants' logits relative to the largest logit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch


def _build(shape: str, layers: int, seed: int = 0):
    from dsq.bench.random_gguf import random_blocks, tensor_type
    from dsq.bench.random_models import SHAPES
    from dsq.models.base import ModelArgs, Transformer
    from dsq.runtime.qmodules import GGUFLinear

    cfg = dict(SHAPES[shape])
    n_file = cfg["num_hidden_layers"]
    args = ModelArgs(**{**cfg, "num_hidden_layers": layers})
    with torch.device("meta"):
        model = Transformer(args)
    rng = np.random.default_rng(seed)
    gguf = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
            "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}

    def linear(old, qtype):
        m = GGUFLinear(qtype, old.in_features, old.out_features, bias=old.bias is not None)
        m.raw.copy_(torch.from_numpy(random_blocks(qtype, old.out_features, old.in_features, rng)))
        if old.bias is not None:
            m.bias = torch.nn.Parameter(torch.randn(old.out_features) * 0.02, requires_grad=False)
        return m

    for i, layer in enumerate(model.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name, g in gguf.items():
                if name in parent._modules:
                    qtype = tensor_type("Q4_K_M", f"blk.{i}.{g}.weight", n_file)
                    setattr(parent, name, linear(parent._modules[name], qtype))
    for name, m in list(model.named_modules()):
        if type(m).__name__ == "RMSNorm":
            m.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(m.weight.shape[0]), requires_grad=False)
    model.model.embed_tokens = torch.nn.Embedding(256, args.hidden_size)
    model.lm_head = linear(model.lm_head, "Q6_K")
    model.fuse_projections()
    return model


def _race(variants: dict, repeat: int) -> dict:
    """ms of each variant (name -> (set up, run)): the calls alternate variant by variant, `repeat`
    of each after 3 warm-ups, so load from other processes hits both alike. Returns
    {"median": {name: ms}, "best": {name: ms}} (best: the least disturbed call)."""
    ts = {k: [] for k in variants}
    for r in range(repeat + 3):
        for name, (setup, fn) in variants.items():
            setup()
            t = time.perf_counter()
            fn()
            if r >= 3:
                ts[name].append(1e3 * (time.perf_counter() - t))
    return {"median": {k: statistics.median(v) for k, v in ts.items()}, "best": {k: min(v) for k, v in ts.items()}}


def synthetic(a) -> dict:
    from dsq.runtime.fused_layer import attach

    t = time.perf_counter()
    model = _build(a.shape, a.layers)
    n = attach(model)
    print(f"{a.shape}: {a.layers} layers of random Q4_K_M blocks built in {time.perf_counter() - t:.1f} s; "
          f"{n} covered by the fused call; {torch.get_num_threads()} threads")
    fused = model._fused_decode
    cache = model.make_cache(1, a.pos + 8, torch.float32)
    pad = torch.zeros(1, dtype=torch.long)
    slots = torch.tensor([a.pos])
    tok = torch.tensor([[7]])
    x = model.embed(tok)

    def on():
        model._fused_decode = fused

    def off():
        model._fused_decode = None

    with torch.inference_mode():
        layer = _race({"fused": (on, lambda: model.forward_layers(x, 0, 1, slots, cache, pad, a.pos + 1)),
                       "op by op": (off, lambda: model.forward_layers(x, 0, 1, slots, cache, pad, a.pos + 1))},
                      a.repeat)
        step = _race({"fused": (on, lambda: model(tok, slots, cache, pad, kv_len=a.pos + 1, last_only=True)),
                      "op by op": (off, lambda: model(tok, slots, cache, pad, kv_len=a.pos + 1, last_only=True))},
                     max(3, a.repeat // 3))
        on()
        got = model(tok, slots, cache, pad, kv_len=a.pos + 1, last_only=True)
        off()
        want = model(tok, slots, cache, pad, kv_len=a.pos + 1, last_only=True)
        on()
    rel = float((got - want).abs().max() / want.abs().max())
    return {"shape": a.shape, "layers": a.layers, "pos": a.pos, "threads": torch.get_num_threads(),
            "isa": _isa(), "layer_ms": layer, "step_ms": step, "logits_rel_diff": rel}


def from_gguf(a) -> dict:
    from dsq.runtime.native import NativeModel

    nm = NativeModel(a.gguf, "gguf", n_ctx=a.pos + 64, gpu_layers=a.gpu_layers, threads=a.threads)
    model = nm.model
    fused = model._fused_decode
    n_cpu = sum(d.type == "cpu" for d in model.layer_devices())
    print(f"{a.gguf}: {n_cpu} CPU layers, {nm.fused_layers} covered by the fused call; "
          f"{torch.get_num_threads()} threads")
    pad = torch.zeros(1, dtype=torch.long, device="cuda" if nm._graph is not None else None)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    with torch.inference_mode():
        nm._prefill(list(range(3, 3 + a.pos)), 0, nm.cache, pad)
        tok = torch.tensor([7], device=nm.head_device)

        def step():
            out = nm._decode(tok, a.pos, nm.cache, pad)
            sync()
            return out

        def on():
            model._fused_decode = fused

        def off():
            model._fused_decode = None

        ms = _race({"fused": (on, step), "op by op": (off, step)}, a.repeat)
        on()
        got = step().float().cpu()
        off()
        want = step().float().cpu()
        on()
    rel = float((got - want).abs().max() / want.abs().max())
    return {"gguf": str(a.gguf), "gpu_layers": a.gpu_layers, "cpu_layers": n_cpu, "covered": nm.fused_layers,
            "pos": a.pos, "threads": torch.get_num_threads(), "isa": _isa(), "step_ms": ms, "logits_rel_diff": rel}


def _isa() -> str:
    from dsq.kernels import cpu

    return cpu.library()[1]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--layers", type=int, default=32, help="decoder layers in the synthetic step")
    p.add_argument("--gguf", default=None, help="time this file's real decode step instead")
    p.add_argument("--gpu-layers", default="0", help="with --gguf: layers on the GPU (the CPU part is timed)")
    p.add_argument("--pos", type=int, default=64, help="cache position of the timed token")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    r = from_gguf(a) if a.gguf else synthetic(a)
    n = r.get("covered", r.get("layers"))
    for stat in ("median", "best"):
        if "layer_ms" in r:
            lf, lo = r["layer_ms"][stat]["fused"], r["layer_ms"][stat]["op by op"]
            print(f"one layer, {stat:6}: fused {lf:8.3f} ms   op by op {lo:8.3f} ms   ratio {lo / lf:5.2f}x   "
                  f"saved {lo - lf:6.3f} ms")
        f, o = r["step_ms"][stat]["fused"], r["step_ms"][stat]["op by op"]
        print(f"step, {stat:6}:      fused {f:8.2f} ms   op by op {o:8.2f} ms   ratio {o / f:5.2f}x   "
              f"saved {(o - f) / max(n, 1):6.3f} ms a covered layer ({n})")
    print(f"logits: largest difference {r['logits_rel_diff']:.2e} of the largest logit; build {r['isa']}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(r, fh, indent=2)


if __name__ == "__main__":
    main()
