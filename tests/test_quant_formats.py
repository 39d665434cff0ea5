"""On-disk quantized formats against their reference libraries and specs: AWQ packing against
autoawq's own unpacking helpers, GPTQ words as the spec says, compressed-tensors configs through
the compressed-tensors package's pydantic models, FP8 round trips."""

from __future__ import annotations

import pytest
import torch

from dsq.formats import fp8_checkpoint as f8
from dsq.formats import awq_gptq


def test_awq_interleave_spec():
    assert int(awq_gptq.pack_awq(torch.arange(8)[None]).item()) & 0xFFFFFFFF == 0x75316420


def test_awq_packing_matches_autoawq():
    from awq.utils.packing_utils import dequantize_gemm, reverse_awq_order, unpack_awq

    K, N, g = 256, 64, 128
    q = torch.randint(0, 16, (N, K))
    scales = torch.rand(K // g, N) + 0.01
    zeros = torch.randint(0, 16, (K // g, N))
    t = awq_gptq.awq_tensors(q, scales, zeros)
    iw, iz = reverse_awq_order(*unpack_awq(t["qweight"], t["qzeros"], 4), 4)
    assert torch.equal(iw & 15, q.t().to(iw.dtype)) and torch.equal(iz & 15, zeros.to(iz.dtype))
    theirs = dequantize_gemm(t["qweight"], t["qzeros"], t["scales"], 4, g)  # (K, N), AutoAWQ's layout, fp16 math
    ours = awq_gptq.awq_dequantize(t["qweight"], t["qzeros"], t["scales"], g)  # (N, K)
    torch.testing.assert_close(ours.t(), theirs.float(), rtol=2e-3, atol=1e-2)
    want = ((q.float().t() - zeros.float().repeat_interleave(g, 0)) * scales.half().float().repeat_interleave(g, 0)).t()
    torch.testing.assert_close(ours, want)


def test_gptq_words_follow_the_spec():
    K, N, g = 256, 32, 128
    q = torch.randint(0, 16, (N, K))
    zeros = torch.full((K // g, N), 8)
    scales = torch.rand(K // g, N)
    g_idx = torch.arange(K) // g
    v1 = awq_gptq.gptq_tensors(q, scales, zeros, g_idx, 4, v1=True)
    v2 = awq_gptq.gptq_tensors(q, scales, zeros, g_idx, 4, v1=False)
    assert (v1["qzeros"].long() & 0xFFFFFFFF == 0x77777777).all()
    assert (v2["qzeros"].long() & 0xFFFFFFFF == 0x88888888).all()
    assert v1["qweight"].shape == (K * 4 // 32, N) and v1["qzeros"].shape == (K // g, N * 4 // 32)
    # qweight[r, n] |= q[r*8 + j, n] << 4j
    w = v1["qweight"].long() & 0xFFFFFFFF
    assert int(w[1, 3]) == sum(int(q[3, 8 + j]) << (4 * j) for j in range(8))
    with pytest.raises(Exception, match="GPTQ v1"):
        awq_gptq.gptq_tensors(q, scales, torch.zeros_like(zeros), g_idx, 4, v1=True)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_round_trip_with_act_order(bits):
    K, N, g = 512, 64, 128
    q = torch.randint(0, 2**bits, (N, K))
    zeros = torch.randint(0, 2**bits, (K // g, N))
    scales = torch.rand(K // g, N) + 0.01
    g_idx = torch.randperm(K) // g  # act-order: groups are not contiguous in channel order
    t = awq_gptq.gptq_tensors(q, scales, zeros, g_idx, bits, v1=False)
    got = awq_gptq.gptq_dequantize(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits, v1=False)
    want = (q.float() - zeros.float().t()[:, g_idx]) * scales.half().float().t()[:, g_idx]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("strategy", ["channel", "block"])
def test_compressed_tensors_config_validates(strategy):
    from compressed_tensors.quantization import QuantizationConfig

    cfg = f8.compressed_tensors_config(strategy, ["lm_head"])
    parsed = QuantizationConfig.model_validate(cfg)
    w = parsed.config_groups["group_0"].weights
    assert w.strategy == strategy and w.num_bits == 8 and w.type == "float"
    if strategy == "block":
        assert w.block_structure == [128, 128]


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_fp8_round_trip(scheme):
    from dsq.quant.fp8 import fp8_quantize

    w = torch.randn(300, 260) * torch.rand(300, 1) * 5
    q, scale = fp8_quantize(w, scheme)
    assert q.dtype == torch.float8_e4m3fn
    assert scale.shape == ((300, 1) if scheme == "channel" else (3, 3))
    d = f8.fp8_dequantize(q, scale)
    assert float((d - w).norm() / w.norm()) < 0.04  # e4m3 keeps 3 mantissa bits
    assert float(q.float().abs().max()) <= 448
