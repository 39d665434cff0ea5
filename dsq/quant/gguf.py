"""GGUF quantization: an HF directory -> a float GGUF (dsq.convert.hf_to_gguf) -> optionally an
importance matrix (dsq.quant.imatrix) -> llama.cpp's own quantizer (`llama_model_quantize`).

`quantize_gguf` is the last step: a float GGUF (F32/F16/BF16) in, the output appearing only when
the quantizer succeeded (temp file + rename); progress follows the bytes written. `GGUF.quantize`
keeps the steps' files in a work folder beside the output (dsq.quant.gguf_work), which the next
run of the same command reuses and a successful run removes.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import numpy as np
    import torch

    from dsq.runtime.model_ref import ModelRef

from dsq.errors import BackendError, DiskFull, DsqError
from dsq.formats.gguf_file import GGUFFile
from dsq.formats.gguf_types import FLOAT_TYPES, FTYPES, parse_gguf_type
from dsq.formats.hf import atomic_output_file
from dsq.quant import faults
from dsq.quant.gguf_work import Work
from dsq.quant.method import Method, calib_stamp, check_target, run_key
from dsq.quant.space import check_free, free_bytes, full_disk_error, is_disk_full
from dsq.quant.spec import EVAL_TOKENS, GGUFSpec, OnStep, Step, interrupted, no_progress

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
    from dsq.runtime.llama_probe import check_loads

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
    check_loads(src, {"call": "quantize", "qtype": qtype})
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[qtype]
    params.nthread = threads or default_threads()
    buffers = _set_imatrix(llama_cpp, params, imatrix) if imatrix else []
    with atomic_output_file(Path(out), force=force) as tmp:
        result = _run_quantizer(llama_cpp, params, Path(src), tmp, expected, progress)
        if "error" in result or result.get("rc", 1) != 0:
            detail = result.get("error") or last_log() or f"return code {result.get('rc')}"
            _check_space(detail, tmp, expected, out)
            raise BackendError(f"llama.cpp's quantizer failed ({detail})", "check the input GGUF")
        if progress:
            progress(expected, expected)
        try:  # llama.cpp writes the output itself: check it is a complete GGUF before it goes live
            GGUFFile(tmp)
        except DsqError as e:
            _check_space(e, tmp, expected, out)
            raise
    del buffers  # the quantizer read the importance matrix through them
    return Path(out)


def _set_imatrix(llama_cpp, params, imatrix: dict[str, "np.ndarray"]) -> list:
    """Point `params` at the importance matrix; returns the ctypes array and its buffers, which
    must outlive the quantizer's call."""
    import ctypes

    import numpy as np

    keep = []
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
    return keep


def _run_quantizer(llama_cpp, params, src: Path, tmp: Path, expected: int,
                   progress: Callable[[int, int], None] | None) -> dict:
    """llama_model_quantize(src -> tmp) in a thread, its progress the bytes written so far.
    Returns {"rc": its return code} or {"error": what it raised}."""
    result: dict = {}

    def work():
        try:
            faults.point("gguf:quantize")
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
    return result


def _check_space(failure: BaseException | str, tmp: Path, expected: int, out: str | Path) -> None:
    """A quantizer failure that a full disk explains is a DiskFull."""
    written = tmp.stat().st_size if tmp.exists() else 0
    if is_disk_full(failure) or free_bytes(tmp.parent) < expected - written:
        raise DiskFull(f"llama.cpp's quantizer ran out of disk space writing {out} ({failure})",
                       "free up space and run it again")


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
                 compute_dtype: "torch.dtype | None" = None, eval_tokens: int = EVAL_TOKENS) -> Path:
        """An HF directory (or a float GGUF) -> `spec.type` at `out`, through a float GGUF; the
        steps in between are kept in .NAME.dsq-work (dsq.quant.gguf_work) until `out` is in place."""
        ref = _source(source, spec)
        work = Work(out, _keys(ref, spec, device, batch, compute_dtype), spec.type in FLOAT_TYPES)
        if work.published():  # the last run was stopped between its rename and its cleanup
            work.close()
            return out
        check_target(out, force)
        if out.is_dir():
            raise DsqError(f"{out} is a directory", "pass a file path to --out")
        check_free(out, _expected_bytes(ref, spec) - work.bytes())
        try:
            work.begin()
            reused = work.reused()
            if reused:
                progress(Step("", note=f"resuming: reusing the {' and '.join(reused)} an earlier run left in "
                                       f"{work.dir.name}"))
            if not work.ready():
                _make(work, ref, spec, device, threads, batch, compute_dtype, progress)
            work.publish()
        except BaseException as e:
            kept = work.tidy(keep=isinstance(e, KeyboardInterrupt) or is_disk_full(e))
            if is_disk_full(e):
                raise full_disk_error(out, _expected_bytes(ref, spec) - work.bytes(), kept) from e
            raise interrupted(e, kept) from e
        return out

    def describe(self, out: Path) -> str:
        g = GGUFFile(out)
        return f"{out.stat().st_size / 2**20:.1f} MiB, {g.describe_quant()}: {bits_per_weight(g.tensors)}"


