"""The CPU thread count both engines default to (dsq/runtime/threads.py) and the kernels' build
forcing (DSQ_CPU_ISA)."""

from __future__ import annotations

import os

import pytest

from dsq.kernels import cpu
from dsq.runtime import threads


def test_default_is_one_thread_per_physical_core(monkeypatch):
    """SMT siblings (CPUs listing the same core) count once; CPUs outside the mask not at all."""
    siblings = {0: "0,4", 4: "0,4", 1: "1,5", 5: "1,5", 2: "2,6"}
    monkeypatch.setattr(threads, "_affinity", lambda: [0, 1, 2, 4, 5])
    monkeypatch.setattr(threads, "_core_of", siblings.get)
    assert threads.default_threads() == 3
    monkeypatch.setattr(threads, "_affinity", lambda: [4])
    assert threads.default_threads() == 1


def test_default_on_this_machine():
    n = threads.default_threads()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert 1 <= n <= cpus


def test_openmp_wait_bounded_unless_chosen(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    threads.quiet_openmp()
    assert os.environ["GOMP_SPINCOUNT"] == str(threads.OMP_SPINCOUNT)
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    threads.quiet_openmp()
    assert "GOMP_SPINCOUNT" not in os.environ


def test_both_backends_get_the_default(monkeypatch, tiny_gguf):
    import torch

    from dsq.runtime.engine import load

    monkeypatch.setattr(threads, "default_threads", lambda: 1)
    path = tiny_gguf("qwen2", "Q8_0")
    before = torch.get_num_threads()
    try:
        assert {load(str(path), backend=b, ctx=64).n_threads for b in ("native", "llama.cpp")} == {1}
    finally:
        torch.set_num_threads(before)  # the native engine sets torch's count for the process


def test_forced_build(monkeypatch):
    monkeypatch.setenv("DSQ_CPU_ISA", "generic")
    assert cpu.forced_isa() == "generic" and cpu.supported_isas() == ["generic"]
    monkeypatch.setenv("DSQ_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="no such build"):
        cpu.forced_isa()
    other = "neon" if "neon" not in cpu._candidates() else "avx512"
    monkeypatch.setenv("DSQ_CPU_ISA", other)
    with pytest.raises(RuntimeError, match="cannot run"):
        cpu.supported_isas()
