"""Count the SASS instructions in the main loop of a Triton kernel compiled for an H100/H200
(sm_90), without a GPU: a kernel change's cost read off the compiler's output before it takes device time.

    python -m benchmarks.sass_count gemv_q8 int4 --BN 4 --BK 512 --warps 1 --stages 3 [--set EVEN_K=0]
    python -m benchmarks.sass_count gemv_q8 int4 --BN 4 --BK 1024 --warps 1 --stages 1 --set PREFETCH=1
    python -m benchmarks.sass_count gemv_rows fp8 --BN 8 --BK 1024 --warps 2 --stages 3 [--set FP8_HW=1]
    python -m benchmarks.sass_count mma_t int4 --BN 128 --BK 128 --warps 4 --stages 4 --set GS=128 --set MP=16
    python -m benchmarks.sass_count mma_s q4k --BN 128 --BK 256 --warps 4 --stages 3 --set MP=16

Prints the loop's instruction count, per weight element and thread, the shared memory, the
copies' vector widths (Triton's `contiguity`), the most frequent opcodes and the registers a
thread. Needs Triton's bundled ptxas (it ships with the wheel).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import inspect
import re

# the formats' compile-time flags and scale-plane pointer type (kernels/packed.py Fmt)
FORMATS = {
    "int4": dict(CODES=0, SUB=128, ZERO=2, sc="*fp16"),
    "q4k": dict(CODES=0, SUB=32, TWO_LEVEL=True, MINS=True, sc="*u8"),
    "q5k": dict(CODES=0, HI_BITS=1, SUB=32, TWO_LEVEL=True, MINS=True, sc="*u8"),
    "q5_0": dict(CODES=0, HI_BITS=1, SUB=32, ZERO=1, OFFSET=16, sc="*fp16"),
    "q6k": dict(CODES=0, HI_BITS=2, SUB=16, TWO_LEVEL=True, ZERO=1, OFFSET=32, sc="*i8"),
    "q8_0": dict(CODES=2, SUB=32, sc="*fp16"),
    "fp8": dict(CODES=3, SUB=1 << 20, sc="*fp32"),
}
_PTRS = {"x_ptr": "*bf16", "y_ptr": "*bf16", "bias_ptr": "*bf16", "xw_ptr": "*i32",
         "sx_ptr": "*fp32", "xsum_ptr": "*fp32", "lo_ptr": "*i32", "hi_ptr": "*i32", "d_ptr": "*fp16",
         "zp_ptr": "*u8", "mn_ptr": "*u8", "dmin_ptr": "*fp16", "xp_ptr": "*bf16", "xs_ptr": "*fp32",
         "ws_ptr": "*fp32", "cnt_ptr": "*i32", "w_ptr": "*bf16"}
# the module (in dsq.kernels) that holds each kernel
KERNELS = {"gemv_q8": "triton_gemv_q8", "quant_x": "triton_gemv_q8", "gemv": "triton_gemv", "gemv_rows": "triton_gemv",
           "gemv4": "triton_gemv", "gemm": "triton_gemm", "dequant": "triton_dequant", "mma_t": "triton_mma",
           "mma_s": "triton_mma"}
_DEFAULTS = dict(CODES=0, HI_BITS=0, SUB=128, SC_ROWS=1, TWO_LEVEL=False, ZERO=0, OFFSET=0, MINS=False,
                 HAS_BIAS=False, USE_ASM=True, EVEN_K=True, EVEN_N=True, FP8_HW=True)  # the others: the signature's


def compile_sm90(kernel: str, fmt: str, warps: int, **const):
    """The Triton kernel _<kernel> (its module: KERNELS) compiled for sm_90 with the format's flags and
    `const` tile sizes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(f"dsq.kernels.{KERNELS[kernel]}"), "_" + kernel)
    f = dict(FORMATS[fmt])
    sc = f.pop("sc")
    names = list(fn.arg_names)
    constexprs = {p.name for p in fn.params if p.is_constexpr}
    sig_defaults = {n: p.default for n, p in inspect.signature(fn.fn).parameters.items()
                    if p.default is not inspect.Parameter.empty}  # constexprs with defaults (PDL, ...)
    values = {**sig_defaults, **_DEFAULTS, **f, **const}
    consts = {n: values[n] for n in names if n in constexprs and n in values}
    lo = "*i16" if kernel in ("mma_t", "mma_s") else "*i32"  # the codes as 16-bit or 32-bit words
    sig = {n: "constexpr" if n in consts else (lo if n == "lo_ptr" else
                                               sc if n == "sc_ptr" else _PTRS.get(n, "i32"))
           for n in names if n in consts or n not in constexprs}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n.endswith("_ptr") or n.startswith("s_") or n in ("N", "K")}
    src = ASTSource(fn, sig, {(names.index(k),): v for k, v in consts.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 1})


