"""Quantization: one module per method (rtn, gptq, awq, fp8, gguf) behind `registry.METHODS`, the
layer-by-layer driver, calibration, the importance matrix and recipes.

`quantize` is what `dsq quantize` calls. This package's own import stays light (no torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dsq.quant.spec import CalibSpec, GGUFSpec, OnStep, QuantSpec, Step, no_progress

if TYPE_CHECKING:
    import torch

__all__ = ["quantize", "CalibSpec", "QuantSpec", "GGUFSpec", "Step"]


def quantize(source: str | Path, out: str | Path, spec: QuantSpec | GGUFSpec, *, device: str = "auto",
             force: bool = False, threads: int | None = None, progress: OnStep | None = None, batch: int = 8,
             compute_dtype: "torch.dtype | None" = None) -> Path:
    """Quantize the model at `source` into `out` as `spec` says; returns `out`.

    QuantSpec (rtn, gptq, awq, fp8): an HF directory in, an HF directory with its
    quantization_config out, made one decoder block at a time; an interrupted calibrated run
    resumes from its last finished block. GGUFSpec: an HF directory or a float GGUF in, a GGUF of
    llama.cpp's `spec.type` out (a float type writes the conversion itself), with an importance
    matrix from the calibration text when `spec.imatrix`.

    device: auto, cpu or cuda, where blocks compute. threads: llama.cpp's quantizer threads.
    progress: called with a `Step` as each task starts and advances. batch: calibration sequences
    per forward. compute_dtype: what blocks compute in (default float32 on a CPU, bfloat16 on a GPU).
    """
    spec.validate()
    return spec.impl.quantize(Path(source), Path(out), spec, device=device, force=force, threads=threads,
                              progress=progress or no_progress, batch=batch, compute_dtype=compute_dtype)
