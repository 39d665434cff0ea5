"""The torch GGUF dequantization reference against gguf-py's numpy implementation (bit exact),
on fresh random blocks of every format and on the built-in model's real tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

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


# (build, format) whose M = 1 row dots round x to 16-bit integers per 32 values (the avx2 build's
# integer dots, kernels/csrc/gguf_avx2_cpu.inc; DSQ_NO_VNNI=1 turns them off): each x_k is then off
# by at most max|x| / 65534 over its block, so an output by at most x16_bound beyond float rounding
X16_ROW_DOTS = {("avx2", "Q4_K"), ("avx2", "Q6_K")}


def x16_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_k |w_nk| max|x_mb| / 65534 (b: k's block of 32 values), float64 (M, N)."""
    m = x.double().abs().reshape(*x.shape[:-1], -1, 32).amax(-1).repeat_interleave(32, -1)
    return (m / 65534) @ w.double().abs().T


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
