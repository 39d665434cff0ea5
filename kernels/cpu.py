"""The C CPU kernels (kernels/csrc), built at install time once per instruction set; the best one
this CPU runs is loaded with ctypes. `available()` is False when no build exists (no compiler at
install time): the dispatcher then keeps the torch reference."""

from __future__ import annotations

import ctypes
import os
import platform
from functools import lru_cache
from pathlib import Path

import torch

GGML_TYPES = {"Q4_0": 2, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _candidates() -> list[str]:
    flags = _cpu_flags()
    out = []
    if platform.machine() in ("x86_64", "AMD64"):
        if {"avx512f", "avx512bw", "avx512vl", "fma", "f16c"} <= flags:
            out.append("avx512")
        if {"avx2", "fma", "f16c"} <= flags:
            out.append("avx2")
    out.append("generic")
    return out


def supported_isas() -> list[str]:
    """Builds this CPU can run, best first."""
    return _candidates()


@lru_cache(maxsize=None)
def load(isa: str):
    """The ctypes library built for `isa`, or None if it was not built."""
    for f in sorted(Path(__file__).parent.glob(f"_cpu_{isa}*.so")):
        try:
            lib = ctypes.CDLL(str(f))
        except OSError:
            continue
        lib.dsq_gguf_gemm.restype = ctypes.c_int
        lib.dsq_gguf_gemm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                      ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
        lib.dsq_gguf_rows.restype = ctypes.c_int
        lib.dsq_gguf_rows.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
                                      ctypes.c_int64, ctypes.c_void_p]
        return lib
    return None


@lru_cache(maxsize=1)
def library():
    """(ctypes library, ISA name) of the best build for this CPU, or (None, reason)."""
    if os.environ.get("DSQ_NO_CPU_KERNELS"):
        return None, "disabled by DSQ_NO_CPU_KERNELS"
    for isa in _candidates():
        lib = load(isa)
        if lib is not None:
            return lib, isa
    return None, "no compiled CPU kernels found (was a C compiler present at install?)"


def available() -> bool:
    return library()[0] is not None


def gguf_linear(x: torch.Tensor, raw: torch.Tensor, qtype: str, in_features: int,
                bias: torch.Tensor | None = None, out: torch.Tensor | None = None, lib=None) -> torch.Tensor:
    """y = x W^T (+ bias) for GGUF blocks `raw` (N, row_bytes), float32 x on the CPU.
    `out` (M, N) float32 may be given (the tests poison it); `lib` picks a build."""
    lib = lib or library()[0]
    N = raw.shape[0]
    shape = x.shape
    xf = x.reshape(-1, in_features).to(torch.float32).contiguous()
    y = out if out is not None else torch.empty(xf.shape[0], N, dtype=torch.float32)
    assert y.shape == (xf.shape[0], N) and y.dtype == torch.float32 and y.is_contiguous()
    raw = raw.contiguous()
    rc = lib.dsq_gguf_gemm(raw.data_ptr(), GGML_TYPES[qtype], N, in_features, xf.data_ptr(), xf.shape[0],
                           y.data_ptr(), torch.get_num_threads())
    if rc:
        raise ValueError(f"dsq_gguf_gemm refused {qtype} with {in_features} inputs")
    if bias is not None:
        y += bias.float()
    return y.reshape(*shape[:-1], N).to(x.dtype)


def gguf_rows(ids: torch.Tensor, raw: torch.Tensor, qtype: str, dim: int) -> torch.Tensor:
    lib, _ = library()
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.shape[0], dim, dtype=torch.float32)
    if lib.dsq_gguf_rows(raw.data_ptr(), GGML_TYPES[qtype], dim, flat.data_ptr(), flat.shape[0], out.data_ptr()):
        raise ValueError(f"dsq_gguf_rows refused {qtype}")
    return out.reshape(*ids.shape, dim)
