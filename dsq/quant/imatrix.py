"""Importance matrix for llama.cpp's K-quants, computed by dsq's runtime: for every Linear, the
mean squared input activation per column over the calibration text (what llama-imatrix
collects). Layer by layer, like the other calibrated methods.

Stacked GGUF tensors get one row of means per matrix, as llama-imatrix stores them: routed experts
(`*_exps`, each expert over the tokens routed to it; an expert no token chose gets ones, as
llama-imatrix writes for missing data) and DeepSeek's per-head `attn_k_b` / `attn_v_b`, whose
inputs only the absorbed attention computes: calibration runs it that way (the same outputs)
and taps them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dsq.quant import faults
from dsq.quant.blocks import (Capture, block_tensors, default_dtype, device_for, embed_calibration, linears,
                              materialize, meta_model, run_block)
from dsq.quant.calib import calibration_for
from dsq.quant.spec import CalibSpec, OnStep, Step, no_progress

TASK = "importance matrix: blocks"


class SquareSum:
    """Sum of squares per input column of the rows fed to `add`, and how many rows there were."""

    def __init__(self, k: int):
        self.acc = torch.zeros(k, dtype=torch.float64)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        self.acc += x.double().pow(2).sum(0).to(self.acc.device)
        self.n += x.shape[0]

    def mean(self) -> np.ndarray:
        return (self.acc / max(self.n, 1)).numpy().astype(np.float32)


class Taps:
    """Squared sums of what attention modules with a `tap` hand it (DeepSeek's absorbed MLA: the
    inputs of attn_k_b and attn_v_b, (..., heads, width) -> one row of heads * width), with those
    modules held on their absorbed path. A context manager: taps off on exit."""

    def __init__(self, layer: torch.nn.Module):
        self.data: dict[str, SquareSum] = {}
        self.mods = [m for m in layer.modules() if hasattr(m, "tap")]

    def add(self, name: str, x: torch.Tensor) -> None:
        rows = x.reshape(-1, x.shape[-2] * x.shape[-1])
        self.data.setdefault(name, SquareSum(rows.shape[1])).add(rows)

    def __enter__(self) -> "Taps":
        for m in self.mods:
            m.tap, m.absorb = self.add, True
        return self

    def __exit__(self, *exc) -> None:
        for m in self.mods:
            m.tap, m.absorb = None, None


def _by_gguf_name(arch, i: int, data: dict[str, SquareSum]) -> dict[str, np.ndarray]:
    """Block i's Linears' means by the GGUF tensor they go into; a stacked tensor's experts as
    one row each (ones for an expert no token chose)."""
    out, experts = {}, {}
    for name, acc in data.items():
        target = arch.gguf_target(f"model.layers.{i}.{name}.weight")
        if target is None:  # written in parts, which see other inputs (Taps)
            continue
        g, x = target
        if x is None:
            out[g] = acc.mean()
        else:
            experts.setdefault(g, {})[x] = acc.mean() if acc.n else np.ones(acc.acc.shape[0], dtype=np.float32)
    for g, rows in experts.items():
        out[g] = np.concatenate([rows[x] for x in sorted(rows)])
    return out


def compute_imatrix(src: str | Path, calib: CalibSpec, device: str = "auto", progress: OnStep = no_progress,
                    batch: int = 8, compute_dtype: torch.dtype | None = None) -> dict[str, np.ndarray]:
    """GGUF tensor name -> mean x^2 per input column, for every Linear of every block."""
    from dsq.formats.hf import HFModelDir
    from dsq.models.registry import arch_for_model_type, build_args

    progress(Step(TASK))
    hf = HFModelDir(src)
    arch = arch_for_model_type(hf.model_type)
    mod, args = build_args(hf.config, f"{hf.path}/config.json")
    dev = device_for(device)
    dtype = compute_dtype or default_dtype(dev)
    ids = calibration_for(hf, calib)
    model = meta_model(mod, args)
    hidden = embed_calibration(hf, args, ids)
    out: dict[str, np.ndarray] = {}
    n = args.num_hidden_layers
    for i in range(n):
        layer = model.model.layers[i]
        materialize(layer, block_tensors(hf, i), dev, dtype)
        ctx = model.block_context(i, ids.shape[1], dev)
        with Capture(linears(layer), lambda m: SquareSum(m.in_features)) as cap, Taps(layer) as taps:
            hidden = run_block(layer, hidden, ctx, dev, dtype, batch)
        out.update(_by_gguf_name(arch, i, cap.data))
        out.update({f"blk.{i}.{name}.weight": acc.mean() for name, acc in taps.data.items()})
        layer.to("meta")
        faults.point("gguf:imatrix")
        progress(Step(TASK, i + 1, n))
    return out
