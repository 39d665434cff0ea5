"""The torch GGUF dequantization reference against gguf-py's numpy implementation (bit exact),
on fresh random blocks of every format and on the built-in model's real tensors."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from dsq.kernels import gguf_ref
from dsq.kernels.gguf_ref import BLOCKS, dequantize, gguf_embedding_ref, gguf_linear_ref

FORMATS = ["Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
_F16_FIELDS = {"Q4_0": [0], "Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(qtype: str, rows: int, row_len: int, rng) -> np.ndarray:
    """Random bytes for every field, with finite fp16 scales."""
    per, nbytes = BLOCKS[qtype]
    b = rng.integers(0, 256, (rows, row_len // per, nbytes), dtype=np.uint8)
    for off in _F16_FIELDS[qtype]:
        b[..., off:off + 2] = rng.standard_normal(b.shape[:2]).astype(np.float16).view(np.uint8).reshape(
            *b.shape[:2], 2)
    return b.reshape(rows, -1)


# The avx2 build's integer dots round x to int8 per 32 values (kernels/csrc/gguf_avx2_cpu.inc:
# every format at M = 1; gguf_i8gemm_cpu.inc, with DSQ_INT8_PREFILL=1 or inside a generation's
# prefill (cpu.set_int8_rows, tested in test_kernels_cpu_gemm.py): all but Q8_0 above, as the
# avx512 build does from M = 4 on a CPU with AVX512-VNNI; DSQ_NO_VNNI=1 turns them off). They are
# held to gguf_ref.gguf_linear_ref_q8, which rounds x exactly as they do, within float32
# accumulation error (INT8_X_TOL of the summed |terms|: ~20x what they show at these K, below the
# ~1e-5 a single value of x rounded one step off costs at K <= 2048).
INT8_X_TOL = 1e-6


def int8_x(isa: str, qtype: str, rows: int) -> bool:
    """Whether the `isa` build computes with x rounded to int8 (gguf_linear_ref_q8) for `rows` rows."""
    from dsq.kernels.cpu import _cpu_flags

    def on(name):
        return os.environ.get(name, "") not in ("", "0")
    if on("DSQ_NO_VNNI"):
        return False
    tiles = qtype != "Q8_0" and on("DSQ_INT8_PREFILL")
    if isa == "avx2":
        return rows == 1 or tiles
    return isa == "avx512" and tiles and rows > 3 and "avx512_vnni" in _cpu_flags()


def reference(x: torch.Tensor, raw: torch.Tensor, qtype: str, K: int, int8: bool):
    """(float64 reference, sum of |terms|) of x (M, K) times the GGUF weights: with x rounded to
    int8 as the integer dots round it when `int8`, else x as it is."""
    w = gguf_ref.dequantize(raw, qtype, K).double()
    if int8:
        xq, sx = gguf_ref.round_x_q8(x)
        xd = (xq.double() * sx.double()).reshape(x.shape)
    else:
        xd = x.double()
    return torch.nn.functional.linear(xd, w), torch.nn.functional.linear(xd.abs(), w.abs())


def max_rel_err(y: torch.Tensor, ref: torch.Tensor, terms: torch.Tensor) -> float:
    """The largest |y - ref| relative to the summed |terms| of its output (not to the output,
    which can cancel to ~0)."""
    return float(((y.double() - ref).abs() / terms.clamp(min=1e-35)).max())


def oracle(b: np.ndarray, qtype: str, row_len: int) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as np_dequantize

    return np_dequantize(b, GGMLQuantizationType[qtype]).reshape(b.shape[0], row_len)


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("rows,row_len", [(1, 256), (7, 512), (33, 768)])
def test_dequantize_matches_gguf_py(qtype, rows, row_len):
    rng = np.random.default_rng()  # fresh inputs every run
    b = random_blocks(qtype, rows, row_len, rng)
    ours = dequantize(torch.from_numpy(b.copy()), qtype, row_len).numpy()
    np.testing.assert_array_equal(ours, oracle(b, qtype, row_len))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("qtype", FORMATS)
def test_linear_and_embedding_against_dense(qtype):
    rng = np.random.default_rng()
    rows, row_len = 40, 512
    b = torch.from_numpy(random_blocks(qtype, rows, row_len, rng))
    w = torch.from_numpy(oracle(b.numpy(), qtype, row_len))
    x = torch.randn(3, 5, row_len)
    bias = torch.randn(rows)
    want = torch.nn.functional.linear(x.double(), w.double(), bias.double())
    assert rel_err(gguf_linear_ref(x, b, qtype, row_len, bias), want) < 1e-6
    # slab-wise dequantization of large weights gives the same answer
    assert rel_err(gguf_linear_ref(x, b, qtype, row_len, bias, chunk_elements=row_len * 3), want) < 1e-6
    ids = torch.tensor([[0, 5, 39], [2, 2, 1]])
    torch.testing.assert_close(gguf_embedding_ref(ids, b, qtype, row_len), w[ids])


def test_real_tensors_of_the_builtin_model(builtin_gguf):
    from dsq.formats.gguf_file import GGUFFile

    g = GGUFFile(builtin_gguf)
    seen = set()
    for t in g.tensors:
        if t.type_name in seen or t.type_name not in FORMATS:
            continue
        seen.add(t.type_name)
        raw, _, shape = g.raw(t.name)
        rows = np.asarray(raw).reshape(shape[0], -1)[:512]
        ours = dequantize(torch.from_numpy(rows.copy()), t.type_name, shape[1]).numpy()
        np.testing.assert_array_equal(ours, oracle(rows, t.type_name, shape[1]))
    assert seen == {"Q8_0", "Q5_0", "Q4_K", "Q6_K"}
