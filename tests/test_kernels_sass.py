"""Properties of the Triton kernels' machine code for an H100/H200 (sm_90), compiled here without a
GPU (benchmarks.sass_count): the speed-critical shapes of the code that no CPU test can time.
Compiled in a child process: the tests' own Triton runs in interpreter mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # benchmarks/ is not installed: the children run from here

_CHILD = """
import collections, json, sys
from benchmarks import sass_count
kernel, fmt, warps, const, mods = json.loads(sys.argv[1])
print(json.dumps(collections.Counter(sass_count.loop_opcodes(sass_count.compile_sm90(kernel, fmt, warps, **const), mods))))
"""


def _loop_ops(kernel: str, fmt: str, warps: int, modifiers: bool = False, **const) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _CHILD, json.dumps([kernel, fmt, warps, const, modifiers])], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_even_k_copies_whole_16_byte_words():
    """Without a K mask (EVEN_K) the int8-x GEMV copies its code words 16 bytes at a time: twice the
    16-byte copies and fewer copies in all than the masked loop (a K mask has the constancy of K's
    divisibility, which split every copy in two: 58 -> 43 us at 28672x8192 on an H200)."""
    ops = {even: _loop_ops("gemv_q8", "int4", 1, True, BN=2, BK=2048, STAGES=2, EVEN_K=even, EVEN_N=False)
           for even in (False, True)}
    wide = {e: sum(n for op, n in o.items() if op.startswith("LDGSTS") and op.endswith(".128")) for e, o in ops.items()}
    copies = {e: sum(n for op, n in o.items() if op.startswith("LDGSTS")) for e, o in ops.items()}
    assert wide[True] >= 2 * wide[False] and copies[True] < copies[False], ops
    assert sum(ops[True].values()) < sum(ops[False].values())


def test_register_prefetch_loop():
    """PREFETCH keeps the next tile's loads in registers: no shared memory and no barrier in the
    loop, code and x words loaded 16 bytes at a time, and well under the instructions per weight
    element of the loop pipelined through shared memory (1.47 against 2.5 on sm_90 when written)."""
    pf = _loop_ops("gemv_q8", "int4", 1, True, BN=4, BK=1024, STAGES=1, PREFETCH=True)
    piped = _loop_ops("gemv_q8", "int4", 1, True, BN=4, BK=512, STAGES=3)
    assert not any(op.startswith(("LDGSTS", "LDS", "STS", "BAR")) for op in pf), pf
    assert pf.get("LDG.E.128", 0) >= 4 + 2, pf  # a row-block of codes per row (BN 4), x's two words
    per_pf, per_piped = sum(pf.values()) / (4 * 1024), sum(piped.values()) / (4 * 512)
    assert per_pf < 0.7 * per_piped, (per_pf, per_piped)


def test_fp8_hardware_conversion():
    """FP8_HW converts e4m3 in hardware (F2FP: cvt.rn.f16x2.e4m3x2) and halves the float GEMV's loop."""
    ops = {hw: _loop_ops("gemv_rows", "fp8", 2, BN=8, BK=1024, STAGES=3, FP8_HW=hw) for hw in (False, True)}
    assert ops[True].get("F2FP", 0) > 0 and ops[False].get("F2FP", 0) == 0
    assert 2 * sum(ops[True].values()) < 1.1 * sum(ops[False].values()), ops


_PTX_CHILD = """
import json, sys
from benchmarks import sass_count
kernel, fmt, warps, const = json.loads(sys.argv[1])
print(json.dumps(sass_count.compile_sm90(kernel, fmt, warps, **const).asm["ptx"]))
"""


def test_pdl_prefetches_weights_then_waits_for_x():
    """PDL: the GEMV prefetches its first code words into L2, then waits for the previous kernel
    (griddepcontrol.wait) before anything reads x; without PDL neither is in the code."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    ptx = {}
    for pdl in (False, True):
        const = dict(BN=1, BK=2048, STAGES=1, PREFETCH=True, PERSIST=32, PDL=pdl)
        r = subprocess.run([sys.executable, "-c", _PTX_CHILD, json.dumps(["gemv_q8", "int4", 1, const])], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        ptx[pdl] = json.loads(r.stdout.strip().splitlines()[-1])
    assert "griddepcontrol.wait" not in ptx[False] and "prefetch.global.L2" not in ptx[False]
    body = ptx[True]
    wait = body.index("griddepcontrol.wait")
    assert body.index("prefetch.global.L2") < wait
    assert wait < body.index("ld.global"), "a load before the wait could read x before the previous kernel wrote it"


def test_tensor_core_kernel_takes_the_codes_from_registers():
    """triton_mma's loop at 16 rows (BN 128, one warpgroup): wgmma (HGMMA) with the dequantized codes
    as the register operand, so nothing is stored to shared memory in the loop (the tl.dot GEMM
    sent every dequantized bf16 weight through it); codes to bf16 with at most one LOP3 and one
    shift per two weights (LOP3 + SHF per weight element and thread <= 0.9)."""
    BN, GS, warps = 128, 128, 4
    ops = _loop_ops("mma_t", "int4", warps, BN=BN, BK=128, STAGES=4, GS=GS, MP=16)
    per_thread = BN * GS / (32 * warps)
    assert ops.get("HGMMA", 0) >= 4 and ops.get("STS", 0) <= 2, ops
    assert (ops.get("LOP3", 0) + ops.get("SHF", 0)) / per_thread <= 0.9, ops
