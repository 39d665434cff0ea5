"""How fast is the routed-experts C call (kernels/cpu.moe_experts: one call a MoE layer, threads
across the active experts) against the same experts as separate GEMM calls (three gguf_linear a
chosen expert, silu and the weighted sum in torch, as RoutedExperts runs them on the CPU), and
what bandwidth does it reach on the chosen experts' bytes?

    python -m benchmarks.moe_cpu --shape deepseek-v2-lite --rows 1,4,64 [--threads N] [--experts E] [--json out.json]

Random blocks of the shape's expert matrices in its Q4_K_M types (gate/up Q4_K, down Q6_K or its
fallback), every call a fresh random choice of experts per row (so the weights come from DRAM,
not a cache that a repeated choice would keep warm). --experts lowers the expert count (memory;
the bytes read per call do not change). Prints ms per call, the ratio, and GB/s.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch


def _setup(shape: str, n_expert: int | None, seed: int = 0):
    from dsq.bench.random_gguf import deepseek_tensor_type, random_blocks
    from dsq.bench.random_models import deepseek_config

    cfg = deepseek_config(shape)
    H, FI, E, k = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    E = n_expert or E
    L = cfg["num_hidden_layers"]
    rng = np.random.default_rng(seed)
    q = (deepseek_tensor_type("Q4_K_M", "blk.1.ffn_gate_exps.weight", H, L),
         deepseek_tensor_type("Q4_K_M", "blk.1.ffn_up_exps.weight", H, L),
         deepseek_tensor_type("Q4_K_M", "blk.0.ffn_down_exps.weight", FI, L))  # layer 0: the Q6_K rule's
    mats = [torch.from_numpy(random_blocks(t, E * n, c, rng)).view(E, n, -1)
            for t, n, c in ((q[0], FI, H), (q[1], FI, H), (q[2], H, FI))]
    return cfg, (H, FI, E, k), q, mats


def _per_expert(x, ids, w, mats, q, H, FI):
    from dsq.kernels import cpu

    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        rows, slot = (ids == e).nonzero(as_tuple=True)
        xe = x[rows].contiguous()
        h = torch.nn.functional.silu(cpu.gguf_linear(xe, mats[0][e], q[0], H)) * cpu.gguf_linear(xe, mats[1][e], q[1], H)
        out.index_add_(0, rows, cpu.gguf_linear(h.contiguous(), mats[2][e], q[2], FI) * w[rows, slot, None])
    return out


def run(shape: str, rows: list[int], threads: int | None, n_expert: int | None, repeat: int) -> list[dict]:
    from dsq.kernels import cpu

    if threads:
        torch.set_num_threads(threads)
    cfg, (H, FI, E, k), q, mats = _setup(shape, n_expert)
    per_row = [m[0].numel() for m in mats]  # bytes of one expert's gate, up, down
    out = []
    for M in rows:
        calls = [(torch.randn(M, H) * 0.1, torch.stack([torch.randperm(E)[:k] for _ in range(M)]), torch.rand(M, k))
                 for _ in range(repeat + 1)]
        # each way's calls back to back, as a decode step makes them: torch's own ops between two C calls
        # leave its OpenMP threads spinning on the cores the C call's pool needs (the first call warms up)
        one, sep = [], []
        for r, (x, ids, w) in enumerate(calls):
            t0 = time.perf_counter()
            cpu.moe_experts(x, ids, w, *mats, q)
            if r:
                one.append(time.perf_counter() - t0)
        for r, (x, ids, w) in enumerate(calls):
            t0 = time.perf_counter()
            _per_expert(x, ids, w, mats, q, H, FI)
            if r:
                sep.append(time.perf_counter() - t0)
        read = [ids.unique().numel() * sum(per_row) for _, ids, _ in calls[1:]]
        for x, ids, w in calls[:2]:
            y, ref = cpu.moe_experts(x, ids, w, *mats, q), _per_expert(x, ids, w, mats, q, H, FI)
            assert torch.allclose(y, ref, rtol=1e-3, atol=1e-3 * float(ref.abs().max()))
        t_one, t_sep = float(np.median(one)), float(np.median(sep))
        out.append({"shape": shape, "rows": M, "threads": torch.get_num_threads(), "experts": E, "k": k,
                    "qtypes": "/".join(q), "one_call_ms": round(1e3 * t_one, 3), "per_expert_ms": round(1e3 * t_sep, 3),
                    "ratio": round(t_sep / t_one, 2), "one_call_gb_s": round(float(np.median(read)) / t_one / 1e9, 1)})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="deepseek-v2-lite")
    ap.add_argument("--rows", default="1,4,64")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--experts", type=int, help="fewer experts than the shape's (memory)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    res = run(a.shape, [int(r) for r in a.rows.split(",")], a.threads, a.experts, a.repeat)
    print("| shape | rows | threads | types | one call ms | per-expert calls ms | ratio | one call GB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in res:
        print(f"| {r['shape']} | {r['rows']} | {r['threads']} | {r['qtypes']} | {r['one_call_ms']} | "
              f"{r['per_expert_ms']} | {r['ratio']}x | {r['one_call_gb_s']} |")
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
