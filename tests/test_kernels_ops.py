"""The C CPU kernels as torch operators (kernels/ops.py): the same outputs as the ctypes calls,
a fake (shape) implementation that passes torch's operator checks, and a function through the
dispatcher that torch.compile traces without a graph break."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsq.kernels import cpu, dispatch, gguf_ref, packed
from test_kernels_ref import int8_x, random_blocks

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no CPU kernels built")


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_0", "Q6_K", "Q8_0"])
def test_operators_equal_the_ctypes_calls(qtype):
    from dsq.kernels import ops

    raw = torch.from_numpy(random_blocks(qtype, 40, 512, np.random.default_rng(0)))
    x = torch.randn(2, 3, 512)
    bias = torch.randn(40)
    assert torch.equal(ops.gguf_linear(x, raw, qtype, 512), cpu.gguf_linear(x, raw, qtype, 512))
    assert torch.equal(ops.gguf_linear(x, raw, qtype, 512, bias), cpu.gguf_linear(x, raw, qtype, 512, bias))
    ids = torch.tensor([[1, 39], [0, 0]])
    assert torch.equal(ops.gguf_rows(ids, raw, qtype, 512), cpu.gguf_rows(ids, raw, qtype, 512))
    torch.library.opcheck(torch.ops.dsq.gguf_linear.default, (x, raw, qtype, 512, bias))
    torch.library.opcheck(torch.ops.dsq.gguf_rows.default, (ids, raw, qtype, 512))


@pytest.mark.skipif(not hasattr(cpu.library()[0], "dsq_int_gemm"), reason="a build without the int / FP8 kernels")
def test_int_and_fp8_operators():
    from dsq.kernels import ops
    from test_kernels_cpu_intq import random_fp8, random_int

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 256)
    qw, scales, zeros = random_int(24, 256, 64, 4, gen)
    perm, bias = torch.randperm(256), torch.randn(24)
    want = cpu.int_linear(x, qw, scales, zeros, 4, perm, bias)
    assert torch.equal(ops.int_linear(x, qw, scales, zeros, 4, perm, bias), want)
    torch.library.opcheck(torch.ops.dsq.int_linear.default, (x, qw, scales, zeros, 4, perm, bias))
    weight, scale = random_fp8(24, 256, "channel", gen)
    assert torch.equal(ops.fp8_linear(x, weight, scale, bias), cpu.fp8_linear(x, weight, scale, bias))
    # (its schema check multiplies the float8 weight, which torch cannot do on the CPU)
    torch.library.opcheck(torch.ops.dsq.fp8_linear.default, (x, weight, scale, bias),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_compiled_through_the_dispatcher():
    """fullgraph=True: the kernel is an operator in the graph, the small ops around it fuse."""
    raw = torch.from_numpy(random_blocks("Q4_K", 64, 512, np.random.default_rng(1)))
    emb = torch.from_numpy(random_blocks("Q8_0", 10, 512, np.random.default_rng(2)))

    def f(ids):
        x = dispatch.gguf_embedding(ids, emb, "Q8_0", 512, torch.float32) * 2.0
        return torch.nn.functional.gelu(dispatch.gguf_linear(torch.rms_norm(x, (512,)), raw, "Q4_K", 512)) + 1

    ids = torch.tensor([[3, 1, 4]])
    with torch.inference_mode():
        got, want = torch.compile(f, fullgraph=True, dynamic=False)(ids), f(ids)
        x = torch.rms_norm(dispatch.gguf_embedding(ids, emb, "Q8_0", 512, torch.float32) * 2.0, (512,))
    # The two differ only where inductor computes the RMS norm its own way (fused, another order
    # of the sum of squares); the kernel after it is the same C call. The path's error bound: each
    # RMS norm is within (K + 3) u of exact in every value (K = 512 squares summed, the mean, the
    # root, the product), so the two x differ by at most 2 (K + 3) u relatively; the kernel's float
    # dot of K terms errs by at most K u / (1 - K u) of sum_k |x_k w_k| on each side (on AVX512-VNNI
    # x is first rounded to 24-bit integers per 32 values, a relative 2^-23 of the block's largest
    # |x| more; on the avx2 build to int8, 1/254 of it); gelu's slope is at most 1.13, and the + 1
    # rounds once more (u of the output). A wrong operator, dtype or row is off by ~ sum_k |x_k w_k|
    # itself and fails.
    u, K = 2.0**-24, 512
    step = 1 / 254 if int8_x(cpu.library()[1], "Q4_K", 3) else 2.0**-23
    w = gguf_ref.dequantize(raw, "Q4_K", 512).double()
    terms = x.double().abs() @ w.abs().T
    xq = x.double().abs().reshape(*x.shape[:-1], K // 32, 32).amax(-1).repeat_interleave(32, -1) @ w.abs().T * step
    bound = 1.13 * ((2 * (K + 3) * u + 2 * K * u / (1 - K * u)) * terms + 2 * xq) + u * want.double().abs()
    err = (got.double() - want.double()).abs()
    assert (err <= bound).all(), f"worst {float((err / bound).max()):.2f} x the bound"


def test_packed_linear_is_one_operator_under_compile():
    """The GPU layout's matmul (Triton on a GPU, the reference here) stays one opaque operator in a
    compiled graph (dynamo cannot trace the Triton launcher), with act-order, K-quant and FP8
    block planes passed through, and the compiled function equals the eager one."""
    from dsq.bench.random_models import random_packed
    from dsq.kernels import ops

    for fmt in ["int4-g128-actorder", "Q4_K", "fp8-block"]:
        p = random_packed(fmt, 48, 256, device="cpu")
        bias = torch.randn(48)

        def f(x, p=p, bias=bias):
            return torch.relu(dispatch.packed_linear(x * 2, p, bias)) + 1

        x = torch.randn(3, 256)
        ex = torch._dynamo.explain(f)(x)
        assert ex.graph_break_count == 0
        assert "dsq.packed_linear" in "".join(str(g.graph) for g in ex.graphs)
        torch.testing.assert_close(torch.compile(f, fullgraph=True)(x), f(x))
        torch.testing.assert_close(ops.packed_linear_op(x, p, bias), packed.linear_ref(x, p, bias))


def test_linear_add_under_compile_is_the_operator_with_the_residual_as_bias(monkeypatch):
    """dispatch.linear_add's fused residual (one row through the int8-x GEMV) under torch.compile:
    the one dsq.packed_linear operator with the residual as its bias, no graph break, and the
    compiled function equals the eager one. Without a GPU on the GPU's route (_triton_device) with
    the kernel in Triton's interpreter."""
    import torch.nn.functional as F
    from triton_interp import CUDA, DEV

    from dsq.bench.random_models import random_packed
    from dsq.kernels import triton_gemv_q8
    from dsq.runtime.qmodules import PackedLinear

    if not dispatch.ACT_Q8:
        pytest.skip("DSQ_ACT_Q8=0: no int8-x GEMV")
    if not CUDA:
        monkeypatch.setattr(dispatch, "_triton_device", lambda x: True)
    seen, real = [], triton_gemv_q8.q8_linear
    monkeypatch.setattr(triton_gemv_q8, "q8_linear",
                        lambda x, p, bias=None, **k: seen.append(bias is not None) or real(x, p, bias, **k))
    mod = PackedLinear(random_packed("Q4_K", 48, 256, device=DEV), None, "Q4_K")

    def f(x, r):
        return dispatch.linear_add(mod, F.silu(x), r) * 1.5

    x, r = torch.randn(1, 1, 256, device=DEV), torch.randn(1, 1, 48, device=DEV)
    with torch.inference_mode():
        want = f(x, r)
        assert seen == [True]
        ex = torch._dynamo.explain(f)(x, r)
        assert ex.graph_break_count == 0
        assert "dsq.packed_linear" in "".join(str(g.graph) for g in ex.graphs)
        seen.clear()
        got = torch.compile(f, fullgraph=True)(x, r)
    assert seen == [True]
    assert float((got - want).norm() / want.norm()) < 1e-4
