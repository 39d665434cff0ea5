"""The layer-by-layer quantization driver: one decoder block in memory at a time.

For each block: read its weights from the memory-mapped source, let the method quantize it (a
calibrated method runs the calibration activations through it for what it needs: Hessians for
GPTQ, inputs for AWQ), write the block's tensors, and pass the *quantized* block's outputs on to
the next block. Progress is recorded after every block, so an interrupted run resumes where it
stopped; the artifact is then assembled, evaluated and published as dsq.quant.staging and
dsq.quant.finalize say. Peak memory: one block + the calibration activations + the embeddings.
The method (dsq.quant.registry) decides everything method-specific.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

import torch
from torch import nn

from dsq.errors import DsqError
from dsq.quant import faults
from dsq.quant.blocks import (Block, block_tensors, default_dtype, device_for, embed_calibration, home, linears,
                              materialize, meta_model, phase, run_block)
from dsq.quant.calib import calibration_for
from dsq.quant.finalize import assemble, evaluate_stage
from dsq.quant.method import calib_stamp, check_target, run_key
from dsq.quant.space import check_free, full_disk_error, is_disk_full
from dsq.quant.spec import EVAL_TOKENS, OnStep, QuantSpec, Step, no_progress
from dsq.quant.staging import Run


def expected_bytes(hf, spec: QuantSpec) -> int:
    """About the bytes a run writes into OUT.partial: every block and the rest tensors as the
    checkpoint stores them (the stage hard-links the same files), and two sets of float32
    calibration activations."""
    total = 0
    for name, t in hf.mmap_tensors().items():
        if name.startswith("model.layers.") and t.ndim == 2 and not _skipped(name.rsplit(".", 1)[0], spec):
            total += spec.impl.packed_bytes(t.shape[0], t.shape[1], spec)
        elif not name.endswith("inv_freq"):
            total += t.numel() * t.element_size()
    if spec.needs_calibration:
        total += 2 * spec.calib.samples * spec.calib.seq_len * hf.config["hidden_size"] * 4
    return total


def check_model(hf, spec: QuantSpec) -> None:
    """Every quantized layer must fit the format: refuse before any work."""
    from dsq.models.registry import build_args

    mod, args = build_args(hf.config, f"{hf.path}/config.json")
    model = meta_model(mod, args)
    for name, m in linears(model.model.layers[0]).items():
        full = f"model.layers.0.{name}"
        if not _skipped(full, spec):
            spec.impl.check_shape(full, m.out_features, m.in_features, spec)


def _skipped(full_name: str, spec: QuantSpec) -> bool:
    return any(fnmatch.fnmatch(full_name, p) for p in spec.skip)


# ---------------------------------------------------------------------------------------------
def quantize_block(layer: nn.Module, i: int, spec: QuantSpec, hidden, ctx, device, dtype, batch: int) -> dict:
    """Quantize block `i`, materialized, in place (weights become their dequantized values).
    Returns the tensors to write, by name inside the block."""
    lins = {n: m for n, m in linears(layer).items() if not _skipped(f"model.layers.{i}.{n}", spec)}
    return spec.impl.quantize_block(Block(layer, lins, hidden, ctx, torch.device(device), dtype, batch), spec)


def quantize_layers(src: str | Path, out: str | Path, spec: QuantSpec, *, device: str = "auto", force: bool = False,
                    progress: OnStep = no_progress, batch: int = 8, compute_dtype: torch.dtype | None = None,
                    eval_tokens: int = EVAL_TOKENS) -> dict:
    """Quantize the HF model at `src` into an HF directory at `out`, evaluated for its model card
    on `eval_tokens` held-out tokens (0: none). Returns the artifact's dsq_quant.json."""
    spec.validate()
    if 0 < eval_tokens < 16:
        raise DsqError(f"--eval-tokens {eval_tokens} is too few", "pass 0 (no evaluation) or at least 16")
    out = Path(out)
    hf, mod, args = _open_source(src, spec)
    run = Run(out, run_key(hf.path, spec.record(), calib_stamp(spec.calib)), args.num_hidden_layers,
              spec.needs_calibration)
    if run.published():  # the last run was stopped between its rename and its cleanup
        return run.close()
    check_target(out, force)
    check_free(out, expected_bytes(hf, spec) - run.bytes())
    try:
        run.begin()
        if run.phase == "blocks":
            _quantize_blocks(run, hf, mod, args, spec, device, batch, compute_dtype, progress)
            assemble(run, hf, spec)
        if run.phase == "staged" or run.state["eval_tokens"] != eval_tokens:
            evaluate_stage(run, hf, spec, eval_tokens, progress)
        return run.publish(force)
    except BaseException as e:
        kept = run.tidy()
        if is_disk_full(e):
            need = expected_bytes(hf, spec) * (2 if run.copies else 1) - run.bytes()
            raise full_disk_error(out, need, kept) from e
        raise


