"""Importance matrix for llama.cpp's K-quants, computed by dsq's runtime: for every Linear, the
mean squared input activation per column over the calibration text (what llama-imatrix
collects). Layer by layer, like the other calibrated methods."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch

from dsq.quant.driver import QuantSpec, _block_tensors, _Capture, _linears, _materialize, _run_block, calibration_for


def compute_imatrix(src: str | Path, spec: QuantSpec, device: str = "auto",
                    on_block: Callable[[int, int, float], None] | None = None, batch: int = 8) -> dict[str, np.ndarray]:
    """GGUF tensor name -> mean x^2 per input column, for every Linear of every block."""
    import time

    from dsq.formats.arch import arch_for_model_type
    from dsq.formats.hf import HFModelDir
    from dsq.models.registry import build_args

    hf = HFModelDir(src)
    arch = arch_for_model_type(hf.model_type)
    mod, args = build_args(hf.config, f"{hf.path}/config.json")
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    ids = calibration_for(hf, spec)
    with torch.device("meta"):
        model = mod.Model(args)
    emb = hf.get_tensor("model.embed_tokens.weight").float()
    hidden = emb[ids]
    if args.embed_scale:
        hidden = hidden * float(torch.tensor(args.embed_scale, dtype=emb.dtype))
    del emb
    out: dict[str, np.ndarray] = {}
    for i in range(args.num_hidden_layers):
        t0 = time.perf_counter()
        layer = model.model.layers[i]
        _materialize(layer, _block_tensors(hf, i), dev, dtype)
        ctx = model.block_context(i, ids.shape[1], dev)
        cap = _Capture(_linears(layer), "sumsq")
        hidden = _run_block(layer, hidden, ctx, dev, dtype, batch)
        cap.close()
        for name, (acc, n) in cap.data.items():
            g = arch.hf_to_gguf_name(f"model.layers.{i}.{name}.weight")
            out[g] = (acc / max(n, 1)).numpy().astype(np.float32)
        layer.to("meta")
        if on_block:
            on_block(i + 1, args.num_hidden_layers, time.perf_counter() - t0)
    return out
