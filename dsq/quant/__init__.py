"""Quantization: one module per method (rtn, gptq, awq, fp8, gguf) behind `registry.METHODS`, the
layer-by-layer driver, calibration, the importance matrix and recipes.

`quantize` is what `dsq quantize` calls. This package's own import stays light (no torch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from dsq.quant.spec import EVAL_TOKENS, CalibSpec, GGUFSpec, OnStep, QuantSpec, Step, no_progress

if TYPE_CHECKING:
    import torch

__all__ = ["quantize", "evals_of", "CalibSpec", "QuantSpec", "GGUFSpec", "Step"]


def quantize(source: str | Path, out: str | Path, spec: QuantSpec | GGUFSpec, *, device: str = "auto",
             force: bool = False, threads: int | None = None, progress: OnStep | None = None, batch: int = 8,
             compute_dtype: "torch.dtype | None" = None, eval_tokens: int = EVAL_TOKENS) -> Path:
    """Quantize the model at `source` into `out` as `spec` says; returns `out`.

    QuantSpec (rtn, gptq, awq, fp8): an HF directory in, an HF directory with its
    quantization_config out, made one decoder block at a time and evaluated against the source on
    `eval_tokens` held-out tokens (0: no evaluation) before it appears at `out`, its numbers in
    the model card and in `evals_of(out)`. GGUFSpec: an HF directory or a float GGUF in, a GGUF of
    llama.cpp's `spec.type` out (a float type writes the conversion itself), with an importance
    matrix from the calibration text when `spec.imatrix`.

    An interrupted or killed run leaves its work beside `out` (OUT.partial, or .NAME.dsq-work for
    a GGUF); the next run of the same command resumes from it, and a successful run leaves only
    `out`. Too little disk space is a `DiskFull` error, before any work where it can be foreseen.

    device: auto, cpu or cuda, where blocks compute. threads: llama.cpp's quantizer threads.
    progress: called with a `Step` as each task starts and advances. batch: calibration sequences
    per forward. compute_dtype: what blocks compute in (default float32 on a CPU, bfloat16 on a GPU).
    """
    spec.validate()
    return spec.impl.quantize(Path(source), Path(out), spec, device=device, force=force, threads=threads,
                              progress=progress or no_progress, batch=batch, compute_dtype=compute_dtype,
                              eval_tokens=eval_tokens)


def evals_of(out: str | Path) -> dict | None:
    """The model-card evaluation of the HF artifact at `out` (perplexity, source perplexity, KLD,
    top-1 agreement, tokens), or None when it was made without one."""
    record = Path(out) / "dsq_quant.json"
    return json.loads(record.read_text()).get("eval") if record.is_file() else None
