"""The CPU kernels' tuning constants, measured on this machine: each variant is a build of
kernels/csrc/cpu_<isa>.c with other -D values (the weight stream's prefetch distance XQ_PF / X8_PF,
the pool's claim size POOL_GUIDED and POOL_CHUNK_COST, the expert call's unit MOE_UNIT_BYTES),
timed round after round (every variant once a round, so a drift in the machine's load falls on
all of them alike) on a decode step's work: the four GEMVs of one Llama-3-8B layer (q/k/v fused,
o, gate/up fused, down; 138 MB of Q4_K / Q6_K blocks), one DeepSeek-V2-Lite routed-experts call at
one row (6 of 64 experts), and the pool's plain read (their roofline); about --gib of each kind
cycled, so that each call reads DRAM.

    python -m benchmarks.cpu_knobs --threads 8,16 --rounds 5 [--json out.json]
    python -m benchmarks.cpu_knobs --variant base= --variant "pf8k=-DXQ_PF=8192 -DX8_PF=8192"

Prints each variant's median GB/s per part and its ratio to the first variant (the build as
shipped). On the device: `bash benchmarks/h200_split.sh knobs`.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ["base=", "pf2k=-DXQ_PF=2048 -DX8_PF=2048", "pf8k=-DXQ_PF=8192 -DX8_PF=8192",
           "pf16k=-DXQ_PF=16384 -DX8_PF=16384", "guided2=-DPOOL_GUIDED=2", "guided8=-DPOOL_GUIDED=8",
           "unit32k=-DMOE_UNIT_BYTES=(32<<10)", "unit256k=-DMOE_UNIT_BYTES=(256<<10)"]
LAYER = [(6144, 4096, "Q4_K"), (4096, 4096, "Q4_K"), (28672, 4096, "Q4_K"), (4096, 14336, "Q6_K")]


def isa_flags(isa: str) -> list[str]:
    """setup.py's compiler flags for the `isa` build (its FLAGS literal)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FLAGS" for t in node.targets):
            for k, v in zip(node.value.keys, node.value.values):
                if ast.literal_eval(k) == isa:
                    try:
                        return ast.literal_eval(v)
                    except ValueError:  # a flag list chosen at build time (neon: by platform)
                        raise SystemExit(f"cpu_knobs: setup.py's {isa} flags are not a plain list; "
                                         "run it on an x86 build (avx512, avx2, generic)") from None
    raise ValueError(f"setup.py has no flags for {isa}")


