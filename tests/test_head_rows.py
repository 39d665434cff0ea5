"""--head 0.6: a split model's output head split by rows, a share in VRAM and the rest in RAM
(qmodules.RowSplitLinear). On the CPU the GPU's side stands in as the packed layout its kernels
read (the packed torch reference, as in test_gpu_layout_on_cpu.py): the joined logits equal the
whole head's. The captured split step that runs the GPU rows in its graph is checked on a GPU
(test_native_cuda.py::test_split_head_in_ram)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from dsq.errors import DsqError
from test_kernels_ref import random_blocks


@pytest.mark.parametrize("value, parsed, share", [
    ("gpu", "gpu", 1.0), ("CPU", "cpu", 0.0), (None, "gpu", 1.0), ("0.6", "0.6", 0.6), ("60%", "0.6", 0.6),
    (" .25 ", "0.25", 0.25)])
def test_head_takes_a_place_or_a_share_of_rows(value, parsed, share):
    from dsq.runtime.gpu_layers import head_share, parse_head

    assert parse_head(value) == parsed and head_share(parse_head(value)) == share


@pytest.mark.parametrize("value", ["0", "1", "1.5", "-0.2", "100%", "vram", "nan"])
def test_head_refuses_what_is_not_a_share(value):
    from dsq.runtime.gpu_layers import parse_head

    with pytest.raises(DsqError, match="share of its rows"):
        parse_head(value)


def _gguf_head(qtype: str, n: int, k: int, seed: int = 0):
    from dsq.runtime.qmodules import GGUFLinear

    m = GGUFLinear(qtype, k, n)
    m.raw.copy_(torch.from_numpy(random_blocks(qtype, n, k, np.random.default_rng(seed))))
    return m


@pytest.mark.parametrize("qtype", ["Q6_K", "Q8_0"])
@pytest.mark.parametrize("share, gpu_rows", [(0.6, 640), (0.01, 1), (0.999, 999)])
def test_gguf_head_split_by_rows_equals_the_whole(qtype, share, gpu_rows, monkeypatch):
    """Rows rounded to 128 (at least one on each side); the GPU's share packed for its kernels,
    the rest kept as GGUF blocks for the C kernels; joined, the whole head's logits."""
    from dsq.kernels import dispatch
    from dsq.models.base import module_device
    from dsq.runtime.qmodules import GGUFLinear, PackedLinear, RowSplitLinear

    monkeypatch.setenv("DSQ_NO_VNNI", "1")  # x kept in float by the C row dots, as the packed reference does
    head = _gguf_head(qtype, 1000, 256)
    x = torch.randn(2, 3, 256)
    with torch.inference_mode():
        want = head(x)
    monkeypatch.setattr(dispatch, "use_triton", lambda device: True)  # the packed layout on the CPU
    rows = RowSplitLinear.split(head, share, torch.device("cpu"), torch.float32)
    assert isinstance(rows.gpu_rows, PackedLinear) and isinstance(rows.cpu_rows, GGUFLinear)
    assert (rows.gpu_rows.out_features, rows.cpu_rows.out_features) == (gpu_rows, 1000 - gpu_rows)
    assert rows.out_features == 1000 and module_device(rows).type == "cpu"
    assert rows.cpu_rows.raw.untyped_storage().data_ptr() != head.raw.untyped_storage().data_ptr()  # its own copy
    with torch.inference_mode():
        got = rows(x)
        top = rows.gpu_rows(x)
        joined = rows.join(x, top)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert torch.equal(joined, got)  # the split step's path: the GPU rows' logits handed in


def test_float_head_split_by_rows_equals_the_whole():
    """A 16-bit checkpoint's head (nn.Linear): the GPU rows in the model's dtype, the rest as it is."""
    from dsq.runtime.qmodules import RowSplitLinear

    torch.manual_seed(0)
    head = nn.Linear(64, 300, bias=False)
    x = torch.randn(1, 1, 64)
    rows = RowSplitLinear.split(head, 0.5, torch.device("cpu"), torch.float32)
    assert (rows.gpu_rows.out_features, rows.cpu_rows.out_features) == (128, 172)
    with torch.no_grad():
        got, want = rows(x), head(x)
    assert got.shape == want.shape and (got - want).abs().max() < 1e-5  # (BLAS sums rows of another count)
    assert rows.gpu_rows.weight.data_ptr() != head.weight.data_ptr()


def test_a_head_of_another_format_is_refused():
    from dsq.runtime.qmodules import RowSplitLinear

    class Other(nn.Module):
        out_features = 300

    with pytest.raises(DsqError, match="GGUF or 16-bit head") as e:
        RowSplitLinear.split(Other(), 0.5, torch.device("cpu"), torch.float32)
    assert "--head gpu or --head cpu" in e.value.hint


@pytest.mark.parametrize("qtype", ["Q6_K", "Q8_0", "Q4_K", "Q5_K", "Q4_0", "Q5_0"])
def test_the_planners_bytes_for_a_share_are_the_packed_rows(qtype, monkeypatch):
    """The planner counts a head share's VRAM as that share of the file's bytes (head_gpu_bytes);
    the GPU rows as packed for its kernels hold that within 3% (the K-quants' scales unpacked to a
    byte each: +2.8% for Q4_K), never a dequantized copy."""
    from dsq.kernels import dispatch
    from dsq.runtime.placement import head_gpu_bytes
    from dsq.runtime.qmodules import RowSplitLinear

    head = _gguf_head(qtype, 1024, 512)
    monkeypatch.setattr(dispatch, "use_triton", lambda device: True)  # the packed layout on the CPU
    gpu = RowSplitLinear.split(head, 0.5, torch.device("cpu"), torch.float32).gpu_rows
    assert gpu.out_features == 512
    packed = sum(t.numel() * t.element_size() for t in [*gpu.parameters(), *gpu.buffers()])
    planned = head_gpu_bytes(head.raw.numel() * head.raw.element_size(), 0.5)
    assert planned <= packed <= 1.03 * planned
