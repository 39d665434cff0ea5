"""Importance matrix for llama.cpp's K-quants, computed by dsq's runtime: for every Linear, the
mean squared input activation per column over the calibration text (what llama-imatrix
collects). Layer by layer, like the other calibrated methods."""

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
        with Capture(linears(layer), lambda m: SquareSum(m.in_features)) as cap:
            hidden = run_block(layer, hidden, ctx, dev, dtype, batch)
        out.update({arch.hf_to_gguf_name(f"model.layers.{i}.{name}.weight"): acc.mean() for name, acc in cap.data.items()})
        layer.to("meta")
        faults.point("gguf:imatrix")
        progress(Step(TASK, i + 1, n))
    return out
