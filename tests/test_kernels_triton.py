"""The Triton kernels (kernels/triton_*.py) against each format's torch reference: every GGUF
format, int4/int8 (AWQ and GPTQ with act-order), FP8 with tensor/channel/block scales; odd shapes,
M = 1 (GEMV) and M > 1 (tl.dot), with bias, outputs poisoned before each call.

Without a GPU the kernels run under TRITON_INTERPRET=1 on small shapes (CI); with one, on the
GPU, the same tests plus real model shapes through the autotuned path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from triton_interp import CUDA, DEV

from dsq.kernels import fp8_ref, gguf_ref, intq_ref, packed  # noqa: E402
from dsq.kernels import triton_common, triton_dequant, triton_gemm, triton_gemv_q8  # noqa: E402
from test_kernels_ref import FORMATS, random_blocks  # noqa: E402

from dsq.formats import awq_gptq as disk  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def check(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(y).all(), "an output was left unwritten (NaN poison) or overflowed"
    err = float((y.double().cpu() - ref.double()).norm() / ref.double().norm())
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


def run(x: torch.Tensor, p: packed.Packed, bias=None, config=None) -> torch.Tensor:
    out = torch.full((x.shape[0], p.N), float("nan"), dtype=x.dtype, device=DEV)
    y = triton_gemm.packed_linear(x.to(DEV), p.to(DEV), None if bias is None else bias.to(DEV), out=out, config=config)
    assert y.data_ptr() == out.data_ptr()
    return y


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gguf_formats(qtype, M, dtype):
    rng = np.random.default_rng()
    per = gguf_ref.BLOCKS[qtype][0]
    N, K = int(rng.integers(1, 40)), per * (3 if per == 32 else 2)  # K: 96 or 512 elements, N odd sizes
    raw = torch.from_numpy(random_blocks(qtype, N, K, rng))
    x, bias = torch.randn(M, K).to(dtype), torch.randn(N)
    ref = torch.nn.functional.linear(x.double(), gguf_ref.dequantize(raw, qtype, K).double(), bias.double())
    check(run(x, packed.from_gguf(raw, qtype, K), bias), ref, dtype)


def gptq_case(N, K, g, bits, act_order, v1):
    q = torch.randint(0, 2**bits, (N, K))
    s = torch.rand(K // g, N) * 0.02 + 0.001
    z = torch.randint(1 if v1 else 0, 2**bits, (K // g, N))
    gi = torch.arange(K) // g
    if act_order:
        perm = torch.randperm(K)
        gi = torch.empty(K, dtype=torch.long)
        gi[perm] = torch.arange(K) // g
    t = disk.gptq_tensors(q, s, z, gi, bits, v1)
    return intq_ref.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits, v1)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group,act_order", [(32, False), (128, True), (-1, False)])
@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gptq_int(bits, group, act_order, M, dtype):
    N, K = 24, 384
    d = gptq_case(N, K, K if group == -1 else group, bits, act_order, v1=bits == 4)
    assert ("perm" in d) == act_order
    x, bias = torch.randn(M, K).to(dtype), torch.randn(N)
    ref = intq_ref.int_linear_ref(x.double(), d["qweight"], d["scales"], d["zeros"], bits, d.get("perm"), bias)
    check(run(x, packed.from_int(d["qweight"], d["scales"], d["zeros"], bits, d.get("perm")), bias), ref, dtype)


@pytest.mark.parametrize("M", [1, 4])
def test_awq_int4(M):
    N, K, g = 48, 256, 64
    q, z = torch.randint(0, 16, (N, K)), torch.randint(0, 16, (K // g, N))
    s = torch.rand(K // g, N) * 0.02 + 0.001
    t = disk.awq_tensors(q, s, z)
    d = intq_ref.from_awq(t["qweight"], t["qzeros"], t["scales"], g)
    x = torch.randn(M, K)
    want = x.double() @ disk.awq_dequantize(t["qweight"], t["qzeros"], t["scales"], g).double().t()
    check(run(x, packed.from_int(d["qweight"], d["scales"], d["zeros"], 4)), want, torch.float32)


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q5_0", "Q5_K", "int4-g32", "fp8-channel"])
@pytest.mark.parametrize("M,bn,bk", [(1, 4, 256), (1, 8, 256), (1, 8, 512), (4, 16, 256)])
def test_wide_tiles_hold_many_groups(fmt, M, bn, bk):
    """Tiles of 256 elements hold 8-16 scale groups (the shapes the GPU autotuner picks); at M=1
    both GEMVs: four row tensors (BN 4) and rows as a tensor dimension (BN 8, two-stage pipeline),
    with K a multiple of the tile (no K mask: EVEN_K) and not (BK 512: a masked tail)."""
    rng = np.random.default_rng()
    N, K = 9, 768
    if fmt == "int4-g32":
        d = gptq_case(16, K, 32, 4, False, True)
        p = packed.from_int(d["qweight"], d["scales"], d["zeros"], 4)
        N = 16
    elif fmt == "fp8-channel":
        p = packed.from_fp8((torch.randn(N, K) * 3).to(torch.float8_e4m3fn), torch.rand(N, 1) + 0.01)
    else:
        p = packed.from_gguf(torch.from_numpy(random_blocks(fmt, N, K, rng)), fmt, K)
    x = torch.randn(M, K)
    cfg = {"BN": bn, "BK": bk, "STAGES": 2} if M == 1 else {"BM": 16, "BN": bn, "BK": bk}
    check(run(x, p, config=cfg), x.double() @ packed.dequantize(p).double().t(), torch.float32)


def test_unsupported_group_falls_back_to_the_reference():
    from dsq.kernels import dispatch

    d = gptq_case(8, 192, 96, 4, False, True)  # a group of 96 is not a power of two
    p = packed.from_int(d["qweight"], d["scales"], d["zeros"], 4)
    assert not triton_common.supported(p, torch.randn(1, 192))
    x = torch.randn(2, 192)
    torch.testing.assert_close(dispatch.packed_linear(x, p), packed.linear_ref(x, p))


@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
@pytest.mark.parametrize("M", [1, 6])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8(kind, M, dtype):
    N, K = 200, 300  # not multiples of the 128 block
    w = (torch.randn(N, K) * 3).to(torch.float8_e4m3fn)
    scale = {"tensor": torch.rand(1), "channel": torch.rand(N, 1), "block": torch.rand(2, 3)}[kind] + 0.01
    x = torch.randn(M, K).to(dtype)
    check(run(x, packed.from_fp8(w, scale)), fp8_ref.fp8_linear_ref(x.double(), w, scale), dtype)


def test_a_row_long_group_reaches_the_kernels_as_a_power_of_two():
    """FP8 per tensor or channel and GPTQ without groups have one group a row (K = 300 here): the
    kernels build tile shapes from SUB, which a GPU needs in powers of two, so SUB is the power of
    two at or above K (every column still in group 0); groups shorter than a row pass as they are."""
    from dsq.kernels.triton_common import fmt_flags

    w = (torch.randn(8, 300) * 3).to(torch.float8_e4m3fn)
    for scale in (torch.rand(1), torch.rand(8, 1)):
        assert fmt_flags(packed.from_fp8(w, scale + 0.01))["SUB"] == 512
    assert fmt_flags(packed.from_fp8(w, torch.rand(1, 3) + 0.01))["SUB"] == 128  # 128-wide blocks


def test_fp8_subnormals_and_signs_decode_exactly():
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # the two e4m3fn NaN codes
    w = codes.repeat(2, 1).view(torch.float8_e4m3fn)  # (2, 256): every finite value
    x = torch.zeros(2, w.shape[1])
    x[0, 7] = 1.0
    x[1, 200] = 1.0
    y = run(x, packed.from_fp8(w, torch.ones(1)))
    torch.testing.assert_close(y.cpu(), w.float()[:, [7, 200]].t(), rtol=0, atol=0)


def test_fused_rows_equal_separate():
    rng = np.random.default_rng()
    K = 256
    parts = [packed.from_gguf(torch.from_numpy(random_blocks("Q4_K", n, K, rng)), "Q4_K", K) for n in (16, 8, 8)]
    x = torch.randn(1, K)
    fused = run(x, packed.Packed.cat(parts))
    torch.testing.assert_close(fused, torch.cat([run(x, p) for p in parts], dim=-1))
    with pytest.raises(ValueError):
        packed.Packed.cat([parts[0], packed.from_gguf(torch.from_numpy(random_blocks("Q6_K", 4, K, rng)), "Q6_K", K)])


def test_act_order_rows_fuse_when_they_share_an_order():
    """GPTQ act-order linears reading one input share one column order: they stack into one
    weight with that order (one GEMV and one rounding of x instead of three), equal to the
    separate products; different orders (or one with an order, one without) do not stack."""
    K = 256
    perm = torch.randperm(K)
    parts = []
    for n in (16, 8, 8):
        d = gptq_case(n, K, 64, 4, True, True)
        parts.append(packed.from_int(d["qweight"], d["scales"], d["zeros"], 4, perm))  # one order, as one Hessian gives
    fused = packed.Packed.cat(parts)
    assert fused.N == 32 and torch.equal(fused.perm, perm)
    x = torch.randn(2, K)
    torch.testing.assert_close(run(x, fused), torch.cat([run(x, p) for p in parts], dim=-1))
    other = gptq_case(8, K, 64, 4, True, True)
    plain = gptq_case(8, K, 64, 4, False, True)
    for q in (packed.from_int(other["qweight"], other["scales"], other["zeros"], 4, other["perm"]),
              packed.from_int(plain["qweight"], plain["scales"], plain["zeros"], 4, None)):
        with pytest.raises(ValueError):
            packed.Packed.cat([parts[0], q])


def _dequant_case(fmt: str):
    rng = np.random.default_rng()
    if fmt.startswith("int"):  # int4-g32 (K not a multiple of the 128-column tile), int4-g128 act-order, int8
        bits, g = (8, 672) if fmt == "int8-row" else (4, 32 if fmt == "int4-g32" else 128)
        K = 672 if g in (32, 672) else 640
        d = gptq_case(40, K, g, bits, fmt.endswith("-act"), True)
        return packed.from_int(d["qweight"], d["scales"], d["zeros"], bits, d.get("perm"))
    if fmt.startswith("fp8"):
        N, K = 200, 300  # not multiples of the 128 block
        scale = {"fp8-tensor": torch.rand(1), "fp8-channel": torch.rand(N, 1), "fp8-block": torch.rand(2, 3)}[fmt]
        return packed.from_fp8((torch.randn(N, K) * 3).to(torch.float8_e4m3fn), scale + 0.01)
    return packed.from_gguf(torch.from_numpy(random_blocks(fmt, 37, 768, rng)), fmt, 768)


@pytest.mark.parametrize("fmt", FORMATS + ["int4-g32", "int4-g128-act", "int8-row", "fp8-tensor", "fp8-channel",
                                           "fp8-block"])
def test_dequantize_writes_every_weight_exactly(fmt):
    """dequantize (the weight written out for a cuBLAS GEMM at many rows): every element of a
    NaN-poisoned output, equal to the reference dequantization in float32, in the stored column
    order; odd N, masked K tails (K 672 against 128-column tiles, FP8's 300)."""
    p = _dequant_case(fmt)
    out = torch.full((p.N, p.K), float("nan"), device=DEV)
    w = triton_dequant.dequantize(p.to(DEV), torch.float32, out=out)
    assert w.data_ptr() == out.data_ptr()
    torch.testing.assert_close(w.cpu(), packed.dequantize(p).float(), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["Q4_K", "int4-g128-act", "fp8-block"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequant_linear_matches_the_reference(fmt, dtype):
    p = _dequant_case(fmt)
    x, bias = torch.randn(2, 3, p.K).to(dtype), torch.randn(p.N)
    ref = packed.linear_ref(x.double(), p, bias.double())
    y = triton_dequant.dequant_linear(x.to(DEV), p.to(DEV), bias.to(DEV))
    assert y.shape == (2, 3, p.N)
    check(y.reshape(-1, p.N), ref.reshape(-1, p.N), dtype)
    out = torch.full((6, p.N), float("nan"), dtype=dtype, device=DEV)
    check(triton_dequant.dequant_linear(x.reshape(6, -1).to(DEV), p.to(DEV), bias.to(DEV), out=out),
          ref.reshape(-1, p.N), dtype)


@pytest.mark.parametrize("fmt", ["Q6_K", "int4-g128-act", "fp8-block"])
def test_dequant_linear_in_slabs(fmt, monkeypatch):
    """A weight larger than the slab is written out and multiplied a slab of rows at a time (whole
    FP8 blocks of rows): never more than one slab of it is written, and y is the whole weight's."""
    if fmt == "Q6_K":
        p = packed.from_gguf(torch.from_numpy(random_blocks(fmt, 296, 256, np.random.default_rng())), fmt, 256)
    elif fmt == "fp8-block":
        p = packed.from_fp8((torch.randn(296, 256) * 3).to(torch.float8_e4m3fn), torch.rand(3, 2) + 0.01)
    else:
        d = gptq_case(296, 256, 128, 4, True, True)
        p = packed.from_int(d["qweight"], d["scales"], d["zeros"], 4, d.get("perm"))
    written, dequantize = [], triton_dequant.dequantize
    monkeypatch.setattr(triton_dequant, "dequantize", lambda q, *a, **k: written.append(q.N) or dequantize(q, *a, **k))
    x, bias = torch.randn(5, p.K), torch.randn(p.N)
    y = triton_dequant.dequant_linear(x.to(DEV), p.to(DEV), bias.to(DEV), slab_bytes=1)
    assert written == [128, 128, 40]
    from dsq.runtime import placement

    assert placement._DEQUANT_SLAB == triton_dequant.SLAB_BYTES  # the planner counts the same slab
    check(y, packed.linear_ref(x.double(), p, bias.double()), torch.float32)


@pytest.mark.parametrize("N,K", [(37888, 3584), (3584, 18944), (28672, 4096), (4608, 3584), (1000, 64), (300, 1 << 20)])
def test_slab_rows_are_few_equal_and_within_the_limit(N, K):
    """Slabs: whole 128-row blocks, each within SLAB_BYTES unless one block alone is larger, as few as
    that allows (a prefill's launches), and no sliver at the end."""
    step = triton_dequant.slab_rows(N, K, 2)
    limit = triton_dequant.SLAB_BYTES
    n = -(-N // step)
    assert step == N or step % 128 == 0
    assert step * K * 2 <= limit or step == min(N, 128)
    fewest = -(-N * K * 2 // limit)
    assert n <= fewest + 1
    if n > 1 and step > 128:
        assert N - (n - 1) * step >= 128  # the last slab holds at least a block


def test_dequant_linear_slabs_write_into_out():
    """Each slab's GEMM writes its columns of the given `out` (no temporary y)."""
    p = packed.from_gguf(torch.from_numpy(random_blocks("Q4_K", 300, 256, np.random.default_rng())), "Q4_K", 256)
    x, bias = torch.randn(3, p.K), torch.randn(p.N)
    out = torch.full((3, p.N), float("nan"), device=DEV)
    y = triton_dequant.dequant_linear(x.to(DEV), p.to(DEV), bias.to(DEV), out=out, slab_bytes=1)
    assert y.data_ptr() == out.data_ptr()
    check(out, packed.linear_ref(x.double(), p, bias.double()), torch.float32)


@pytest.mark.skipif(not CUDA, reason="real shapes need a GPU")
@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "int4", "fp8"])
def test_dequant_linear_real_shapes(fmt):
    rng = np.random.default_rng()
    N, K, M = 4096, 4096, 512
    if fmt == "int4":
        d = gptq_case(N, K, 128, 4, True, True)
        p = packed.from_int(d["qweight"], d["scales"], d["zeros"], 4, d.get("perm"))
    elif fmt == "fp8":
        p = packed.from_fp8(torch.randn(N, K).to(torch.float8_e4m3fn), torch.rand(N // 128, K // 128) + 0.01)
    else:
        p = packed.from_gguf(torch.from_numpy(random_blocks(fmt, N, K, rng)), fmt, K)
    x = torch.randn(M, K, dtype=torch.bfloat16)
    check(triton_dequant.dequant_linear(x.cuda(), p.to("cuda")), packed.linear_ref(x.double(), p), torch.bfloat16)


def test_dispatcher_writes_weights_out_from_the_set_row_count(monkeypatch):
    from dsq.kernels import dispatch

    p = _dequant_case("Q4_K")
    assert dispatch.DEQUANT_MIN_ROWS == 128 and not dispatch.DEQUANT_FP8  # the defaults (DSQ_DEQUANT_ROWS unset)
    assert [dispatch.gpu_kernel(p, m, torch.bfloat16) for m in (64, 127, 128, 512)] == [
        "mma_scaled", "float", "dequant", "dequant"]
    fp8 = _dequant_case("fp8-channel")
    assert dispatch.gpu_kernel(fp8, 512, torch.bfloat16) == "float"  # FP8 only when asked
    monkeypatch.setattr(dispatch, "DEQUANT_FP8", True)
    assert dispatch.gpu_kernel(fp8, 512, torch.bfloat16) == "dequant"
    monkeypatch.setattr(dispatch, "DEQUANT_MIN_ROWS", 0)
    assert dispatch.gpu_kernel(p, 4096, torch.bfloat16) == "float"  # DSQ_DEQUANT_ROWS=0: never
    monkeypatch.setattr(dispatch, "DEQUANT_MIN_ROWS", 256)
    assert [dispatch.gpu_kernel(p, m, torch.bfloat16) for m in (64, 255, 256, 4096)] == [
        "mma_scaled", "float", "dequant", "dequant"]


@pytest.mark.parametrize("qtype", FORMATS)
def test_gguf_conversion_in_row_chunks_equals_one_piece(qtype):
    """from_gguf converts a few rows at a time into outputs allocated once (a big output head
    otherwise took 26x its size in temporaries): same tensors, a partial last chunk included."""
    K = 512
    raw = torch.from_numpy(random_blocks(qtype, 37, K, np.random.default_rng()))
    whole, parts = packed.from_gguf(raw, qtype, K), packed.from_gguf(raw, qtype, K, chunk=5 * K)
    assert whole.fmt == parts.fmt and whole.tensors().keys() == parts.tensors().keys()
    for k, v in whole.tensors().items():
        assert torch.equal(v, parts.tensors()[k]), k


@pytest.mark.skipif(not CUDA, reason="real shapes and autotuning need a GPU")
@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q8_0", "int4", "fp8"])
@pytest.mark.parametrize("M", [1, 16, 300])
def test_real_shapes_autotuned(fmt, M):
    rng = np.random.default_rng()
    N, K = 1024, 4096
    if fmt == "int4":
        d = gptq_case(N, K, 128, 4, False, True)
        p = packed.from_int(d["qweight"], d["scales"], d["zeros"], 4)
    elif fmt == "fp8":
        p = packed.from_fp8((torch.randn(N, K)).to(torch.float8_e4m3fn), torch.rand(N // 128, K // 128) + 0.01)
    else:
        p = packed.from_gguf(torch.from_numpy(random_blocks(fmt, N, K, rng)), fmt, K)
    x = torch.randn(M, K, dtype=torch.bfloat16)
    ref = x.double() @ packed.dequantize(p).double().t()
    y = triton_gemm.packed_linear(x.cuda(), p.to("cuda"))
    check(y, ref, torch.bfloat16)


# -- the int8-activation GEMV (decode, integer codes): x rounded to int8 per 32 elements --------------
def q8_case(fmt: str, N: int, K: int) -> packed.Packed:
    rng = np.random.default_rng()
    if fmt.startswith("gptq"):
        bits = 8 if "int8" in fmt else 4
        d = gptq_case(N, K, 32 if "g32" in fmt else 128, bits, "act" in fmt, True)
        return packed.from_int(d["qweight"], d["scales"], d["zeros"], bits, d.get("perm"))
    return packed.from_gguf(torch.from_numpy(random_blocks(fmt, N, K, rng)), fmt, K)


def run_q8(x, p, bias=None, config=None):
    out = torch.full((x.shape[0], p.N), float("nan"), dtype=x.dtype, device=DEV)
    y = triton_gemv_q8.q8_linear(x.to(DEV), p.to(DEV), None if bias is None else bias.to(DEV), out=out, config=config)
    assert y.data_ptr() == out.data_ptr()
    return y


@pytest.mark.parametrize("fmt", ["gptq-int4", "gptq-int4-act", "gptq-int4-g32", "gptq-int8", "Q4_0", "Q8_0", "Q4_K",
                                 "Q5_0", "Q5_K"])
@pytest.mark.parametrize("cfg,M", [({"BN": 8, "BK": 64, "STAGES": 1}, 1), ({"BN": 4, "BK": 256, "STAGES": 2}, 1),
                                   ({"BN": 2, "BK": 512, "STAGES": 2}, 1), ({"BN": 4, "BK": 256, "PREFETCH": True}, 1),
                                   ({"BN": 1, "BK": 128, "PREFETCH": True}, 1), ({"BN": 2, "BK": 512, "PREFETCH": True}, 1),
                                   ({"BN": 2, "BK": 256, "PREFETCH": True, "PERSIST": 3}, 1),
                                   ({"BN": 4, "BK": 512, "PREFETCH": True, "PERSIST": 2}, 1),
                                   ({"BN": 4, "BK": 128, "STAGES": 2}, 3), ({"BN": 2, "BK": 256, "PREFETCH": True}, 3),
                                   ({"BN": 1, "BK": 512, "PREFETCH": True, "PERSIST": 2}, 4),
                                   ({"BN": 4, "BK": 512, "STAGES": 2}, 5), ({"BN": 8, "BK": 64, "STAGES": 1}, 16)])
def test_q8_gemv_equals_its_reference(fmt, cfg, M):
    """Exactly W (xq sx) (packed.linear_ref_q8) on odd N, with a bias; and within int8 rounding of
    the float product. M = 1 (_gemv_q8, pipelined through shared memory or with PREFETCH in
    registers) and 3, 4, 5, 16 (the same kernel with MR rows of x, also prefetching); K = 768 a
    multiple of the tile (no K mask: EVEN_K; with PREFETCH the last tile is reloaded, not masked)
    or not (BK 512: a masked tail); N a multiple of BN (GPTQ's 24 rows, or BN 1: no row mask,
    EVEN_N) or not; PERSIST: 2-3 programs (the interpreter counts one SM), each walking many row
    tiles with the prefetch running across them."""
    N, K = (24 if fmt.startswith("gptq") else 21), 768  # GPTQ packs rows by 8
    p = q8_case(fmt, N, K)
    assert packed.q8_ok(p)
    x = torch.randn(M, K) * 2
    x[0, 40:72] = 0  # an all-zero block: scale 0
    bias = torch.randn(N)
    y = run_q8(x, p, bias, cfg)
    check(y, packed.linear_ref_q8(x.double(), p, bias.double()).float(), torch.float32)
    # ...and within int8 rounding of the float product: each x moves at most half its block's step
    # (max|x| / 127 per 32 values), so no output is further from it than |W| times those half steps
    exact = packed.linear_ref(x.double(), p, bias.double())
    wt = packed.linear_ref(torch.eye(K, dtype=torch.float64), p, torch.zeros(N, dtype=torch.float64)).abs()  # |W|^T
    half = (x.abs().reshape(M, K // 32, 32).amax(-1) / 254).repeat_interleave(32, -1).double()
    bound = half @ wt + 1e-5 * (x.double().abs() @ wt) + 1e-6  # (+ y's float32 sums)
    assert ((y.double().cpu() - exact).abs() <= bound).all()


def test_q8_x_quantizer_kernel_equals_torch():
    """The Triton x quantizer writes what packed.quantize_x_q8 computes (words, scales, sums)."""
    for codes in (packed.NIB, packed.I8):
        x = torch.randn(1, 32 * 7) * 5
        x[0, 64:96] = 0
        x[0, 96] = 127.0  # block max 127: x / sx is x itself, so ties and near-ties round as torch.round
        x[0, 97:105] = torch.tensor([0.5, 1.5, 2.5, -0.5, 0.49999997, -0.49999997, 126.5, 3.4999998])
        want = packed.quantize_x_q8(x[0], codes)
        xw = torch.full((x.shape[1] // 4,), -1, dtype=torch.int32, device=DEV)
        sx = torch.full((7,), float("nan"), device=DEV)
        xs = torch.full((7,), float("nan"), device=DEV)
        triton_gemv_q8._quant_x[(2, 1)](x.to(DEV), x.to(DEV), xw, sx, xs, x.shape[1], x.shape[1],
                                        NIBBLES=codes == packed.NIB, NBLK=4)
        assert torch.equal(xw.cpu(), want[0])
        torch.testing.assert_close(sx.cpu(), want[1], rtol=1e-6, atol=0)
        torch.testing.assert_close(xs.cpu(), want[2], rtol=1e-5, atol=1e-6)
        perm = torch.randperm(x.shape[1])  # act-order: read through the permutation
        want = packed.quantize_x_q8(x[0, perm], codes)
        triton_gemv_q8._quant_x[(2, 1)](x.to(DEV), perm.to(DEV), xw, sx, xs, x.shape[1], x.shape[1],
                                        NIBBLES=codes == packed.NIB, NBLK=4, HAS_PERM=True)
        assert torch.equal(xw.cpu(), want[0])
        torch.testing.assert_close(sx.cpu(), want[1], rtol=1e-6, atol=0)


@pytest.mark.parametrize("cfg", [{"BN": 8, "BK": 64, "STAGES": 1}, {"BN": 4, "BK": 256, "STAGES": 2},
                                 {"BN": 2, "BK": 512, "STAGES": 2}, {"BN": 1, "BK": 256, "PREFETCH": True},
                                 {"BN": 2, "BK": 512, "PREFETCH": True}, {"BN": 2, "BK": 256, "PREFETCH": True, "PERSIST": 2}])
def test_q8_gemv_q6k(cfg):
    """Q6_K through the int8-x GEMV (one row): 6-bit codes rebuilt from the nibble and 2-bit planes,
    offset by 32 as signed bytes, 16-element scale groups; exactly W (xq sx), K = 768 a multiple of
    the tile or not (BK 512)."""
    N, K = 21, 768
    p = q8_case("Q6_K", N, K)
    assert packed.q8_ok(p) and not packed.q8_ok(p, 2)
    lo = torch.stack([p.lo & 15, p.lo >> 4], -1).reshape(N, K).long()
    hi = ((p.hi[..., None].long() >> torch.arange(0, 8, 2)) & 3).reshape(N, K)
    codes = lo | hi << 4
    assert codes.min() == 0 and codes.max() == 63  # both ends of the sign trick (c - 32 = -32, 31) are met
    x = torch.randn(1, K) * 2
    bias = torch.randn(N)
    y = run_q8(x, p, bias, cfg)
    check(y, packed.linear_ref_q8(x.double(), p, bias.double()).float(), torch.float32)


@pytest.mark.parametrize("M", [1, 3])
def test_q8_rows_q6k_one_row_at_a_time(M):
    """q8_rows_linear: Q6_K's one-row int8-x GEMV per row of x, into one poisoned output: exactly
    each row's int8-x product (the GPU's route at 2-4 rows)."""
    N, K = 21, 512
    p = q8_case("Q6_K", N, K)
    x, bias = torch.randn(M, K) * 2, torch.randn(N)
    out = torch.full((M, N), float("nan"), device=DEV)
    y = triton_gemv_q8.q8_rows_linear(x.to(DEV), p.to(DEV), bias.to(DEV), out=out)
    assert y.data_ptr() == out.data_ptr()
    check(y, packed.linear_ref_q8(x.double(), p, bias.double()).float(), torch.float32)


def test_q8_refuses_what_it_cannot_run():
    rng = np.random.default_rng()
    q6 = packed.from_gguf(torch.from_numpy(random_blocks("Q6_K", 4, 256, rng)), "Q6_K", 256)
    assert packed.q8_ok(q6) and not packed.q8_ok(q6, 3)
    with pytest.raises(ValueError):
        triton_gemv_q8.q8_linear(torch.randn(3, 256, device=DEV), q6.to(DEV))
    assert not packed.q8_ok(packed.from_fp8(torch.randn(4, 64).to(torch.float8_e4m3fn), torch.ones(1)))
    p = q8_case("Q4_0", 8, 256)
    with pytest.raises(ValueError):
        triton_gemv_q8.q8_linear(torch.randn(17, 256, device=DEV), p.to(DEV))


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_q8_gemv_adds_a_residual_row_as_its_bias(fmt, dtype):
    """A decode step's one row of x (1, 1, K) with the layer's residual (1, 1, N) as the bias
    (dispatch.linear_add): the int8-x product plus the residual, rounded once to x's dtype."""
    N, K = 21, 512
    p = q8_case(fmt, N, K)
    x, res = (torch.randn(1, 1, K) * 2).to(dtype), (torch.randn(1, 1, N) * 4).to(dtype)
    y = triton_gemv_q8.q8_linear(x.to(DEV), p.to(DEV), bias=res.to(DEV))
    assert y.shape == (1, 1, N) and y.dtype == dtype
    check(y, packed.linear_ref_q8(x.double(), p).double() + res.double(), dtype)


def _q8_biases(monkeypatch) -> list:
    """The GPU's route for CPU tensors (dispatch._triton_device: the kernels run in the
    interpreter); returns the list that gets each q8_linear call's bias."""
    from dsq.kernels import dispatch

    if not dispatch.ACT_Q8:
        pytest.skip("DSQ_ACT_Q8=0: no int8-x GEMV")
    seen, real = [], triton_gemv_q8.q8_linear
    monkeypatch.setattr(dispatch, "_triton_device", lambda x: True)
    monkeypatch.setattr(triton_gemv_q8, "q8_linear",
                        lambda x, p, bias=None, **k: seen.append(bias) or real(x, p, bias, **k))
    return seen


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_add_fuses_one_row_into_the_gemv(fmt, dtype, monkeypatch):
    """dispatch.linear_add's fused branch (the GPU's, run here through the interpreter): the
    residual goes into the GEMV as its bias; float32: bit for bit module(x) + residual (one
    float32 add either way); bf16: the int8-x product plus the residual rounded once instead of twice."""
    from dsq.kernels import dispatch
    from dsq.runtime.qmodules import PackedLinear

    seen = _q8_biases(monkeypatch)
    N, K = 21, 512
    mod = PackedLinear(q8_case(fmt, N, K).to(DEV), None, fmt)
    x, res = (torch.randn(1, 1, K) * 2).to(dtype).to(DEV), (torch.randn(1, 1, N) * 4).to(dtype).to(DEV)
    y = dispatch.linear_add(mod, x, res)
    assert len(seen) == 1 and seen[0] is not None and seen[0].data_ptr() == res.data_ptr()
    plain = mod(x) + res
    assert seen[1] is None and y.shape == plain.shape and y.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(y, plain)
    else:
        exact = packed.linear_ref_q8(x.cpu().double(), mod.packed.to("cpu")).double() + res.cpu().double()
        # one rounding of the float32 sum: within a bf16 step of the exact one (half a step on a GPU,
        # which rounds to nearest; the interpreter's float32 -> bf16 truncates)
        assert ((y.cpu().double() - exact).abs() <= exact.abs() * 2 ** -7).all()
        assert ((y.double() - plain.double()).abs() <= plain.double().abs() * 2 ** -6).all()  # plain: two roundings


def test_linear_add_falls_back_to_module_plus_residual(monkeypatch):
    """Wherever the add cannot go in a one-row GEMV, linear_add is exactly module(x) + residual and
    the GEMV gets no residual: 2 rows, DSQ_FUSE_RESIDUAL=0, a module with its own bias, a residual
    of another dtype or layout, a float module; and CPU tensors on the CPU's own route."""
    from torch import nn

    from dsq.kernels import dispatch
    from dsq.runtime.qmodules import PackedLinear

    N, K = 21, 512
    p = q8_case("Q4_K", N, K).to(DEV)
    mod = PackedLinear(p, None, "Q4_K")
    x1, r1 = torch.randn(1, 1, K, device=DEV), torch.randn(1, 1, N, device=DEV)
    assert torch.equal(dispatch.linear_add(mod, x1, r1), mod(x1) + r1)  # the CPU: x not on the GPU
    seen = _q8_biases(monkeypatch)
    x2, r2 = torch.randn(1, 2, K, device=DEV), torch.randn(1, 2, N, device=DEV)
    cases = [(mod, x2, r2),  # two rows
             (PackedLinear(p, nn.Parameter(torch.randn(N, device=DEV), requires_grad=False), "Q4_K"), x1, r1),
             (mod, x1, r1.double()), (mod, x1, torch.randn(1, 1, 2 * N, device=DEV)[..., ::2]),
             (nn.Linear(K, N, bias=False).to(DEV), x1, r1)]
    for m, x, r in cases:
        with torch.no_grad():
            assert torch.equal(dispatch.linear_add(m, x, r), m(x) + r)
    monkeypatch.setattr(dispatch, "FUSE_RESIDUAL", False)
    assert torch.equal(dispatch.linear_add(mod, x1, r1), mod(x1) + r1)
    residuals = {r.data_ptr() for _, _, r in cases}
    assert seen and not any(b is not None and b.data_ptr() in residuals for b in seen)  # the q8 GEMV ran, never given a residual


@pytest.mark.skipif(not CUDA, reason="real shapes and autotuning need a GPU")
@pytest.mark.parametrize("fmt,M", [(f, M) for f in ["gptq-int4-act", "Q4_0", "Q8_0", "Q4_K", "gptq-int8"]
                                   for M in (1, 3, 7, 16)]
                         + [("Q6_K", 1), ("Q5_K", 1), ("Q5_K", 3), ("Q5_0", 1)])
def test_q8_real_shapes_autotuned(fmt, M):
    p = q8_case(fmt, 1024, 4096)
    x = torch.randn(M, 4096, dtype=torch.bfloat16)
    check(triton_gemv_q8.q8_linear(x.cuda(), p.to("cuda")), packed.linear_ref_q8(x.double(), p), torch.bfloat16)


@pytest.mark.skipif(not CUDA, reason="the dispatcher sends only CUDA tensors to Triton")
@pytest.mark.parametrize("M", [2, 4, 5, 9])
def test_dispatch_q6k_rows_then_cublas(M):
    """Q6_K at 2-4 rows: exactly the int8-x product (one GEMV a row); from 5 rows the weight
    written out (float32 here) for cuBLAS: exactly the float product."""
    from dsq.kernels import dispatch

    p = q8_case("Q6_K", 1024, 4096)
    x = torch.randn(M, 4096)
    kind = dispatch.gpu_kernel(p, M, x.dtype)
    y = dispatch.packed_linear(x.cuda(), p.to("cuda")).double().cpu()
    q8, fl = packed.linear_ref_q8(x.double(), p).double(), packed.linear_ref(x.double(), p).double()
    err_q8, err_fl = float((y - q8).norm() / q8.norm()), float((y - fl).norm() / fl.norm())
    if M <= dispatch.Q8_MAX_ROWS:
        assert kind == "q8_rows" and err_q8 < 1e-5 < err_fl, (err_q8, err_fl)
    else:
        assert kind == "dequant" and err_fl < 1e-5 < err_q8, (err_q8, err_fl)


@pytest.mark.skipif(not CUDA, reason="the dispatcher sends only CUDA tensors to Triton")
@pytest.mark.parametrize("M", [1, 3, 4, 5])
def test_dispatch_takes_int8_x_up_to_its_row_limit(M):
    """Up to dispatch.Q8_MAX_ROWS rows: exactly the int8-x product (which differs from the float
    one by int8 rounding); above: the float-x kernels."""
    from dsq.kernels import dispatch

    p = q8_case("Q4_K", 512, 4096)
    x = torch.randn(M, 4096)
    y = dispatch.packed_linear(x.cuda(), p.to("cuda")).double().cpu()
    q8, fl = packed.linear_ref_q8(x.double(), p).double(), packed.linear_ref(x.double(), p).double()
    err_q8, err_fl = float((y - q8).norm() / q8.norm()), float((y - fl).norm() / fl.norm())
    if dispatch.ACT_Q8 and M <= dispatch.Q8_MAX_ROWS:
        assert err_q8 < 1e-5 < err_fl, (err_q8, err_fl)
    else:
        assert err_fl < 1e-5 < err_q8, (err_q8, err_fl)


def test_autotune_choices_name_each_key(monkeypatch):
    """The autotuner's picks as benchmark records write them: kernel -> "N=.., K=.., ..." -> config."""
    tuned = triton_gemv_q8._gemv_q8_tuned
    monkeypatch.setattr(tuned, "cache", {(28672, 8192, 1, 0, 0, 128, False, 2, False, "torch.int32"):
                                         triton_gemv_q8.triton.Config({"BN": 1, "BK": 2048, "PERSIST": 32},
                                                                      num_warps=1)})
    picks = triton_common.autotune_choices()["gemv_q8"]
    (key, cfg), = picks.items()
    assert key.startswith("N=28672, K=8192, MR=1, CODES=0, HI_BITS=0, SUB=128") and "PERSIST: 32" in cfg


def test_autotuned_configs_name_only_their_kernels_parameters():
    """Every autotuned kernel's candidate configs pass only arguments its kernel takes: a config
    key the kernel lacks fails at the first autotuned launch on a GPU (a KeyError inside Triton),
    which the interpreter's fixed-config path never reaches."""
    import inspect

    from dsq.kernels import triton_gemm, triton_gemv, triton_gemv_q8, triton_mma

    tuned = [triton_gemm._gemm_tuned, triton_gemv._gemv_tuned, triton_gemv._gemv_experts_tuned,
             triton_gemv_q8._gemv_q8_tuned, triton_gemv_q8._gemm_q8_tuned, triton_gemv_q8._gemv_q8_experts_tuned,
             triton_mma._mma_t_tuned, triton_mma._mma_s_tuned]
    for t in tuned:
        fn = t
        while hasattr(fn, "fn"):  # through the heuristics and the JIT (or interpreter) wrapper
            fn = fn.fn
        params = set(inspect.signature(fn).parameters)
        assert t.configs
        for c in t.configs:
            assert set(c.kwargs) <= params, (fn.__name__, sorted(set(c.kwargs) - params))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_gguf_conversion_in_one_launch(qtype):
    """kernels/triton_gguf.py: GGUF blocks into the packed layout by one launch a chunk of rows, bit for
    bit packed._from_gguf's (every plane compared as bytes: random f16 factors may be NaN), the
    rows written in two chunks at an offset; a row of the wrong width is refused."""
    from dsq.kernels import triton_gguf

    N, K = 37, 768
    raw = torch.from_numpy(random_blocks(qtype, N, K, np.random.default_rng()))
    ref = packed._from_gguf(raw, qtype, K)
    out = triton_gguf.empty(qtype, N, K, DEV)
    for t in out.tensors().values():  # poisoned: a byte left unwritten shows
        t.view(torch.uint8).fill_(0xA5)
    triton_gguf.convert_into(raw[:20].contiguous().to(DEV), qtype, out, 0)
    triton_gguf.convert_into(raw[20:].contiguous().to(DEV), qtype, out, 20)
    assert out.fmt == ref.fmt and (out.N, out.K) == (ref.N, ref.K)
    assert set(out.tensors()) == set(ref.tensors())
    for k, v in ref.tensors().items():
        got = out.tensors()[k].cpu()
        assert got.dtype == v.dtype and got.shape == v.shape, k
        assert torch.equal(got.view(torch.uint8), v.contiguous().view(torch.uint8)), k
    with pytest.raises(ValueError, match="contiguous rows"):
        triton_gguf.convert_into(raw[:, :-1].contiguous().to(DEV), qtype, out, 0)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
def test_from_gguf_by_triton_chunks(qtype, monkeypatch):
    """packed.from_gguf with the Triton conversion on (DSQ_TRITON_GGUF; here on DEV, as on a GPU): the
    rows go over in chunks of TRITON_GGUF_CHUNK_BYTES, and the result is the torch path's byte for
    byte; a type the kernels do not take (Q8_0) stays on the torch path."""
    from dsq.kernels import dispatch, triton_gguf

    N, K = 29, 512
    raw = torch.from_numpy(random_blocks(qtype, N, K, np.random.default_rng()))
    ref = packed.from_gguf(raw, qtype, K)
    launches = []
    convert = triton_gguf.convert_into
    monkeypatch.setattr(triton_gguf, "convert_into", lambda r, *a: launches.append(r.shape[0]) or convert(r, *a))
    monkeypatch.setattr(packed, "_triton_gguf", lambda dev: True)
    monkeypatch.setattr(packed, "TRITON_GGUF_CHUNK_BYTES", raw.shape[1] * 8)
    monkeypatch.setattr(dispatch, "FAILED", {})
    got = packed.from_gguf(raw, qtype, K, device=DEV)
    assert not dispatch.FAILED  # the Triton path ran to its end, no fallback to the torch ops
    assert launches == ([8, 8, 8, 5] if qtype in triton_gguf.TYPES else [])
    assert got.fmt == ref.fmt and set(got.tensors()) == set(ref.tensors())
    for k, v in ref.tensors().items():
        assert torch.equal(got.tensors()[k].cpu().view(torch.uint8), v.view(torch.uint8)), k


def test_from_gguf_falls_back_when_the_triton_conversion_fails(monkeypatch):
    """A Triton conversion that fails on some GPU turns its family off with a warning (dispatch._guarded,
    as the other kernel families), and the blocks are converted by the torch ops, byte for byte what
    they give; later calls go straight to the torch ops."""
    from dsq.kernels import dispatch, triton_gguf

    N, K = 5, 256
    raw = torch.from_numpy(random_blocks("Q4_K", N, K, np.random.default_rng()))
    ref = packed.from_gguf(raw, "Q4_K", K)
    tries = []

    def broken(*a):
        tries.append(1)
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(dispatch, "FAILED", {})
    monkeypatch.setattr(triton_gguf, "convert_into", broken)
    monkeypatch.setattr(packed, "_triton_gguf", lambda dev: True)
    with pytest.warns(RuntimeWarning, match="GGUF conversion GPU kernels failed"):
        got = packed.from_gguf(raw, "Q4_K", K, device=DEV)
    assert "GGUF conversion" in dispatch.FAILED
    for k, v in ref.tensors().items():
        assert torch.equal(got.tensors()[k].cpu().view(torch.uint8), v.view(torch.uint8)), k
    packed.from_gguf(raw, "Q4_K", K, device=DEV)
    assert len(tries) == 1
