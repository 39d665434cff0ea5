"""The numbers in recipes/deepseek-v2-lite.yaml and recipes/deepseek-v3.yaml: the memory each format
needs and the `dsq offload` plan (native backend, `--experts auto`) for 24 / 48 / 80 GB GPUs.

    python -m benchmarks.deepseek_recipes

No weights are made: the tensor list is random_gguf's deepseek2 layout of the real config
(random_models.DEEPSEEK_SHAPES; V3 at its 61 layers, the first 3 dense), so the GGUF sizes come
from llama.cpp's block sizes (gguf_ref.row_bytes) at the types random_gguf gives each tensor. FP8
and AWQ sizes are by formula over the same tensors: FP8 block 1 byte a weight plus a float32 scale
per 128x128 block; AWQ int4 g128 half a byte plus a 16-bit scale and a 4-bit zero per 128. Both keep
the embedding, the output head, the norms, the routers and the recipe's `keep_16bit` layers 16-bit.
The plans go to placement.plan_placement as a ModelShape built from that tensor list, at the
bandwidths below (given, not measured: tok/s scales with the CPU figure when the experts are in RAM).
"""

from __future__ import annotations

import argparse
import json
import math

from dsq.bench.random_gguf import _deepseek_plan
from dsq.bench.random_models import deepseek_config
from dsq.kernels.gguf_ref import row_bytes
from dsq.runtime.machine import SPLIT_OVERHEAD_S, Bandwidths
from dsq.runtime.model_shape import ModelShape
from dsq.runtime.placement import GiB, plan_placement

GB = 1e9
# name -> (config, layers kept 16-bit by the recipe besides the routers)
MODELS = {
    "deepseek-v2-lite": (deepseek_config("deepseek-v2-lite"), set()),
    "deepseek-v3": (dict(deepseek_config("deepseek-v3-slice", 61), first_k_dense_replace=3), {0, 1, 2}),
}
# GPU size (GiB) -> its card's memory bandwidth: RTX 4090, RTX 6000 Ada, H100 PCIe
GPUS = {24: 1008e9, 48: 960e9, 80: 2000e9}
CPU_BW = 100e9  # a 4-channel DDR5 workstation's achieved read
RAMS = (64, 128, 256, 512)


def _layer(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("blk.") else None


def tensors(cfg: dict, mix: str) -> list[tuple[str, int, int]]:
    """[(GGUF name, weights, bytes in the GGUF file type `mix`)]."""
    out = []
    for name, shape, t in _deepseek_plan(cfg, mix):
        n = math.prod(shape)
        out.append((name, n, 4 * n if t == "F32" else math.prod(shape[:-1]) * row_bytes(t, shape[-1])))
    return out


def weight_bytes(cfg: dict, fmt: str, keep: set[int]) -> int:
    """Bytes of the whole model in `fmt` (bf16, fp8, q8_0, q4_k_m, awq_int4)."""
    if fmt in ("q8_0", "q4_k_m"):
        return sum(b for _, _, b in tensors(cfg, fmt.upper()))
    total = 0
    for name, n, _ in tensors(cfg, "Q8_0"):
        wide = (name.endswith(("norm.weight", ".bias")) or "ffn_gate_inp" in name or
                name in ("token_embd.weight", "output.weight") or _layer(name) in keep)
        if fmt == "bf16" or wide:
            total += 2 * n
        elif fmt == "fp8":
            total += n + 4 * math.ceil(n / (128 * 128))
        elif fmt == "awq_int4":
            total += n // 2 + n // 128 * 2 + n // 256
        else:
            raise ValueError(fmt)
    return total


def active_params(cfg: dict) -> tuple[int, int]:
    """(total, per token) weights: a token runs n_active of n_routed experts."""
    total = active = 0
    for name, n, _ in tensors(cfg, "Q8_0"):
        total += n
        active += n * cfg["num_experts_per_tok"] // cfg["n_routed_experts"] if "_exps." in name else n
    return total, active


def model_shape(name: str, cfg: dict, mix: str = "Q4_K_M") -> ModelShape:
    """What shape_from_gguf would read from the model's `mix` GGUF."""
    L = cfg["num_hidden_layers"]
    layers: list[dict[str, int]] = [{} for _ in range(L)]
    experts = [0] * L
    embed = output = misc = 0
    types = {n: t for n, _, t in _deepseek_plan(cfg, mix)}
    for tname, _, nbytes in tensors(cfg, mix):
        i = _layer(tname)
        if i is not None:
            layers[i][types[tname]] = layers[i].get(types[tname], 0) + nbytes
            experts[i] += nbytes if "_exps." in tname else 0
        elif tname == "token_embd.weight":
            embed = nbytes
        elif tname == "output.weight":
            output = nbytes
        else:
            misc += nbytes
    return ModelShape(f"{name}-{mix}", "deepseek2", L, cfg["max_position_embeddings"], cfg["hidden_size"],
                      cfg["num_attention_heads"], 1, cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], 0,
                      cfg["vocab_size"], cfg["intermediate_size"], layers, embed, output, types["output.weight"],
                      misc, [False] * L, 0, False, experts, cfg["n_routed_experts"], cfg["num_experts_per_tok"])


def plans(shape: ModelShape, ctx: int) -> list[dict]:
    rows = []
    for gpu, gbw in GPUS.items():
        for ram in RAMS:
            bw = Bandwidths(CPU_BW, gbw, SPLIT_OVERHEAD_S, "given")
            p = plan_placement(shape, gpu * GiB, ctx=ctx, ram=ram * GiB, backend="native", experts="auto",
                               bandwidths=bw)
            rows.append({"gpu_gb": gpu, "ram_gb": ram, "experts": p.experts, "gpu_layers": p.gpu_layers,
                         "gpu_used_gb": round(p.gpu_total_bytes / GiB, 1), "ram_used_gb": round(p.cpu_total_bytes / GiB, 1),
                         "fits": bool(p.fits_ram) and p.gpu_total_bytes <= gpu * GiB,
                         "tok_s": round(p.predicted_tok_s, 1)})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--json", help="write the numbers here too")
    a = ap.parse_args(argv)
    out = {}
    for name, (cfg, keep) in MODELS.items():
        total, active = active_params(cfg)
        mem = {f: round(weight_bytes(cfg, f, keep) / GB, 1) for f in ("bf16", "fp8", "q8_0", "q4_k_m", "awq_int4")}
        out[name] = {"params_b": round(total / 1e9, 2), "active_params_b": round(active / 1e9, 2), "weights_gb": mem,
                     "offload_q4_k_m": plans(model_shape(name, cfg), a.ctx)}
        print(f"{name}: {total / 1e9:.2f}B parameters, {active / 1e9:.2f}B active; weights GB {mem}")
        print(f"  dsq offload, Q4_K_M, ctx {a.ctx}, native, --experts auto (CPU {CPU_BW / 1e9:.0f} GB/s):")
        for r in out[name]["offload_q4_k_m"]:
            print(f"    {r['gpu_gb']:>2} GiB GPU + {r['ram_gb']:>3} GiB RAM: experts {r['experts']}, "
                  f"{r['gpu_layers']}/{cfg['num_hidden_layers']} layers on the GPU, GPU {r['gpu_used_gb']} GiB, "
                  f"RAM {r['ram_used_gb']} GiB, {'fits' if r['fits'] else 'DOES NOT FIT'}, ~{r['tok_s']} tok/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
