"""The int8-activation quality bench (benchmarks.act_q8): inside its context every GGUF matmul sees
x exactly as the GPU's int8-activation GEMV does (packed.dequantize_x_q8) or rounded to bf16,
and the dispatcher is restored afterwards; on a tiny model, the comparison's numbers are sane."""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.act_q8 import compare, rounded_activations
from dsq.kernels import dispatch, gguf_ref, packed
from test_kernels_ref import random_blocks


def test_rounding_is_applied_and_undone():
    raw = torch.from_numpy(random_blocks("Q4_K", 16, 256, np.random.default_rng(0)))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)) * 4
    orig = dispatch.gguf_linear
    with rounded_activations("int8"):
        y8 = dispatch.gguf_linear(x, raw, "Q4_K", 256)
    with rounded_activations("bf16"):
        yb = dispatch.gguf_linear(x, raw, "Q4_K", 256)
    assert dispatch.gguf_linear is orig
    # atol: the C kernel and the reference add 256 products in different orders (4e-4 apart seen on
    # an output of 2.4); x's rounding moves outputs by ~2e-3 of their size, far beyond rtol
    torch.testing.assert_close(y8, gguf_ref.gguf_linear_ref(packed.dequantize_x_q8(x), raw, "Q4_K", 256),
                               rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(yb, gguf_ref.gguf_linear_ref(x.bfloat16().float(), raw, "Q4_K", 256),
                               rtol=1e-4, atol=1e-3)
    assert not torch.allclose(y8, dispatch.gguf_linear(x, raw, "Q4_K", 256), rtol=0, atol=1e-6)


def test_compare_on_a_tiny_gguf(tiny_gguf):
    from dsq.runtime.engine import load

    model = load(str(tiny_gguf("llama", "Q4_K_M")), backend="native", ctx=64)
    ids = list(np.random.default_rng(0).integers(3, 200, size=130))
    r = compare(model, [int(i) for i in ids], 64)
    assert r["tokens"] == 2 * 63
    assert 0 < r["kld_int8x"] < 0.5 and 0 <= r["kld_bf16x"] < 0.5
    assert 0.5 < r["top1_int8x"] <= 1 and 1 < r["ppl_float"] < 1e6
