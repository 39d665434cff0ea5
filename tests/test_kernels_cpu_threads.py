"""The C CPU kernels' own thread pool (kernels/csrc/pool.inc) under concurrent and repeated use:
calls from several Python threads at once, each with its own thread counts (1, 2, 3, 7), odd
shapes, many tiny calls in a row, and a fork. Every output is computed by one thread in a fixed
order whatever the thread count, so each call must give the bits of the same call on one thread,
and that one-thread result must match the float64 reference."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading

import numpy as np
import pytest
import torch

from dsq.formats.fp8_checkpoint import fp8_dequantize
from dsq.kernels import cpu, gguf_ref, intq_ref
from test_kernels_neon_qemu import CSRC, native_cc
from test_kernels_ref import FORMATS, int8_x, random_blocks, reference

BUILDS = [isa for isa in cpu.supported_isas()
          if cpu.load(isa) is not None and hasattr(cpu.load(isa), "dsq_set_threads")]
pytestmark = pytest.mark.skipif(not BUILDS, reason="no CPU kernels with the thread pool built")
THREADS = (1, 2, 3, 7)


def gguf_case(lib, qtype: str, N: int, K: int, M: int, rng):
    """(the avx2 build's integer dots against the reference of their rounding of x, which its error
    is then far below)"""
    raw = torch.from_numpy(random_blocks(qtype, N, K, rng))
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30))))
    isa = next(i for i in cpu.ISAS if cpu.load(i) is lib)
    ref = reference(x, raw, qtype, K, int8_x(isa, qtype, M))
    return (lambda t, out: cpu.gguf_linear(x, raw, qtype, K, out=out, lib=lib, threads=t)), (M, N), ref


def int_case(lib, bits: int, N: int, K: int, g: int, M: int, gen):
    q = torch.randint(0, 2**bits, (N, K), generator=gen)
    qw = intq_ref.pack_codes(q, bits)
    scales = (torch.rand(N, K // g, generator=gen) * 0.02 + 1e-3).half()
    zeros = torch.randint(0, 2**bits, (N, K // g), dtype=torch.uint8, generator=gen)
    x = torch.randn(M, K, generator=gen)
    w = intq_ref.dequantize(qw, scales, zeros, bits).double()
    ref = (intq_ref.int_linear_ref(x.double(), qw, scales, zeros, bits), x.double().abs() @ w.abs().t())
    return (lambda t, out: cpu.int_linear(x, qw, scales, zeros, bits, out=out, lib=lib, threads=t)), (M, N), ref


def fp8_case(lib, N: int, K: int, M: int, gen):
    w = (torch.randn(N, K, generator=gen) * 0.5).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-N // 128), -(-K // 128), generator=gen) + 0.5
    x = torch.randn(M, K, generator=gen)
    wd = fp8_dequantize(w, scale).double()
    ref = (x.double() @ wd.t(), x.double().abs() @ wd.abs().t())
    return (lambda t, out: cpu.fp8_linear(x, w, scale, out=out, lib=lib, threads=t)), (M, N), ref


def attn_case(lib, B: int, H: int, Hk: int, S: int, D: int, gen):
    q = torch.randn(B, H, D, generator=gen)
    k, v = torch.randn(B, Hk, S, D, generator=gen), torch.randn(B, Hk, S, D, generator=gen)
    mask = torch.rand(B, S, generator=gen) < 0.8
    mask[:, 0] = True
    kk, vv = (t.double().repeat_interleave(H // Hk, 1) for t in (k, v))
    logits = (q.double().unsqueeze(2) @ kk.transpose(-1, -2)).squeeze(2) * D**-0.5
    p = logits.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
    ref = ((p.unsqueeze(2) @ vv).reshape(B, 1, H * D), (p.unsqueeze(2) @ vv.abs()).reshape(B, 1, H * D))

    def run(t, out):
        y = cpu.attn_decode(q, k, v, mask, D**-0.5, lib=lib, threads=t)
        out.copy_(y.reshape(out.shape))
        return out
    return run, (B, 1, H * D), ref


def cases(lib, seed: int = 0) -> dict:
    """name -> (run(threads, out), output shape, (float64 reference, sum of |terms|)): shapes of
    several chunks (the pool runs them on several threads) and odd ones, M = 1 and more."""
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    out = {}
    for qtype in FORMATS:
        K = 2048 if gguf_ref.BLOCKS[qtype][0] == 256 else 2016
        for M in (1, 3, 17):
            out[f"{qtype} M={M}"] = gguf_case(lib, qtype, 257, K, M, rng)
    if hasattr(lib, "dsq_int_gemm"):
        for bits in (4, 8):
            for M in (1, 5):
                out[f"int{bits} M={M}"] = int_case(lib, bits, 131, 1280, 128, M, gen)
        out["fp8 M=2"] = fp8_case(lib, 129, 1000, 2, gen)
    if hasattr(lib, "dsq_attn_decode"):
        out["attn"] = attn_case(lib, 2, 12, 4, 301, 64, gen)
    return out


def one_thread_results(cs: dict) -> dict:
    """Each case on one thread, checked against its float64 reference (to 1e-5 of the summed
    |terms|, the CPU kernel tests' bound)."""
    want = {}
    for name, (run, shape, (ref, scale)) in cs.items():
        y = run(1, torch.full(shape, float("nan"))).clone()
        err = float(((y.double() - ref).abs() / scale.clamp(min=1e-30)).max())
        assert err < 1e-5, f"{name}: error {err:.2e} on one thread"
        want[name] = y
    return want


def hammer(cs: dict, want: dict, rounds: int, seed: int, failures: list) -> None:
    """Every case at every thread count, in a random order, `rounds` times; outputs poisoned."""
    order = [(name, t) for name in cs for t in THREADS] * rounds
    random.Random(seed).shuffle(order)
    for name, t in order:
        run, shape, _ = cs[name]
        y = run(t, torch.full(shape, float("nan")))
        if not torch.equal(y, want[name]):
            failures.append(f"{name} on {t} threads (Python thread {seed})")


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("isa", BUILDS)
def test_concurrent_python_threads(isa, int8, monkeypatch):
    """Four Python threads calling at once, each with its own thread counts, agree bit for bit
    with one thread; int8: with the integer tiles at M > 1 (DSQ_INT8_PREFILL=1)."""
    if int8 and isa not in ("avx2", "avx512"):
        pytest.skip("the integer tiles are the x86 builds'")
    if int8:
        monkeypatch.setenv("DSQ_INT8_PREFILL", "1")
    else:
        monkeypatch.delenv("DSQ_INT8_PREFILL", raising=False)
    lib = cpu.load(isa)
    cs = cases(lib)
    want = one_thread_results(cs)
    failures: list[str] = []
    workers = [threading.Thread(target=hammer, args=(cs, want, 2, s, failures)) for s in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not failures, failures[:10]


@pytest.mark.parametrize("isa", BUILDS)
def test_many_tiny_calls(isa):
    """Thousands of calls just above two chunks (the pool's smallest loops, where the hand-over
    between loops is most of the work), from two Python threads at once, thread counts changing
    on every call."""
    lib = cpu.load(isa)
    rng = np.random.default_rng(1)
    tiny = {"Q8_0": gguf_case(lib, "Q8_0", 270, 256, 1, rng), "Q4_K": gguf_case(lib, "Q4_K", 600, 256, 1, rng)}
    if hasattr(lib, "dsq_attn_decode"):
        tiny["attn"] = attn_case(lib, 1, 4, 2, 40, 128, torch.Generator().manual_seed(1))
    want = one_thread_results(tiny)
    failures: list[str] = []

    def loop(seed):
        r = random.Random(seed)
        names = list(tiny)
        for _ in range(1500):
            name = r.choice(names)
            run, shape, _ = tiny[name]
            t = r.choice((2, 3, 7))
            y = run(t, torch.full(shape, float("nan")))
            if not torch.equal(y, want[name]):
                failures.append(f"{name} on {t} threads")
    workers = [threading.Thread(target=loop, args=(s,)) for s in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not failures, failures[:10]


def test_thread_count_is_per_calling_thread():
    """A call's thread count reaches the pool (dsq_get_threads) for the calling thread only."""
    lib = cpu.load(BUILDS[0])
    rng = np.random.default_rng(2)
    run, shape, _ = gguf_case(lib, "Q8_0", 64, 256, 1, rng)
    run(3, torch.empty(shape))
    assert lib.dsq_get_threads() == 3
    seen = []

    def other():
        run(5, torch.empty(shape))
        seen.append(lib.dsq_get_threads())
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == [5] and lib.dsq_get_threads() == 3
    cpu.set_threads(2, lib)
    assert lib.dsq_get_threads() == 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() here")
def test_pool_after_fork():
    """A child forked after the pool has run starts its own workers (the parent's do not exist
    there) and computes the same bits."""
    lib = cpu.load(BUILDS[0])
    rng = np.random.default_rng(3)
    run, shape, _ = gguf_case(lib, "Q4_0", 400, 2048, 1, rng)
    want = run(1, torch.empty(shape)).numpy().tobytes()
    run(2, torch.empty(shape))  # the pool's workers exist now
    out = torch.empty(shape)
    pid = os.fork()
    if pid == 0:  # the child: no torch ops past here (their thread pools may not survive a fork)
        signal.alarm(60)
        ok = all(run(t, out).numpy().tobytes() == want for t in (2, 3, 2))
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"


@pytest.mark.parametrize("threads", [3, 4])
def test_late_worker_never_ends_a_loop_early(tmp_path, threads):
    """The pool's hand-over between loops (kernels/csrc/pool_test.c): one worker held after seeing a
    loop's generation until the caller is writing the next loop's descriptor, as a worker
    descheduled there on a busy machine is. Before the closed word of pool.inc's protocol, such a
    worker claimed units of the old generation with the new descriptor and counted them in the new
    loop: dsq_parallel_for returned with items undone (about 1 loop in 10000 here) or hung waiting
    for a count that had jumped past its end. Every loop must return with every item done."""
    exe = tmp_path / "pool_test"
    r = subprocess.run([native_cc(), "-O2", "-std=c11", "-Wall", "-pthread", "-I", str(CSRC), str(CSRC / "pool_test.c"),
                        "-o", str(exe)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    loops = 100000
    try:
        r = subprocess.run([str(exe), str(loops), str(threads)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:  # (about 1.5 s when it works)
        pytest.fail(f"{loops} loops on {threads} threads did not end in 60 s: a loop waits for chunks forever")
    assert r.returncode == 0 and r.stdout.strip() == f"0 of {loops} loops returned early", r.stdout + r.stderr


@pytest.mark.parametrize("isa", BUILDS)
def test_read_sum_is_the_sum_of_every_word(isa):
    """The calibration's read probe (kernels/csrc/read_cpu.inc) on 1, 2, 3 and 7 threads: the sum mod
    2^64 of every 64-bit word, against numpy's, for random words (so a chunk left out or read twice
    shows), and a buffer whose size is refused."""
    lib = cpu.load(isa)
    rng = np.random.default_rng(7)
    words = rng.integers(0, 2**63, size=(3 << 20) + 512 * 5, dtype=np.int64)  # not a whole number of chunks
    ref = int(words.view(np.uint64).sum(dtype=np.uint64))
    x = torch.from_numpy(words)
    for t in THREADS:
        assert cpu.read_sum(x, t, lib) == ref
    with pytest.raises(ValueError, match="multiple of 4096"):
        cpu.read_sum(x[:100], 2, lib)