def loop_opcodes(compiled, modifiers: bool = False) -> list[str]:
    """Opcodes of the longest backward-branching block of the SASS (the K loop); with `modifiers`
    as written (LDG.E.128), else the bare opcode (LDG)."""
    lines = compiled.asm["sass"].splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^\s*(\.?L\w+):", line))}
    best = None
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?(\.?L\w+)", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i and (best is None or i - labels[m.group(1)] > best[1] - best[0]):
            best = (labels[m.group(1)], i)
    if best is None:
        raise ValueError("no loop found in the SASS")
    body = [line.split("\t")[1] for line in lines[best[0] + 1:best[1] + 1] if "\t" in line]
    ops = [re.sub(r"^@!?U?P\w+\s+", "", op).split()[0].rstrip(";") for op in body]
    return ops if modifiers else [op.split(".")[0] for op in ops]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel", choices=["gemv_q8", "gemv_rows", "mma_t", "mma_s"])
    ap.add_argument("fmt", choices=sorted(FORMATS))
    ap.add_argument("--BN", type=int, default=4)
    ap.add_argument("--BK", type=int, default=512)
    ap.add_argument("--warps", type=int, default=1)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--MR", type=int, default=1, help="rows of x, a power of two (gemv_q8)")
    ap.add_argument("--set", action="append", default=[], help="NAME=INT for another constexpr (EVEN_K=0, ...)")
    a = ap.parse_args(argv)
    extra = {k: int(v) for k, v in (s.split("=") for s in a.set)}
    k = compile_sm90(a.kernel, a.fmt, a.warps, BN=a.BN, BK=a.BK, STAGES=a.stages, MR=a.MR, **extra)
    ops = loop_opcodes(k)
    elems = a.BN * (extra.get("GS") or a.BK) * extra.get("NG", 1) if a.kernel == "mma_t" else a.BN * a.BK
    per = len(ops) / (elems / (32 * a.warps))
    widths = sorted(set(re.findall(r"contiguity = (\d+)", k.asm["ttgir"])))
    print(f"{a.kernel} {a.fmt} BN={a.BN} BK={a.BK} warps={a.warps} stages={a.stages} {extra or ''}: "
          f"{len(ops)} instructions a loop, {per:.2f} per weight element and thread, shared {k.metadata.shared} B, "
          f"copy contiguity {'/'.join(widths) or '-'} words")
    print("  " + ", ".join(f"{op} {n}" for op, n in collections.Counter(ops).most_common(14)))
    print(f"  registers a thread: {registers(k)}")


def registers(compiled) -> str:
    """Registers a thread, from Triton's own ptxas run again with -v on the kernel's PTX."""
    import os
    import subprocess
    import tempfile

    from triton.backends.nvidia import compiler

    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        r = subprocess.run([compiler.get_ptxas(90).path, "-v", "-arch=sm_90a", ptx, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    m = re.search(r"Used (\d+) registers", r.stderr)
    return m.group(1) if m else "unknown"


if __name__ == "__main__":
    main()