def build(isa: str, defines: list[str], out: Path) -> Path:
    cc = os.environ.get("CC", "cc")
    cmd = [cc, "-O3", "-std=c11", *isa_flags(isa), "-fopenmp-simd", "-pthread", "-shared", "-fPIC",
           "-I", str(ROOT / "kernels/csrc"), *defines, str(ROOT / f"kernels/csrc/cpu_{isa}.c"), "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


def _blocks(qtype: str, N: int, K: int) -> torch.Tensor:
    from dsq.kernels import gguf_ref

    # random bytes below 64: finite fp16 scales in every format
    return torch.randint(0, 64, (N, gguf_ref.row_bytes(qtype, K)), dtype=torch.uint8)


def _median_s(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="", help="comma-separated (default: the runtime's choice)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=5, help="timed calls of each part a round (the median kept)")
    ap.add_argument("--variant", action="append", metavar="'NAME=-DX=Y -DZ=W'",
                    help="a build: NAME= then its -D flags, one argument (repeatable; default: prefetch distances, "
                         "claim sizes and expert units around the shipped values)")
    ap.add_argument("--gib", type=float, default=2.0, help="GiB of weights of each kind to cycle through")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)

    from dsq.kernels import cpu, gguf_ref
    from dsq.runtime.machine import runtime_threads

    isa = cpu.library()[1]
    if isa not in ("avx512", "avx2", "neon", "generic"):
        raise SystemExit(f"no CPU kernels here: {isa}")
    specs = a.variant or DEFAULT
    tmp = Path(tempfile.mkdtemp(prefix="dsq_knobs_"))
    libs = {}
    for spec in specs:
        name, _, rest = spec.partition("=")
        libs[name] = cpu.load_file(build(isa, rest.split(), tmp / f"{name}.so"))
    threads = [int(t) for t in a.threads.split(",") if t] or [runtime_threads()]

    torch.manual_seed(0)
    # copies cycled so that every timed call reads DRAM, not a cache that holds what the last call read
    # (the dev machine's L3 is 480 MiB): about --gib of each kind
    one_layer = sum(gguf_ref.row_bytes(q, K) * N for N, K, q in LAYER)
    layers = [[(_blocks(q, N, K), q, K) for N, K, q in LAYER] for _ in range(max(1, int(a.gib * 2**30 / one_layer)))]
    H, inter, E, k = 2048, 1408, 64, 6  # DeepSeek-V2-Lite's routed experts, in its Q4_K_M types
    per_layer = E * (2 * gguf_ref.row_bytes("Q4_K", H) * inter + gguf_ref.row_bytes("Q8_0", inter) * H)
    moes = [(_blocks("Q4_K", E * inter, H).view(E, inter, -1), _blocks("Q4_K", E * inter, H).view(E, inter, -1),
             _blocks("Q8_0", E * H, inter).view(E, H, -1)) for _ in range(max(1, int(a.gib * 2**30 / per_layer)))]
    expert_bytes = k * per_layer // E
    buf = torch.ones(int(a.gib * 2**30) // 4096 * 512, dtype=torch.int64)
    xs = {K: torch.randn(1, K) for _, K, _ in LAYER}
    print(f"{len(layers)} copies of the 8B layer ({one_layer / 1e6:.0f} MB), {len(moes)} expert layers "
          f"({per_layer / 1e6:.0f} MB), a {buf.numel() * 8 / 2**30:.1f} GiB read", flush=True)

    results = {(n, th): {"layer": [], "experts": [], "read": []} for n in libs for th in threads}
    turn = [0, 0]
    for rnd in range(a.rounds):
        for th in threads:
            for name, lib in libs.items():
                def gemvs():
                    turn[0] += 1
                    for raw, q, K in layers[turn[0] % len(layers)]:
                        cpu.gguf_linear(xs[K], raw, q, K, lib=lib, threads=th)

                def experts():
                    turn[1] += 1
                    gate, up, down = moes[turn[1] % len(moes)]
                    cpu.moe_experts(torch.randn(1, H) * 0.1, torch.randperm(E)[:k][None], torch.rand(1, k), gate,
                                    up, down, ("Q4_K", "Q4_K", "Q8_0"), lib=lib, threads=th)

                gemvs()
                r = results[(name, th)]
                r["layer"].append(one_layer / _median_s(gemvs, a.repeat) / 1e9)
                r["experts"].append(expert_bytes / _median_s(experts, a.repeat) / 1e9)
                r["read"].append(buf.numel() * 8 / _median_s(lambda: cpu.read_sum(buf, th, lib=lib), 3) / 1e9)
        print(f"round {rnd + 1}/{a.rounds} done", flush=True)

    rows = []
    print(f"\n{isa} build; GB/s, median of {a.rounds} rounds (ratio to {next(iter(libs))})")
    print("| variant | flags | threads | 8B layer GEMVs | ratio | V2-Lite expert call | ratio | pool read |")
    print("|---|---|---|---|---|---|---|---|")
    for th in threads:
        base = {p: statistics.median(v) for p, v in results[(next(iter(libs)), th)].items()}
        for spec in specs:
            name, _, flags = spec.partition("=")
            med = {p: statistics.median(v) for p, v in results[(name, th)].items()}
            rows.append({"variant": name, "flags": flags, "threads": th, **{f"{p}_gb_s": round(v, 1)
                                                                          for p, v in med.items()}})
            print(f"| {name} | {flags or '(as shipped)'} | {th} | {med['layer']:.1f} | "
                  f"{med['layer'] / base['layer']:.2f}x | {med['experts']:.1f} | {med['experts'] / base['experts']:.2f}x "
                  f"| {med['read']:.1f} |")
    if a.json:
        a.json.write_text(json.dumps({"isa": isa, "rounds": a.rounds, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
