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
from dsq.quant.moe import block_metadata, dense_layers, skipped
from dsq.quant.space import check_free, full_disk_error, is_disk_full
from dsq.quant.spec import EVAL_TOKENS, OnStep, QuantSpec, Step, interrupted, no_progress
from dsq.quant.staging import Run


def expected_bytes(hf, spec: QuantSpec) -> int:
    """About the bytes a run writes into OUT.partial: every block and the rest tensors as the
    checkpoint stores them (the stage hard-links the same files), and two sets of float32
    calibration activations."""
    from dsq.convert.fp8_source import float_dtype, is_fp8, is_scale

    total, float_bytes = 0, float_dtype(hf.config).itemsize
    for name, t in hf.mmap_tensors().items():
        if name.endswith("inv_freq") or is_scale(name):
            continue
        if name.startswith("model.layers.") and t.ndim == 2 and not skipped(name.rsplit(".", 1)[0], spec):
            total += spec.impl.packed_bytes(t.shape[0], t.shape[1], spec)
        else:
            total += t.numel() * (float_bytes if is_fp8(t) else t.element_size())
    if spec.needs_calibration:
        total += 2 * spec.calib.samples * spec.calib.seq_len * hf.config["hidden_size"] * 4
    return total


def check_model(hf, spec: QuantSpec) -> None:
    """Every quantized layer must fit the format: refuse before any work. The first and the last
    layer are each kind a model has (DeepSeek: dense, then MoE)."""
    from dsq.models.registry import build_args

    mod, args = build_args(hf.config, f"{hf.path}/config.json")
    model = meta_model(mod, args)
    dense = dense_layers(args, spec)
    for i in sorted({0, args.num_hidden_layers - 1} - dense):
        for name, m in linears(model.model.layers[i]).items():
            full = f"model.layers.{i}.{name}"
            if not skipped(full, spec):
                spec.impl.check_shape(full, m.out_features, m.in_features, spec)


# ---------------------------------------------------------------------------------------------
def make_block(layer: nn.Module, i: int, spec: QuantSpec, hidden, ctx, device, dtype, batch: int,
               dense: set[int] = frozenset()) -> Block:
    """Block `i`, materialized, with the Linears to quantize: none in a dense layer kept 16-bit."""
    keep = i in dense
    lins = {n: m for n, m in linears(layer).items() if not keep and not skipped(f"model.layers.{i}.{n}", spec)}
    return Block(layer, lins, hidden, ctx, torch.device(device), dtype, batch)


def quantize_block(layer: nn.Module, i: int, spec: QuantSpec, hidden, ctx, device, dtype, batch: int,
                   dense: set[int] = frozenset()) -> dict:
    """Quantize block `i`, materialized, in place (weights become their dequantized values).
    Returns the tensors to write, by name inside the block."""
    return _quantized(make_block(layer, i, spec, hidden, ctx, device, dtype, batch, dense), spec)


def _quantized(block: Block, spec: QuantSpec) -> dict:
    return spec.impl.quantize_block(block, spec) if block.linears else {}


def quantize_layers(src: str | Path, out: str | Path, spec: QuantSpec, *, device: str = "auto", force: bool = False,
                    progress: OnStep = no_progress, batch: int = 8, compute_dtype: torch.dtype | None = None,
                    eval_tokens: int = EVAL_TOKENS) -> dict:
    """Quantize the HF model at `src` into an HF directory at `out`, evaluated for its model card
    on `eval_tokens` held-out tokens (0: none). Returns the artifact's dsq_quant.json."""
    spec.validate()
    if eval_tokens < 0 or 0 < eval_tokens < 16:
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
        _say_resumed(run, progress)
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
        raise interrupted(e, kept) from e


def _say_resumed(run: Run, progress: OnStep) -> None:
    """Say what an earlier run of the same command left that this one goes on from."""
    if run.phase == "blocks" and run.done:
        progress(Step("", note=f"resuming from block {run.done + 1} of {run.n}: an earlier run finished "
                                f"{run.done} (kept in {run.dir.name})"))
    elif run.phase != "blocks":
        progress(Step("", note=f"resuming: an earlier run finished every block (kept in {run.dir.name})"))


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
    dense = dense_layers(args, spec)
    for i in range(run.done, n):
        ctx = model.block_context(i, calib_ids.shape[1], dev) if calib_ids is not None else None
        block = make_block(model.model.layers[i], i, spec, hidden, ctx, dev, dtype, batch, dense)
        hidden = _quantize_one(block, i, hf, spec, run.block_file(i))
        faults.point(f"block:{i}")
        run.save_block(i, hidden if i + 1 < n else None, tokens)
        progress(Step(task, i + 1, n))


def _quantize_one(b: Block, i: int, hf, spec: QuantSpec, dest: Path) -> torch.Tensor | None:
    """Quantize block i and write it to `dest` (with its experts' calibration record in the
    file's metadata); the activations entering the next block."""
    from safetensors.torch import save_file

    layer, hidden = b.layer, b.hidden
    tensors = block_tensors(hf, i)
    materialize(layer, tensors, b.device, b.dtype)
    qt = _quantized(b, spec)
    if hidden is not None:
        with phase("block outputs"):
            hidden = run_block(layer, hidden, b.ctx, b.device, b.dtype, b.batch)
    block = {}
    state = layer.state_dict()
    for name, t in tensors.items():  # norms, biases, skipped layers: as the method left them
        base = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and (f"{base}.qweight" in qt or name in qt):
            continue
        block[f"model.layers.{i}.{name}"] = state[name].to("cpu", t.dtype) if name in state else t
    block.update({f"model.layers.{i}.{k}": v.contiguous() for k, v in qt.items()})
    tmp = dest.with_suffix(".tmp")
    save_file(block, str(tmp), metadata={"format": "pt", **block_metadata(b)})
    os.replace(tmp, dest)
    layer.to("meta")
    return hidden
