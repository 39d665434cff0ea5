"""The GGUF C kernels at M > 1 (prefill, batches: the register-blocked path of the avx512 and
avx2 builds, kernels/csrc/gguf_gemm_cpu.inc) against the float64 reference: every format and
build, M from 2 to 130 (whole and partial tiles of rows of x), odd N (partial tiles of rows of W),
K over several panels, x spanning decades, outputs poisoned before each call."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsq.kernels import cpu, gguf_ref
from test_kernels_cpu import on_1_and_2_threads
from test_kernels_ref import FORMATS, random_blocks

BUILDS = [isa for isa in cpu.supported_isas() if cpu.load(isa) is not None]
pytestmark = pytest.mark.skipif(not BUILDS, reason="no CPU kernels built")

# (M, N, blocks per row): M and N off the 4-row tiles, K across one or more 1024-value panels and
# (M=130 with 7 super-blocks) x larger than the group of rows a thread walks its tiles with
SHAPES = [(2, 1, 1), (3, 5, 2), (4, 7, 3), (5, 13, 5), (7, 37, 4), (16, 9, 2), (17, 33, 6), (64, 3, 1),
          (129, 11, 3), (130, 21, 7)]


def _k(qtype: str, blocks: int) -> int:
    per = gguf_ref.BLOCKS[qtype][0]
    return per * blocks if per == 256 else 32 * (9 * blocks + 1)  # 32-blocks: 10 to 64 blocks


def _check(y: torch.Tensor, x: torch.Tensor, raw: torch.Tensor, qtype: str, K: int) -> None:
    w = gguf_ref.dequantize(raw, qtype, K).double()
    ref = torch.nn.functional.linear(x.double(), w)
    # relative to the size of the summed terms (see test_kernels_cpu.py)
    scale = torch.nn.functional.linear(x.double().abs(), w.abs())
    assert float(((y.double() - ref).abs() / scale.clamp(min=1e-30)).max()) < 1e-5


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("M,N,blocks", SHAPES)
def test_gemm_batches(isa, qtype, M, N, blocks):
    rng = np.random.default_rng()
    K = _k(qtype, blocks)
    raw = torch.from_numpy(random_blocks(qtype, N, K, rng))
    x = torch.randn(M, K) * torch.exp(torch.empty(M, K).uniform_(-4, 4))
    out = torch.full((M, N), float("nan"))
    y = cpu.gguf_linear(x, raw, qtype, K, out=out, lib=cpu.load(isa))
    assert y.data_ptr() == out.data_ptr() and not torch.isnan(out).any()
    _check(y, x, raw, qtype, K)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("qtype", FORMATS)
def test_gemm_non_finite_x(isa, qtype):
    """A row of x with an inf (or a NaN) gives non-finite outputs in that row, as at M = 1; the
    other rows are unaffected."""
    rng = np.random.default_rng()
    M, N, K = 6, 13, _k(qtype, 3)
    raw = torch.from_numpy(random_blocks(qtype, N, K, rng))
    x = torch.randn(M, K)
    x[1, 77] = float("inf")
    x[4, 5] = float("nan")
    y = cpu.gguf_linear(x, raw, qtype, K, out=torch.full((M, N), float("nan")), lib=cpu.load(isa))
    assert not torch.isfinite(y[[1, 4]]).any()
    ok = [0, 2, 3, 5]
    assert torch.isfinite(y[ok]).all()
    _check(y[ok], x[ok], raw, qtype, K)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("qtype", FORMATS)
def test_gemm_same_bits_any_thread_count(isa, qtype):
    """Each output is one fixed sequence of float operations: 1 and 2 threads give the same bits,
    and a row of x gives the same bits whatever the other rows of the batch."""
    rng = np.random.default_rng()
    M, N, K = 9, 45, _k(qtype, 5)
    raw = torch.from_numpy(random_blocks(qtype, N, K, rng))
    x = torch.randn(M, K)
    lib = cpu.load(isa)
    one, two = on_1_and_2_threads(lambda: cpu.gguf_linear(x, raw, qtype, K, lib=lib))
    assert torch.equal(one, two)
    other = torch.cat([x[:5], torch.randn(3, K)])  # rows 0-4 again, in another batch
    assert torch.equal(cpu.gguf_linear(other, raw, qtype, K, lib=lib)[:5], one[:5])