def _open_source(src: str | Path, spec: QuantSpec):
    """(the HF model, its model module, its ModelArgs), refused before any work if a layer does
    not fit the format."""
    from dsq.formats.hf import HFModelDir
    from dsq.models.registry import build_args

    hf = HFModelDir(src)
    mod, args = build_args(hf.config, f"{hf.path}/config.json")
    check_model(hf, spec)
    return hf, mod, args


def _quantize_blocks(run: Run, hf, mod, args, spec: QuantSpec, device: str, batch: int,
                     compute_dtype: torch.dtype | None, progress: OnStep) -> None:
    """Quantize the blocks the run has not finished, recording each one as it is written."""
    method = spec.impl
    task = f"{spec.method} {method.label(spec)}: blocks"
    progress(Step(task))
    n = run.n
    if run.done == n:
        return
    dev = device_for(device)
    dtype = compute_dtype or default_dtype(dev)
    calib_ids = calibration_for(hf, spec.calib) if method.needs_calibration else None
    hidden, tokens = None, 0
    if calib_ids is not None:
        tokens = int(calib_ids.numel())
        hidden = home(embed_calibration(hf, args, calib_ids) if run.done == 0 else run.load_hidden(), dev, dtype)
    faults.point("calib")
    model = meta_model(mod, args)
    for i in range(run.done, n):
        ctx = model.block_context(i, calib_ids.shape[1], dev) if calib_ids is not None else None
        hidden = _quantize_one(model.model.layers[i], i, hf, spec, hidden, ctx, dev, dtype, batch, run.block_file(i))
        faults.point(f"block:{i}")
        run.save_block(i, hidden if i + 1 < n else None, tokens)
        progress(Step(task, i + 1, n))


def _quantize_one(layer: nn.Module, i: int, hf, spec: QuantSpec, hidden, ctx, dev, dtype, batch: int,
                  dest: Path) -> torch.Tensor | None:
    """Quantize block i and write it to `dest`; the activations entering the next block."""
    from safetensors.torch import save_file

    tensors = block_tensors(hf, i)
    materialize(layer, tensors, dev, dtype)
    qt = quantize_block(layer, i, spec, hidden, ctx, dev, dtype, batch)
    if hidden is not None:
        with phase("block outputs"):
            hidden = run_block(layer, hidden, ctx, dev, dtype, batch)
    block = {}
    state = layer.state_dict()
    for name, t in tensors.items():  # norms, biases, skipped layers: as the method left them
        base = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and (f"{base}.qweight" in qt or name in qt):
            continue
        block[f"model.layers.{i}.{name}"] = state[name].to("cpu", t.dtype) if name in state else t
    block.update({f"model.layers.{i}.{k}": v.contiguous() for k, v in qt.items()})
    tmp = dest.with_suffix(".tmp")
    save_file(block, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, dest)
    layer.to("meta")
    return hidden
