"""GGUF quantization through llama.cpp's own quantizer (`llama_model_quantize`).

Input: a float GGUF (F32/F16/BF16), e.g. from `dsq.convert.hf_to_gguf`. The output appears only
when the quantizer succeeded (temp file + rename); progress follows the bytes written.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import numpy as np

from dsq.errors import BackendError, DsqError
from dsq.formats.gguf_file import GGUFFile
from dsq.formats.gguf_types import FLOAT_TYPES, FTYPES, parse_gguf_type
from dsq.formats.hf import atomic_output_file

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

