"""The CPU routed-experts kernel (csrc/moe_cpu.inc, cpu.moe_experts) against its torch reference
(moe_ref.moe_experts_ref) on fresh random blocks: every build this CPU runs, mixed formats per
projection as llama.cpp's K-quant mixes make them, one row (decode) and many (prefill), experts
chosen by several rows, experts as strided views of a larger stacked tensor; and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsq.kernels import cpu
from dsq.kernels.moe_ref import moe_experts_ref
from test_kernels_ref import int8_x, random_blocks

BUILDS = [isa for isa in cpu.supported_isas() if cpu.load(isa) is not None and hasattr(cpu.load(isa), "dsq_moe_experts")]
pytestmark = pytest.mark.skipif(not BUILDS, reason="no CPU kernels built")

MIXES = [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q8_0", "Q8_0"), ("Q4_0", "Q5_0", "Q5_0"), ("Q5_K", "Q6_K", "Q8_0")]


def _experts(qtypes, E, H, FI, rng, extra_rows: int = 0):
    """(gate, up, down) stacked blocks; extra_rows > 0 makes each a view of a taller tensor."""
    def stack(q, rows, cols):
        b = np.stack([random_blocks(q, rows + extra_rows, cols, rng) for _ in range(E)])
        return torch.from_numpy(b)[:, :rows]
    g, u, d = stack(qtypes[0], FI, H), stack(qtypes[1], FI, H), stack(qtypes[2], H, FI)
    return g, u, d


def _choices(M, E, k, rng):
    ids = torch.stack([torch.from_numpy(rng.permutation(E)[:k]) for _ in range(M)]).long()
    return ids, torch.from_numpy(rng.uniform(0.1, 1.0, (M, k)).astype(np.float32))


def _per_expert(x, ids, w, g, u, d, qtypes, lib):
    """The same sum from separate gguf_linear calls of the same build (the same rounding of x)."""
    H, FI = x.shape[1], g.shape[1]
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        rows, slot = (ids == e).nonzero(as_tuple=True)
        xe = x[rows].contiguous()
        h = torch.nn.functional.silu(cpu.gguf_linear(xe, g[e], qtypes[0], H, lib=lib)) * \
            cpu.gguf_linear(xe, u[e], qtypes[1], H, lib=lib)
        out.index_add_(0, rows, cpu.gguf_linear(h.contiguous(), d[e], qtypes[2], FI, lib=lib) * w[rows, slot, None])
    return out


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("qtypes", MIXES)
@pytest.mark.parametrize("M", [1, 3, 19])
def test_moe_experts_matches_reference(isa, qtypes, M):
    rng = np.random.default_rng()
    E, k, H = 8, 3, 512
    FI = 256 if qtypes[2].endswith("_K") else 288  # 288: rows of 32-blocks that are no multiple of 256
    g, u, d = _experts(qtypes, E, H, FI, rng, extra_rows=int(rng.integers(0, 3)))
    x = torch.randn(M, H) * 0.1
    ids, w = _choices(M, E, k, rng)
    lib = cpu.load(isa)
    out = torch.full((M, H), float("nan"))
    y = cpu.moe_experts(x, ids, w, g, u, d, qtypes, out=out, lib=lib)
    assert y.data_ptr() == out.data_ptr() and torch.isfinite(y).all()
    same = _per_expert(x, ids, w, g, u, d, qtypes, lib)
    scale = float(same.abs().max())
    assert float((y - same).abs().max()) <= 1e-5 * scale
    # Where a build rounds a projection's input to int8 per 32 values (avx2, an expert with one
    # row), the reference rounds it the same way: then they agree to ~1e-6 of the output's largest.
    # Rarely a value of h sits on a rounding tie and lands one int8 step (1/127 of its block's
    # largest) apart, which moved the output by up to 2.2e-3 of its largest in 240 draws: 1e-2.
    ref = moe_experts_ref(x, ids, w, g, u, d, qtypes, int8=lambda q, rows: int8_x(isa, q, rows))
    int8 = any(int8_x(isa, q, 1) for q in qtypes)
    assert float((y - ref).abs().max()) <= (1e-2 if int8 else 1e-4) * float(ref.abs().max())


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("qtypes", MIXES)
@pytest.mark.parametrize("case", ["float dots", "an expert chosen twice", "non-finite x"])
def test_moe_experts_one_row(isa, qtypes, case, monkeypatch):
    """M = 1 prepares each projection's input once for all its units (gemv_plan): with the float row
    dots (DSQ_NO_VNNI=1), with an expert chosen twice by the row (two rows of one expert: the
    GEMM path instead), and with a non-finite x (the float path, whose non-finite output shows)."""
    if case == "float dots":
        monkeypatch.setenv("DSQ_NO_VNNI", "1")
    rng = np.random.default_rng()
    E, k, H = 8, 3, 512
    FI = 256 if qtypes[2].endswith("_K") else 288
    g, u, d = _experts(qtypes, E, H, FI, rng)
    x = torch.randn(1, H) * 0.1
    ids, w = _choices(1, E, k, rng)
    if case == "an expert chosen twice":
        ids[0, 1] = ids[0, 0]
    if case == "non-finite x":
        x[0, 7] = float("inf")
    lib = cpu.load(isa)
    y = cpu.moe_experts(x, ids, w, g, u, d, qtypes, out=torch.full((1, H), float("nan")), lib=lib)
    same = _per_expert(x, ids, w, g, u, d, qtypes, lib)
    if case == "non-finite x":
        assert not torch.isfinite(y).all() and not torch.isfinite(same).all()
        return
    assert torch.isfinite(y).all()
    assert float((y - same).abs().max()) <= 1e-5 * float(same.abs().max())


def test_moe_experts_threads_split_across_experts():
    """Many threads over few rows: the result does not depend on the thread count."""
    rng = np.random.default_rng()
    qtypes = ("Q4_K", "Q4_K", "Q6_K")
    g, u, d = _experts(qtypes, 16, 512, 256, rng)
    x = torch.randn(2, 512) * 0.1
    ids, w = _choices(2, 16, 6, rng)
    one = cpu.moe_experts(x, ids, w, g, u, d, qtypes, threads=1)
    for t in (2, 5, 12):
        torch.testing.assert_close(cpu.moe_experts(x, ids, w, g, u, d, qtypes, threads=t), one, rtol=0, atol=0)


@pytest.mark.parametrize("M", [1, 7])
def test_one_loop_equals_a_loop_a_phase(M, tmp_path):
    """The call's one loop (an expert's down waits for its act) gives the bits of the loop a phase it
    replaced (DSQ_MOE_ONE_LOOP=0, read once a process: run in one of its own), at 1 and 12 threads
    and at each claim size."""
    import os
    import subprocess
    import sys

    rng = np.random.default_rng()
    qtypes = ("Q4_K", "Q4_K", "Q6_K")
    g, u, d = _experts(qtypes, 16, 512, 256, rng)
    x = torch.randn(M, 512) * 0.1
    ids, w = _choices(M, 16, 6, rng)
    torch.save({"x": x, "ids": ids, "w": w, "g": g, "u": u, "d": d}, tmp_path / "in.pt")
    code = (f"import torch; from dsq.kernels import cpu; a = torch.load({str(tmp_path / 'in.pt')!r}); "
            f"torch.save([cpu.moe_experts(a['x'], a['ids'], a['w'], a['g'], a['u'], a['d'], {qtypes!r}, threads=t) "
            f"for t in (1, 12)], {str(tmp_path / 'out.pt')!r})")
    outs = {}
    for env in ({"DSQ_MOE_ONE_LOOP": "0", "DSQ_MOE_GUIDED": "4"}, {"DSQ_MOE_ONE_LOOP": "1", "DSQ_MOE_GUIDED": "1"},
                {"DSQ_MOE_ONE_LOOP": "1"}):
        subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, **env})
        outs[tuple(env.items())] = torch.load(tmp_path / "out.pt")
    first = next(iter(outs.values()))
    for ys in outs.values():
        for y, y0 in zip(ys, first):
            torch.testing.assert_close(y, y0, rtol=0, atol=0)
    torch.testing.assert_close(first[0], _per_expert(x, ids, w, g, u, d, qtypes, None), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", BUILDS)
def test_moe_experts_take_the_callers_int8_tiles(isa):
    """A thread's choice of the int8 tiles at M > 1 (set_int8_rows, as a generation's prefill makes
    it) reaches the pool threads that run the call's units: the experts with several rows round x
    as the same gguf_linear calls on the calling thread do, whichever thread ran them."""
    rng = np.random.default_rng()
    qtypes = ("Q4_K", "Q4_K", "Q6_K")
    g, u, d = _experts(qtypes, 8, 512, 256, rng)
    x = torch.randn(19, 512) * 0.1
    ids, w = _choices(19, 8, 3, rng)
    lib = cpu.load(isa)
    cpu.set_int8_rows(True, lib=lib)
    try:
        same = _per_expert(x, ids, w, g, u, d, qtypes, lib)
        ys = [cpu.moe_experts(x, ids, w, g, u, d, qtypes, threads=t, lib=lib) for t in (1, 4)]
    finally:
        cpu.set_int8_rows(False, lib=lib)
    for y in ys:
        assert float((y - same).abs().max()) <= 1e-5 * float(same.abs().max())


def test_moe_experts_bad_input():
    rng = np.random.default_rng()
    qtypes = ("Q8_0", "Q8_0", "Q8_0")
    g, u, d = _experts(qtypes, 4, 64, 32, rng)
    x = torch.randn(2, 64)
    ids, w = _choices(2, 4, 2, rng)
    with pytest.raises(ValueError, match="expert id"):
        cpu.moe_experts(x, ids + 4, w, g, u, d, qtypes)
    with pytest.raises(ValueError, match="float32"):
        cpu.moe_experts(x.double(), ids, w, g, u, d, qtypes)
    with pytest.raises(ValueError, match="down must be"):
        cpu.moe_experts(x, ids, w, g, u, d[:, :32], qtypes)
    with pytest.raises(ValueError, match="C kernels run"):
        cpu.moe_experts(x, ids, w, g, u, d, ("F16", "Q8_0", "Q8_0"))


def test_moe_host_struct_over_fixed_buffers():
    """dsq_moe_host (the CUDA host function) over buffers refilled between calls, as a captured
    decode step refills them: each call equals moe_experts on that call's inputs; a bad id fails
    and leaves NaNs in out."""
    rng = np.random.default_rng()
    qtypes = ("Q4_K", "Q4_K", "Q6_K")
    g, u, d = _experts(qtypes, 8, 512, 256, rng)
    x, out = torch.zeros(1, 512), torch.zeros(1, 512)
    ids, w = torch.zeros(1, 3, dtype=torch.int64), torch.zeros(1, 3)
    args = cpu.moe_host_args(x, ids, w, g, u, d, qtypes, out, threads=2)
    assert cpu.moe_host_fn() is not None
    for _ in range(3):
        x.copy_(torch.randn(1, 512) * 0.1)
        i2, w2 = _choices(1, 8, 3, rng)
        ids.copy_(i2)
        w.copy_(w2)
        cpu.run_moe_host(args)
        torch.testing.assert_close(out, cpu.moe_experts(x, ids, w, g, u, d, qtypes, threads=2), rtol=0, atol=0)
    ids[0, 0] = 8
    with pytest.raises(ValueError, match="refused"):
        cpu.run_moe_host(args)
    assert torch.isnan(out).all()
