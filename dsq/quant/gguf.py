"""GGUF quantization: an HF directory -> a float GGUF (dsq.convert.hf_to_gguf) -> optionally an
importance matrix (dsq.quant.imatrix) -> llama.cpp's own quantizer (`llama_model_quantize`).

`quantize_gguf` is the last step: a float GGUF (F32/F16/BF16) in, the output appearing only when
the quantizer succeeded (temp file + rename); progress follows the bytes written.
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import numpy as np
    import torch

    from dsq.runtime.model_ref import ModelRef

from dsq.errors import BackendError, DsqError
from dsq.formats.gguf_file import GGUFFile
from dsq.formats.gguf_types import FLOAT_TYPES, FTYPES, parse_gguf_type
from dsq.formats.hf import atomic_output_file
from dsq.quant.method import Method, check_target
from dsq.quant.spec import GGUFSpec, OnStep, Step, no_progress

# bits per weight of each whole-file type (for the progress estimate and reports)
APPROX_BPW = {"Q8_0": 8.5, "Q6_K": 6.56, "Q5_K_M": 5.7, "Q5_K_S": 5.5, "Q5_0": 5.5, "Q4_K_M": 4.9,
              "Q4_K_S": 4.6, "Q4_0": 4.5, "Q3_K_M": 3.9, "Q3_K_S": 3.5, "Q3_K_L": 4.3, "Q2_K": 3.35,
              "F16": 16, "BF16": 16, "F32": 32}


def quantize_gguf(src: str | Path, out: str | Path, qtype: str, threads: int | None = None,
                  force: bool = False, progress: Callable[[int, int], None] | None = None,
                  imatrix: dict[str, "np.ndarray"] | None = None) -> Path:
    """Quantize float GGUF `src` to `qtype` at `out` with llama.cpp's quantizer.

    imatrix: GGUF tensor name -> mean squared input activation per column (row length floats),
    llama.cpp's importance matrix; the quantizer weighs rounding errors by it.
    """
    from dsq.runtime.llama_cpp_backend import default_threads, import_llama_cpp, last_log

    qtype = parse_gguf_type(qtype)
    if qtype in FLOAT_TYPES:
        raise DsqError(f"{qtype} is a float type", "write float types with `dsq convert`")
    g = GGUFFile(src)
    float_types = {"F32", "F16", "BF16"}
    big = [t for t in g.tensors if len(t.shape) >= 2 and t.type_name not in float_types]
    if big:
        raise DsqError(f"{Path(src).name} is already quantized ({big[0].name} is {big[0].type_name})",
                       "quantize from a float model (an HF directory or an F16/BF16/F32 GGUF)")
    n_params = sum(t.n_elements for t in g.tensors)
    expected = int(n_params * APPROX_BPW.get(qtype, 8) / 8)
    llama_cpp = import_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[qtype]
    params.nthread = threads or default_threads()
    keep = []  # the ctypes array and its buffers must outlive the call
    if imatrix:
        import ctypes

        import numpy as np

        entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        for i, (name, vals) in enumerate(sorted(imatrix.items())):
            arr = np.ascontiguousarray(vals, dtype=np.float32)
            keep.append(arr)
            entries[i].name = name.encode()
            entries[i].data = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entries[i].size = arr.size
        entries[len(imatrix)].name = None  # terminator
        keep.append(entries)
        params.imatrix = ctypes.cast(entries, type(params.imatrix))

    with atomic_output_file(Path(out), force=force) as tmp:
        result: dict = {}

        def work():
            try:
                result["rc"] = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
            except Exception as e:  # ctypes errors
                result["error"] = e

        th = threading.Thread(target=work, daemon=True)
        th.start()
        while th.is_alive():
            th.join(0.2)
            if progress:
                try:
                    progress(min(tmp.stat().st_size, expected), expected)
                except OSError:
                    pass
        if "error" in result or result.get("rc", 1) != 0:
            detail = result.get("error") or last_log() or f"return code {result.get('rc')}"
            raise BackendError(f"llama.cpp's quantizer failed ({detail})",
                               "check the input GGUF and the free disk space")
        if progress:
            progress(expected, expected)
        # llama.cpp writes the output itself: check it is a complete GGUF before it goes live
        GGUFFile(tmp)
    return Path(out)


class GGUF(Method):
    name = "gguf"
    spec_type = GGUFSpec

    def spec(self, options: dict) -> GGUFSpec:
        return GGUFSpec.from_options(options)

    def validate(self, spec: GGUFSpec) -> None:
        spec.type = parse_gguf_type(spec.type)

    def weight_bits(self, spec: GGUFSpec) -> float:
        return APPROX_BPW.get(spec.type, 8)

    def output_name(self, spec: GGUFSpec) -> str:
        return f"{spec.type}{'-imat' if spec.imatrix else ''}.gguf"

    def quantize(self, source: Path, out: Path, spec: GGUFSpec, *, device: str = "auto", force: bool = False,
                 threads: int | None = None, progress: OnStep = no_progress, batch: int = 8,
                 compute_dtype: "torch.dtype | None" = None) -> Path:
        """An HF directory (or a float GGUF) -> `spec.type` at `out`, through a float GGUF."""
        check_target(out, force)
        if out.is_dir():
            raise DsqError(f"{out} is a directory", "pass a file path to --out")
        ref = _source(source, spec)
        imat = None
        if spec.imatrix:
            from dsq.quant.imatrix import compute_imatrix

            imat = compute_imatrix(ref.path, spec.calib, device, progress, batch, compute_dtype)
        with tempfile.TemporaryDirectory(prefix=".dsq-", dir=out.parent if out.parent.exists() else None) as td:
            src = _float_gguf(ref, out if spec.type in FLOAT_TYPES else Path(td) / "float.gguf", spec.type, force,
                              progress)
            if spec.type not in FLOAT_TYPES:
                task = f"quantizing to {spec.type} (llama.cpp)"
                progress(Step(task, unit="bytes"))
                quantize_gguf(src, out, spec.type, threads=threads, force=force, imatrix=imat,
                              progress=lambda done, total: progress(Step(task, done, total, unit="bytes")))
        return out

    def describe(self, out: Path) -> str:
        g = GGUFFile(out)
        n = sum(t.n_elements for t in g.tensors)
        size = out.stat().st_size
        return f"{size / 2**20:.1f} MiB, {8 * size / max(n, 1):.2f} bits/weight, {g.describe_quant()}"


def _source(source: Path, spec: GGUFSpec) -> "ModelRef":
    """The model to quantize, refused before any work if the pipeline cannot take it."""
    from dsq.runtime.model_ref import resolve_model

    ref = resolve_model(str(source))
    if ref.kind == "hf":  # check the architecture before any work
        from dsq.formats.hf import HFModelDir
        from dsq.models.registry import arch_for_model_type

        arch_for_model_type(HFModelDir(ref.path).model_type)
    if spec.imatrix and (ref.kind != "hf" or spec.type in FLOAT_TYPES):
        raise DsqError("--imatrix needs an HF source and a quantized --type", "pass the HF model directory")
    if ref.kind != "hf" and spec.type in FLOAT_TYPES:
        raise DsqError(f"{ref.path.name} is already a GGUF", "use `dsq convert` for float conversions")
    return ref


def _float_gguf(ref: "ModelRef", dst: Path, qtype: str, force: bool, progress: OnStep) -> Path:
    """The float GGUF the quantizer reads: a GGUF source as it is, an HF one converted to `dst`
    (in `qtype` when that is a float type, else in the model's own float type)."""
    if ref.kind != "hf":
        return ref.path
    from dsq.convert.hf_to_gguf import hf_to_gguf

    task = f"{ref.path.name} -> GGUF"
    progress(Step(task))
    hf_to_gguf(ref.path, dst, qtype if qtype in FLOAT_TYPES else "auto", force=force,
               progress=lambda name, i, total: progress(Step(task, i, total, item=name)))
    return dst