def bits_per_weight(tensors) -> str:
    """Bits per weight over every tensor; where the layers' (blk.*) differ, theirs too and the
    tensors outside them that hold a large share of the weights, at their type: a small model's
    one figure is mostly its embedding's (llama.cpp keeps token_embd at 6-8 bits in every mix)."""
    n = sum(t.n_elements for t in tensors) or 1
    bits = 8 * sum(t.n_bytes for t in tensors) / n
    layers = [t for t in tensors if t.name.startswith("blk.")]
    in_layers = 8 * sum(t.n_bytes for t in layers) / max(sum(t.n_elements for t in layers), 1)
    if not layers or abs(in_layers - bits) < 0.5:
        return f"{bits:.2f} bits/weight"
    big = [f"{t.name} ({100 * t.n_elements / n:.0f}% of the weights) is {t.type_name}" for t in tensors
           if not t.name.startswith("blk.") and t.n_elements >= 0.1 * n]
    return f"{bits:.2f} bits/weight, {in_layers:.2f} in the layers" + "".join(f"; {b}" for b in big)


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


def _make(work: Work, ref: "ModelRef", spec: GGUFSpec, device: str, threads: int | None, batch: int,
          compute_dtype: "torch.dtype | None", progress: OnStep) -> None:
    """The importance matrix, the float GGUF and the quantized product in `work`, each step
    skipped where the last run finished it."""
    imat = None
    if spec.imatrix:
        from dsq.quant.imatrix import compute_imatrix

        imat = work.imatrix(lambda: compute_imatrix(ref.path, spec.calib, device, progress, batch, compute_dtype))
    src = work.float_gguf(lambda dst: _convert(ref, dst, spec.type, progress)) if ref.kind == "hf" else ref.path
    if spec.type not in FLOAT_TYPES:
        task = f"quantizing to {spec.type} (llama.cpp)"
        progress(Step(task, unit="bytes"))
        quantize_gguf(src, work.product, spec.type, threads=threads, force=True, imatrix=imat,
                      progress=lambda done, total: progress(Step(task, done, total, unit="bytes")))
    work.finish()


def _convert(ref: "ModelRef", dst: Path, qtype: str, progress: OnStep) -> None:
    """The HF source as a float GGUF at `dst`: in `qtype` when that is a float type, else in the
    model's own float type."""
    from dsq.convert.hf_to_gguf import hf_to_gguf

    task = f"{ref.path.name} -> GGUF"
    progress(Step(task))

    def step(name: str, i: int, total: int) -> None:
        faults.point("gguf:convert")
        progress(Step(task, i, total, item=name))

    hf_to_gguf(ref.path, dst, qtype if qtype in FLOAT_TYPES else "auto", force=True, progress=step)


def _keys(ref: "ModelRef", spec: GGUFSpec, device: str, batch: int, compute_dtype) -> dict[str, str | None]:
    """The keys of what this run makes (dsq.quant.gguf_work): the float GGUF, the importance
    matrix (its calibration, and where and in what it computes), the product."""
    imat = None
    if spec.imatrix:
        from dsq.quant.blocks import default_dtype, device_for

        dev = device_for(device)
        imat = run_key(ref.path, "imatrix", calib_stamp(spec.calib), dev.type, str(compute_dtype or default_dtype(dev)),
                       batch)
    float_key = run_key(ref.path, "float", spec.type if spec.type in FLOAT_TYPES else "auto")
    return {"float": float_key if ref.kind == "hf" else None, "imatrix": imat,
            "product": run_key(ref.path, "gguf", spec.type, imat)}


def _expected_bytes(ref: "ModelRef", spec: GGUFSpec) -> int:
    """About the bytes the pipeline writes: an HF source's float GGUF, and the quantized output."""
    import math

    if ref.kind == "hf":
        from dsq.formats.hf import HFModelDir

        hf = HFModelDir(ref.path)
        n = sum(math.prod(hf.tensor_shape(name)) for name in hf.tensor_names())
    else:
        n = sum(t.n_elements for t in GGUFFile(ref.path).tensors)
    quantized = int(n * APPROX_BPW.get(spec.type, 8) / 8)
    if ref.kind != "hf":
        return quantized
    converted = n * (4 if spec.type == "F32" else 2)
    return converted + (0 if spec.type in FLOAT_TYPES else quantized)
