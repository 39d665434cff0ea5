"""Properties of the Triton kernels' machine code for an H100/H200 (sm_90), compiled here without a
GPU (dsq.bench.sass_count): the speed-critical shapes of the code that no CPU test can time.
Compiled in a child process: the tests' own Triton runs in interpreter mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys


_CHILD = """
import collections, json, sys
from dsq.bench import sass_count
kernel, fmt, warps, const = json.loads(sys.argv[1])
print(json.dumps(collections.Counter(sass_count.loop_opcodes(sass_count.compile_sm90(kernel, fmt, warps, **const)))))
"""


def _loop_ops(kernel: str, fmt: str, warps: int, **const) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _CHILD, json.dumps([kernel, fmt, warps, const])], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_even_k_copies_whole_16_byte_words():
    """Without a K mask (EVEN_K) the int8-x GEMV copies its code words 16 bytes at a time: half the
    asynchronous copies of the masked loop (a K mask has the constancy of K's divisibility, which
    split every copy in two: 58 -> 43 us at 28672x8192 on an H200)."""
    ops = {even: _loop_ops("gemv_q8", "int4", 1, BN=2, BK=2048, STAGES=2, EVEN_K=even) for even in (False, True)}
    assert ops[True]["LDGSTS"] * 2 == ops[False]["LDGSTS"], ops
    assert sum(ops[True].values()) < sum(ops[False].values())


def test_fp8_hardware_conversion():
    """FP8_HW converts e4m3 in hardware (F2FP: cvt.rn.f16x2.e4m3x2) and halves the float GEMV's loop."""
    ops = {hw: _loop_ops("gemv_rows", "fp8", 2, BN=8, BK=1024, STAGES=3, FP8_HW=hw) for hw in (False, True)}
    assert ops[True].get("F2FP", 0) > 0 and ops[False].get("F2FP", 0) == 0
    assert 2 * sum(ops[True].values()) < 1.1 * sum(ops[False].values()), ops
