"""The C CPU kernels (kernels/csrc), built at install time once per instruction set; the best one
this CPU runs is loaded with ctypes. `available()` is False when no build exists (no compiler at
install time): the dispatcher then keeps the torch reference.

`DSQ_CPU_ISA=avx512|avx2|neon|generic` forces a build, as if this CPU had nothing better (tests
and measurements of what other CPUs run); a build this CPU cannot run, or one not built, is an
error. Each kernel call runs on the caller's torch.get_num_threads() threads (the kernels' own
pool, csrc/pool.inc)."""

from __future__ import annotations

import ctypes
import os
import platform
from functools import lru_cache
from pathlib import Path

import torch

GGML_TYPES = {"Q4_0": 2, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
INT_BITS = (4, 8)  # dsq's integer layout (kernels/intq_ref.py)
FP8_SCALE_KINDS = {"tensor": 0, "channel": 1, "block": 2}  # kernels/fp8_ref.py scale_kind
FP8_BLOCK = 128
ISAS = ("avx512", "avx2", "neon", "generic")  # every build there is, best first


def _cpu_flags(key: str = "flags") -> set[str]:
    """The CPU's feature words from /proc/cpuinfo (Linux): "flags" on x86, "Features" on Arm."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == key:
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _candidates() -> list[str]:
    out = []
    machine = platform.machine()
    if machine in ("x86_64", "AMD64"):
        flags = _cpu_flags()
        if {"avx512f", "avx512bw", "avx512vl", "fma", "f16c"} <= flags:
            out.append("avx512")
        if {"avx2", "fma", "f16c"} <= flags:
            out.append("avx2")
    elif machine in ("aarch64", "arm64"):
        # NEON ("asimd" in Linux's Features) is part of every aarch64 CPU an OS runs on and of
        # every Apple M (macOS has no /proc/cpuinfo: no features read = NEON); the neon build checks
        # for the dot product instructions ("asimddp") itself, at run time
        features = _cpu_flags("Features")
        if not features or "asimd" in features:
            out.append("neon")
    out.append("generic")
    return out


def forced_isa() -> str | None:
    """The build DSQ_CPU_ISA asks for, or None. Raises ValueError for a name that is no build and
    RuntimeError for a build this CPU cannot run."""
    isa = os.environ.get("DSQ_CPU_ISA", "").strip().lower()
    if not isa:
        return None
    if isa not in ISAS:
        raise ValueError(f"DSQ_CPU_ISA={isa!r}: no such build (choose from {', '.join(ISAS)})")
    if isa not in _candidates():
        raise RuntimeError(f"DSQ_CPU_ISA={isa}: this CPU cannot run the {isa} build "
                           f"(it runs {', '.join(_candidates())})")
    return isa


def supported_isas() -> list[str]:
    """Builds this CPU can run, best first; with DSQ_CPU_ISA, the forced one and those below it."""
    runs = _candidates()
    isa = forced_isa()
    return runs[runs.index(isa):] if isa else runs


@lru_cache(maxsize=None)
def load(isa: str):
    """The ctypes library built for `isa`, or None if it was not built."""
    for f in sorted(Path(__file__).parent.glob(f"_cpu_{isa}*.so")):
        try:
            return load_file(f)
        except OSError:
            continue
    return None


def load_file(path) -> ctypes.CDLL:
    """The kernels' library at `path` with its functions' signatures set (a build of csrc/cpu_<isa>.c;
    benchmarks load variants built with other constants). Raises OSError where it does not load."""
    lib = ctypes.CDLL(str(path))
    lib.dsq_gguf_gemm.restype = ctypes.c_int
    lib.dsq_gguf_gemm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                  ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.dsq_gguf_rows.restype = ctypes.c_int
    lib.dsq_gguf_rows.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
                                  ctypes.c_int64, ctypes.c_void_p]
    if hasattr(lib, "dsq_moe_experts"):
        lib.dsq_moe_experts.restype = ctypes.c_int
        lib.dsq_moe_experts.argtypes = [*[ctypes.c_void_p] * 3, *[ctypes.c_int] * 3, *[ctypes.c_int64] * 6,
                                        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    if hasattr(lib, "dsq_rms_norm"):  # builds older than the norm kernel lack it
        lib.dsq_rms_norm.restype = ctypes.c_int
        lib.dsq_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_float, ctypes.c_void_p]
    if hasattr(lib, "dsq_read_sum"):
        lib.dsq_read_sum.restype = ctypes.c_uint64
        lib.dsq_read_sum.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    if hasattr(lib, "dsq_attn_decode"):
        lib.dsq_attn_decode.restype = ctypes.c_int
        lib.dsq_attn_decode.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                        *[ctypes.c_int64] * 7, ctypes.c_float, ctypes.c_void_p]
    if hasattr(lib, "dsq_attn_step"):
        lib.dsq_attn_step.restype = ctypes.c_int
        lib.dsq_attn_step.argtypes = [*[ctypes.c_void_p] * 3, *[ctypes.c_int64] * 7, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_float, *[ctypes.c_void_p] * 4,
                                      ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                      ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p]
    if hasattr(lib, "dsq_layer_decode"):
        lib.dsq_layer_scratch.restype = ctypes.c_int64
        lib.dsq_layer_scratch.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        lib.dsq_layer_decode.restype = ctypes.c_int
        lib.dsq_layer_decode.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                         ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                         ctypes.c_int64, ctypes.c_int]
    if hasattr(lib, "dsq_round_x8"):  # the avx2 build's rounding of x to int8 (its tests)
        lib.dsq_round_x8.restype = ctypes.c_int
        lib.dsq_round_x8.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_void_p]
    if hasattr(lib, "dsq_set_int8_rows"):  # the x86 builds' integer tiles at M > 1
        lib.dsq_set_int8_rows.restype = None
        lib.dsq_set_int8_rows.argtypes = [ctypes.c_int]
    if hasattr(lib, "dsq_set_threads"):  # builds older than the thread pool lack it
        lib.dsq_set_threads.restype = None
        lib.dsq_set_threads.argtypes = [ctypes.c_int]
        lib.dsq_get_threads.restype = ctypes.c_int
        lib.dsq_get_threads.argtypes = []
    if hasattr(lib, "dsq_int_gemm"):  # builds older than the integer / FP8 kernels lack them
        lib.dsq_int_gemm.restype = ctypes.c_int
        lib.dsq_int_gemm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                     ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
        lib.dsq_fp8_gemm.restype = ctypes.c_int
        lib.dsq_fp8_gemm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                                     ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_int]
    return lib


@lru_cache(maxsize=1)
def library():
    """(ctypes library, ISA name) of the best build for this CPU, or (None, reason)."""
    if os.environ.get("DSQ_NO_CPU_KERNELS"):
        return None, "disabled by DSQ_NO_CPU_KERNELS"
    isa = forced_isa()
    if isa:
        if load(isa) is None:
            raise RuntimeError(f"DSQ_CPU_ISA={isa}: the {isa} build of the CPU kernels was not built "
                               f"(reinstall dsq with a C compiler)")
        return load(isa), isa
    for isa in _candidates():
        lib = load(isa)
        if lib is not None:
            return lib, isa
    return None, "no compiled CPU kernels found (was a C compiler present at install?)"


def available() -> bool:
    return library()[0] is not None


def gguf_linear(x: torch.Tensor, raw: torch.Tensor, qtype: str, in_features: int,
                bias: torch.Tensor | None = None, out: torch.Tensor | None = None, lib=None,
                threads: int | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for GGUF blocks `raw` (N, row_bytes), float32 x on the CPU.
    `out` (M, N) float32 may be given (the tests poison it); `lib` picks a build; `threads`
    (default torch.get_num_threads()) the threads the call may use."""
    # The decode step makes ~130 of these calls per token: skip every no-op conversion (a float32
    # contiguous x is used as it is, the output is allocated in its final shape).
    fn = (lib or library()[0]).dsq_gguf_gemm
    N = raw.shape[0]
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
    M = xf.numel() // in_features
    if out is None:
        y = torch.empty(*x.shape[:-1], N) if x.ndim != 2 else torch.empty(M, N)
    else:
        y = out
        assert y.shape == (M, N) and y.dtype == torch.float32 and y.is_contiguous()
    if not raw.is_contiguous():
        raw = raw.contiguous()
    if fn(raw.data_ptr(), GGML_TYPES[qtype], N, in_features, xf.data_ptr(), M, y.data_ptr(),
          threads or torch.get_num_threads()):
        raise ValueError(f"dsq_gguf_gemm refused {qtype} with {in_features} inputs")
    if bias is not None:
        y += bias.float()
    if out is not None:
        y = y.reshape(*x.shape[:-1], N)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def gguf_rows(ids: torch.Tensor, raw: torch.Tensor, qtype: str, dim: int) -> torch.Tensor:
    lib, _ = library()
    flat = ids if ids.dtype == torch.int64 and ids.is_contiguous() else ids.to(torch.int64).contiguous()
    out = torch.empty(*ids.shape, dim)
    if lib.dsq_gguf_rows(raw.data_ptr(), GGML_TYPES[qtype], dim, flat.data_ptr(), flat.numel(), out.data_ptr()):
        raise ValueError(f"dsq_gguf_rows refused {qtype}")
    return out


def _moe_check(x, ids, weights, gate, up, down, qtypes, out) -> torch.Tensor:
    """moe_experts's argument checks; returns the output tensor (`out`, or a new one)."""
    M, H = x.shape
    E, inter = gate.shape[:2]
    k = ids.shape[-1] if ids.ndim == 2 else 0
    if not (x.dtype == weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == weights.shape
            and ids.shape[0] == M and k and all(t.is_contiguous() and t.is_cpu for t in (x, ids, weights))):
        raise ValueError(f"moe_experts: needs contiguous CPU float32 x (M, H), int64 ids and float32 weights "
                         f"(M, k), got {_desc(x)}, {_desc(ids)}, {_desc(weights)}")
    if any(q not in GGML_TYPES for q in qtypes):
        raise ValueError(f"moe_experts: the C kernels run {', '.join(GGML_TYPES)}, not {'/'.join(qtypes)}")
    from dsq.kernels.gguf_ref import row_bytes

    want = ((E, inter, row_bytes(qtypes[0], H)), (E, inter, row_bytes(qtypes[1], H)), (E, H, row_bytes(qtypes[2], inter)))
    for name, t, shape in zip(("gate", "up", "down"), (gate, up, down), want):
        if (t.dtype != torch.uint8 or tuple(t.shape) != shape or not t.is_cpu or t.stride(2) != 1
                or t.stride(1) != shape[2]):
            raise ValueError(f"moe_experts: {name} must be uint8 {shape} with contiguous experts, got {_desc(t)}")
    y = out if out is not None else torch.empty(M, H)
    if y.shape != (M, H) or y.dtype != torch.float32 or not y.is_contiguous() or not y.is_cpu:
        raise ValueError(f"moe_experts: out must be a contiguous float32 ({M}, {H}) CPU tensor, got {_desc(y)}")
    return y


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                down: torch.Tensor, qtypes: tuple[str, str, str], out: torch.Tensor | None = None, lib=None,
                threads: int | None = None) -> torch.Tensor:
    """A MoE layer's routed experts for every row of x in one C call (csrc/moe_cpu.inc; torch
    reference: moe_ref.moe_experts_ref): x (M, H) float32, ids (M, k) int64 and weights (M, k)
    float32, all contiguous on the CPU; gate and up (E, I, row bytes), down (E, H, row bytes) uint8
    GGUF blocks of the (gate, up, down) `qtypes`, each expert's rows contiguous (views into the
    file's stacked tensors are fine). Returns (M, H) float32 (into `out` if given); `threads` as in
    gguf_linear. Bad input raises ValueError."""
    lib = _lib_with(lib, "dsq_moe_experts")
    y = _moe_check(x, ids, weights, gate, up, down, qtypes, out)
    E, inter = gate.shape[:2]
    M, H = x.shape
    if lib.dsq_moe_experts(gate.data_ptr(), up.data_ptr(), down.data_ptr(), *(GGML_TYPES[q] for q in qtypes), E, H, inter,
                           gate.stride(0), up.stride(0), down.stride(0), x.data_ptr(), M, ids.data_ptr(),
                           weights.data_ptr(), ids.shape[1], y.data_ptr(), threads or torch.get_num_threads()):
        raise ValueError(f"dsq_moe_experts refused {'/'.join(qtypes)} experts ({E}, {inter}, {H}): "
                         f"an expert id outside 0..{E - 1}, a width the formats do not take, or no memory")
    return y


class MoeArgs(ctypes.Structure):
    """dsq_moe_host's arguments (csrc/moe_cpu.inc dsq_moe_args)."""

    _fields_ = [(n, ctypes.c_void_p) for n in ("gate", "up", "down")] + [
        (n, ctypes.c_int64) for n in ("qt_gate", "qt_up", "qt_down", "n_expert", "H", "I", "gate_stride", "up_stride",
                                      "down_stride")] + [
        ("x", ctypes.c_void_p), ("M", ctypes.c_int64), ("ids", ctypes.c_void_p), ("wts", ctypes.c_void_p),
        ("k", ctypes.c_int64), ("out", ctypes.c_void_p), ("nthreads", ctypes.c_int64), ("status", ctypes.c_int64)]


def moe_host_args(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                  down: torch.Tensor, qtypes: tuple[str, str, str], out: torch.Tensor,
                  threads: int | None = None) -> MoeArgs:
    """moe_experts's call as a struct for dsq_moe_host (a CUDA host function: moe_host_fn), over
    fixed buffers the caller keeps alive and refills before each call (checked as moe_experts)."""
    _moe_check(x, ids, weights, gate, up, down, qtypes, out)
    E, inter = gate.shape[:2]
    M, H = x.shape
    return MoeArgs(gate.data_ptr(), up.data_ptr(), down.data_ptr(), *(GGML_TYPES[q] for q in qtypes), E, H, inter,
                   gate.stride(0), up.stride(0), down.stride(0), x.data_ptr(), M, ids.data_ptr(), weights.data_ptr(),
                   ids.shape[1], out.data_ptr(), threads or torch.get_num_threads(), 0)


def moe_host_fn(lib=None) -> int | None:
    """The address of dsq_moe_host (a C function of one pointer, for cuLaunchHostFunc), or None."""
    lib = lib or library()[0]
    if lib is None or not hasattr(lib, "dsq_moe_host"):
        return None
    return ctypes.cast(lib.dsq_moe_host, ctypes.c_void_p).value


def run_moe_host(args: MoeArgs, lib=None) -> None:
    """Call dsq_moe_host on this thread (what the CUDA callback thread does); raises on failure."""
    lib = _lib_with(lib, "dsq_moe_host")
    lib.dsq_moe_host.restype = None
    lib.dsq_moe_host.argtypes = [ctypes.c_void_p]
    lib.dsq_moe_host(ctypes.addressof(args))
    if args.status:
        raise ValueError("dsq_moe_host refused its arguments (an expert id out of range, or no memory)")


@lru_cache(maxsize=1)
def cuda_host_launcher():
    """launch(stream handle, C function address, argument address): the CUDA driver's
    cuLaunchHostFunc, which queues a host function on a stream (and into a CUDA graph being
    captured on it); None without the driver library."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        fn = cuda.cuLaunchHostFunc
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]

    def launch(stream: int, host_fn: int, arg: int) -> None:
        err = fn(stream, host_fn, arg)
        if err:
            raise RuntimeError(f"cuLaunchHostFunc failed with CUresult {err}")
    return launch


def set_threads(n: int, lib=None) -> None:
    """Threads the kernels use for this thread's later calls that pass none (attention); GEMM calls
    pass torch.get_num_threads() themselves. The count is per OS thread, as torch's is per process."""
    lib = lib or library()[0]
    if lib is not None and hasattr(lib, "dsq_set_threads"):
        lib.dsq_set_threads(n)


def set_int8_rows(on: bool, lib=None) -> None:
    """Whether this OS thread's later GGUF calls at M > 1 may round x to int8 per 32 values (the
    integer tiles, kernels/csrc/gguf_i8gemm_cpu.inc): the builds whose decode already does (avx2)
    take them; the others, and a process with DSQ_INT8_PREFILL set, ignore it."""
    lib = lib or library()[0]
    if lib is not None and hasattr(lib, "dsq_set_int8_rows"):
        lib.dsq_set_int8_rows(int(on))


def has(fn: str) -> bool:
    """Whether the loaded build has the C function `fn` (builds older than a kernel lack it)."""
    lib = library()[0]
    return lib is not None and hasattr(lib, fn)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, lib=None, check: bool = True) -> torch.Tensor:
    """torch.rms_norm(x, (D,), weight, eps) for contiguous float32 x (..., D) and weight (D,) on
    the CPU, in one C call (decode runs ~100 of these per token, each ~8 ops in eager torch).
    check=False skips the argument checks (the dispatcher made them)."""
    lib = _lib_with(lib, "dsq_rms_norm") if check or lib is None else lib
    D = weight.shape[0]
    if check and not (x.dtype == weight.dtype == torch.float32 and x.is_cpu and weight.is_cpu and x.shape[-1] == D
                      and weight.ndim == 1 and x.is_contiguous() and weight.is_contiguous()):
        raise ValueError(f"rms_norm: needs contiguous float32 CPU x (..., {D}) and weight ({D},), "
                         f"got {_desc(x)}, {_desc(weight)}")
    y = torch.empty_like(x)
    if lib.dsq_rms_norm(x.data_ptr(), weight.data_ptr(), x.numel() // D, D, eps, y.data_ptr()):
        raise ValueError(f"dsq_rms_norm refused {_desc(x)}")
    return y


def read_sum(buf: torch.Tensor, threads: int | None = None, lib=None) -> int:
    """The sum mod 2^64 of a contiguous CPU buffer's 64-bit words (its bytes a multiple of 4096), read on
    `threads` threads (default torch.get_num_threads()) by the kernels' pool: timed, it is the read
    rate the decode kernels can reach (runtime/machine.py measure_cpu_peak_read)."""
    lib = _lib_with(lib, "dsq_read_sum")
    nbytes = buf.numel() * buf.element_size()
    if not (buf.is_cpu and buf.is_contiguous() and nbytes % 4096 == 0):
        raise ValueError(f"read_sum: needs a contiguous CPU buffer of a multiple of 4096 bytes, got {_desc(buf)}")
    return int(lib.dsq_read_sum(buf.data_ptr(), nbytes // 8, threads or torch.get_num_threads()))


def attn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                lib=None, threads: int | None = None) -> torch.Tensor:
    """Attention of one new token per sequence: q (B, H, D) (any shape whose memory is that, e.g.
    (B, 1, H, D)), k and v (B, Hk, S, D) float32 with rows of D contiguous (a slice of the KV
    cache), mask (B, S) bool (True = attend; any shape of B * S contiguous values) or None.
    Returns softmax(q k^T * scale) v as (B, 1, H * D) float32, in one C call on `threads` threads
    (default torch.get_num_threads())."""
    lib = _lib_with(lib, "dsq_attn_decode")
    B, Hk, S, D = k.shape
    H = q.numel() // (B * D)
    if not (q.dtype == k.dtype == v.dtype == torch.float32 and q.is_contiguous() and q.numel() == B * H * D
            and H % Hk == 0 and v.shape == k.shape and v.stride() == k.stride() and k.stride(-1) == 1
            and k.stride(-2) == D and q.is_cpu and k.is_cpu and v.is_cpu):
        raise ValueError(f"attn_decode: needs contiguous float32 q (B, H, D) and k, v (B, Hk, S, D) with "
                         f"contiguous rows, got {_desc(q)}, {_desc(k)}, {_desc(v)}")
    if mask is not None and (mask.dtype != torch.bool or mask.numel() != B * S or not mask.is_contiguous()):
        raise ValueError(f"attn_decode: mask must be a contiguous bool tensor of {B} x {S} values, got {_desc(mask)}")
    out = torch.empty(B, 1, H * D)
    set_threads(threads or torch.get_num_threads(), lib)
    if lib.dsq_attn_decode(q.data_ptr(), k.data_ptr(), v.data_ptr(), None if mask is None else mask.data_ptr(),
                           B, H, Hk, S, D, k.stride(0), k.stride(1), scale, out.data_ptr()):
        raise ValueError(f"dsq_attn_decode refused q {_desc(q)}, k {_desc(k)} (or ran out of memory)")
    return out


def attn_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
              k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
              k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, S: int,
              mask: torch.Tensor | None, scale: float, lib=None, check: bool = True,
              threads: int | None = None) -> torch.Tensor:
    """The eager decode step's attention for one new token per sequence, in one C call:
    q (B, 1, H, D), k and v (B, 1, Hk, D) float32 (heads of D contiguous; views of a fused
    projection's output are fine), RMS-normed per head by q_weight / k_weight (D,) (rms_norm; None:
    no norm), rotated by HF's rotate-half rope with cos / sin (B, 1, 1, D) (apply_rope), k and v
    written into k_cache / v_cache (B, Hk, >= S, D) at column slots[0] (KVCache.update), then
    attn_decode over the first S columns with mask (B, S values, bool) or None.
    Returns (B, 1, H * D) float32. check=False skips the argument checks (the dispatcher made them);
    `threads` as in attn_decode."""
    lib = _lib_with(lib, "dsq_attn_step")
    B, _, H, D = q.shape
    Hk = k.shape[2]
    if check:
        f32 = torch.float32
        ws = [w for w in (q_weight, k_weight) if w is not None]
        if not (q.dtype == k.dtype == v.dtype == cos.dtype == sin.dtype == k_cache.dtype == v_cache.dtype == f32
                and q.shape[1] == 1 and k.shape == v.shape == (B, 1, Hk, D) and H % Hk == 0 and D % 2 == 0
                and all(t.stride(-1) == 1 and t.stride(-2) == D for t in (q, k, v))
                and cos.shape == sin.shape and cos.numel() == B * D and cos.is_contiguous() and sin.is_contiguous()
                and k_cache.shape[:2] == (B, Hk) and k_cache.shape[3] == D and 1 <= S <= k_cache.shape[2]
                and v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()
                and k_cache.stride(-1) == 1 and k_cache.stride(-2) == D
                and slots.dtype == torch.int64 and slots.numel() == 1 and 0 <= int(slots[0]) < S
                and all(w.dtype == f32 and w.shape == (D,) and w.is_contiguous() for w in ws)
                and all(t.is_cpu for t in (q, k, v, cos, sin, k_cache, v_cache, slots, *ws))):
            raise ValueError(f"attn_step: needs float32 CPU q (B, 1, H, D), k, v (B, 1, Hk, D), cos, sin (B, 1, 1, D) "
                             f"and caches (B, Hk, >= S, D), got q {_desc(q)}, k {_desc(k)}, v {_desc(v)}, "
                             f"cache {_desc(k_cache)}, S={S}")
        if mask is not None and (mask.dtype != torch.bool or mask.numel() != B * S or not mask.is_contiguous()
                                 or not mask.is_cpu):
            raise ValueError(f"attn_step: mask must be a contiguous bool tensor of {B} x {S} values, got {_desc(mask)}")
    out = torch.empty(B, 1, H * D)
    set_threads(threads or torch.get_num_threads(), lib)
    if lib.dsq_attn_step(q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0), v.stride(0), B, H, Hk,
                         D, None if q_weight is None else q_weight.data_ptr(),
                         None if k_weight is None else k_weight.data_ptr(), eps, cos.data_ptr(), sin.data_ptr(),
                         k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                         slots.data_ptr(), S, None if mask is None else mask.data_ptr(), scale, out.data_ptr()):
        raise ValueError(f"dsq_attn_step refused q {_desc(q)}, cache {_desc(k_cache)} (or ran out of memory)")
    return out


class Proj(ctypes.Structure):
    """One GGUF projection of a LayerDesc (csrc/layer_cpu.inc dsq_proj): blocks, type, N, K, bias."""
    _fields_ = [("w", ctypes.c_void_p), ("qtype", ctypes.c_int64), ("N", ctypes.c_int64), ("K", ctypes.c_int64),
                ("bias", ctypes.c_void_p)]


class LayerDesc(ctypes.Structure):
    """A decoder layer as dsq_layer_decode reads it (csrc/layer_cpu.inc dsq_layer_desc, field for
    field): pointers into tensors the builder keeps alive (dsq/runtime/fused_layer.py)."""
    _fields_ = [*[(n, ctypes.c_int64) for n in ("hidden", "n_head", "n_kv", "head_dim", "ffn", "window", "act",
                                                "sandwich", "n_qkv", "n_gu")],
                *[(n, ctypes.c_float) for n in ("eps", "qk_eps", "scale", "pad0")],
                *[(n, ctypes.c_void_p) for n in ("attn_norm", "attn_out_norm", "ffn_norm", "ffn_out_norm", "q_norm",
                                                 "k_norm")],
                ("qkv", Proj * 3), ("o", Proj), ("gu", Proj * 2), ("down", Proj)]


ACTS = {"silu": 0, "gelu_tanh": 1}


def layer_scratch(desc: LayerDesc, B: int, S: int, lib=None) -> int:
    """Floats of scratch layer_decode needs for B rows over S cache slots."""
    return int(_lib_with(lib, "dsq_layer_scratch").dsq_layer_scratch(ctypes.addressof(desc), B, S))


def layer_decode(desc: LayerDesc, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: int,
                 pad: torch.Tensor, S: int, cos: torch.Tensor, sin: torch.Tensor, scratch: torch.Tensor | None = None,
                 lib=None, threads: int | None = None) -> torch.Tensor:
    """One decode step of a whole decoder layer in one C call (csrc/layer_cpu.inc): x (B, 1, hidden)
    or (B, hidden) contiguous float32, updated in place and returned; the new token's keys and values
    written into k_cache / v_cache (B, Hk, >= S, D) at column `slot`; attention over columns
    pad[b]..slot (and the window) of the first S; rope rows slot - pad[b] of cos / sin (L, D).
    `scratch` (float32, layer_scratch floats at least) is made when not given. The runtime's decode
    step calls the library directly (dsq/runtime/fused_layer.py); this checks its arguments."""
    lib = _lib_with(lib, "dsq_layer_decode")
    B, D = x.shape[0], desc.head_dim
    f32 = torch.float32
    if not (x.dtype == k_cache.dtype == v_cache.dtype == cos.dtype == sin.dtype == f32 and x.is_contiguous()
            and x.numel() == B * desc.hidden and k_cache.shape[:2] == (B, desc.n_kv) and k_cache.shape[3] == D
            and 1 <= S <= k_cache.shape[2] and 0 <= slot < S and v_cache.shape == k_cache.shape
            and v_cache.stride() == k_cache.stride() and k_cache.stride(-1) == 1 and k_cache.stride(-2) == D
            and cos.shape == sin.shape and cos.ndim == 2 and cos.shape[1] == D and cos.is_contiguous()
            and sin.is_contiguous() and pad.dtype == torch.int64 and pad.shape == (B,) and pad.is_contiguous()
            and all(t.is_cpu for t in (x, k_cache, v_cache, cos, sin, pad))):
        raise ValueError(f"layer_decode: needs float32 CPU x (B, {desc.hidden}), caches (B, {desc.n_kv}, >= S, {D}), "
                         f"cos/sin (L, {D}) and int64 pad (B,), got x {_desc(x)}, cache {_desc(k_cache)}, "
                         f"cos {_desc(cos)}, pad {_desc(pad)}, S={S}, slot={slot}")
    need = layer_scratch(desc, B, S, lib)
    if scratch is None:
        scratch = torch.empty(need)
    if scratch.dtype != f32 or not scratch.is_contiguous() or scratch.numel() < need:
        raise ValueError(f"layer_decode: scratch needs {need} contiguous float32 values, got {_desc(scratch)}")
    if lib.dsq_layer_decode(ctypes.addressof(desc), x.data_ptr(), B, k_cache.data_ptr(), v_cache.data_ptr(),
                            k_cache.stride(0), k_cache.stride(1), slot, pad.data_ptr(), S, cos.data_ptr(),
                            sin.data_ptr(), cos.shape[0], scratch.data_ptr(), scratch.numel(),
                            threads or torch.get_num_threads()):
        raise ValueError(f"dsq_layer_decode refused x {_desc(x)} at slot {slot} (bad positions, or out of memory)")
    return x


def _lib_with(lib, fn: str):
    lib = lib or library()[0]
    if lib is None:
        raise RuntimeError(f"no compiled CPU kernels: {library()[1]}")
    if not hasattr(lib, fn):
        raise RuntimeError(f"this build of the CPU kernels has no {fn}: reinstall dsq to rebuild them")
    return lib


def _desc(t) -> str:
    return f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__


def _prepare(x: torch.Tensor, K: int, N: int, out: torch.Tensor | None, what: str):
    """x (..., K) float on the CPU -> float32 (M, K) contiguous, and y (M, N) float32."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or not x.is_cpu:
        raise TypeError(f"{what}: x must be a floating point CPU tensor, got {_desc(x)}")
    if x.ndim < 1 or x.shape[-1] != K:
        raise ValueError(f"{what}: x is {_desc(x)}, its last dimension must be {K}")
    # (a few microseconds per call matter in decode: skip the no-op conversions)
    xf = x if x.ndim == 2 and x.dtype == torch.float32 and x.is_contiguous() else \
        x.reshape(-1, K).to(torch.float32).contiguous()
    M = xf.shape[0]
    if out is None:
        return xf, torch.empty(M, N, dtype=torch.float32)
    if out.shape != (M, N) or out.dtype != torch.float32 or not out.is_contiguous() or not out.is_cpu:
        raise ValueError(f"{what}: out must be a contiguous float32 ({M}, {N}) CPU tensor, got {_desc(out)}")
    return xf, out


def _finish(x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, N: int, what: str) -> torch.Tensor:
    if bias is not None:
        if bias.numel() != N:
            raise ValueError(f"{what}: bias is {_desc(bias)}, it needs {N} values")
        y += bias.reshape(N).float()
    if x.ndim != 2:
        y = y.reshape(*x.shape[:-1], N)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def int_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
               perm: torch.Tensor | None = None, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
               lib=None, threads: int | None = None) -> torch.Tensor:
    """y = x[..., perm] W^T (+ bias) for dsq's integer layout (kernels/intq_ref.py): qweight uint8
    (N, K/2) for 4 bits or (N, K) for 8, scales float16 (N, G), zeros uint8 (N, G), groups of
    K/G columns (even for 4 bits). Returns x's dtype; `out` (M, N) float32 may be given (the
    tests poison it); `lib` picks a build; `threads` as in gguf_linear. Bad input raises TypeError /
    ValueError."""
    lib = _lib_with(lib, "dsq_int_gemm")
    if bits not in INT_BITS:
        raise ValueError(f"int_linear: bits must be 4 or 8, got {bits!r}")
    what = f"int{bits}_linear"
    if not (isinstance(qweight, torch.Tensor) and qweight.dtype == torch.uint8 and qweight.ndim == 2
            and isinstance(scales, torch.Tensor) and scales.dtype == torch.float16 and scales.ndim == 2
            and isinstance(zeros, torch.Tensor) and zeros.dtype == torch.uint8 and zeros.ndim == 2):
        raise TypeError(f"{what}: needs qweight uint8 (N, K*{bits}/8), scales float16 (N, G), zeros uint8 (N, G), "
                        f"got {_desc(qweight)}, {_desc(scales)}, {_desc(zeros)}")
    N, K = qweight.shape[0], qweight.shape[1] * 8 // bits
    G = scales.shape[1]
    if scales.shape[0] != N or zeros.shape != scales.shape or not G or K % G or (bits == 4 and (K // G) % 2):
        raise ValueError(f"{what}: scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} do not fit "
                         f"({N}, {K}) weights in groups of an {'even ' if bits == 4 else ''}size dividing {K}")
    if not (qweight.is_cpu and scales.is_cpu and zeros.is_cpu):
        raise TypeError(f"{what}: weights must be on the CPU, got {qweight.device}")
    xf, y = _prepare(x, K, N, out, what)
    if perm is not None:
        if not isinstance(perm, torch.Tensor) or perm.dtype not in (torch.int64, torch.int32) or perm.shape != (K,):
            raise ValueError(f"{what}: perm must be an int64 ({K},) tensor, got {_desc(perm)}")
        xf = xf[:, perm].contiguous()
    if xf.shape[0] and N:
        qweight, scales, zeros = qweight.contiguous(), scales.contiguous(), zeros.contiguous()
        if lib.dsq_int_gemm(qweight.data_ptr(), scales.data_ptr(), zeros.data_ptr(), bits, N, K, G, xf.data_ptr(),
                            xf.shape[0], y.data_ptr(), threads or torch.get_num_threads()):
            raise ValueError(f"dsq_int_gemm refused int{bits} ({N}, {K}) in {G} groups (or ran out of memory)")
    return _finish(x, y, bias, N, what)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None, lib=None, threads: int | None = None) -> torch.Tensor:
    """y = x (weight * scale)^T (+ bias) for float8_e4m3fn weight (N, K) and a float scale per
    tensor (1,), per output channel (N, 1) or per 128x128 block (ceil(N/128), ceil(K/128))
    (kernels/fp8_ref.py). Returns x's dtype; `out`, `lib` and `threads` as in int_linear."""
    from dsq.kernels.fp8_ref import scale_kind

    lib = _lib_with(lib, "dsq_fp8_gemm")
    if not (isinstance(weight, torch.Tensor) and weight.dtype == torch.float8_e4m3fn and weight.ndim == 2
            and isinstance(scale, torch.Tensor) and scale.is_floating_point()):
        raise TypeError(f"fp8_linear: needs weight float8_e4m3fn (N, K) and a float scale, "
                        f"got {_desc(weight)}, {_desc(scale)}")
    if not (weight.is_cpu and scale.is_cpu):
        raise TypeError(f"fp8_linear: weights must be on the CPU, got {weight.device}")
    N, K = weight.shape
    kind = scale_kind(scale, N)
    if kind == "block" and tuple(scale.shape) != (-(-N // FP8_BLOCK), -(-K // FP8_BLOCK)):
        raise ValueError(f"fp8_linear: scale {tuple(scale.shape)} is none of (1,), ({N}, 1) or "
                         f"({-(-N // FP8_BLOCK)}, {-(-K // FP8_BLOCK)}) for ({N}, {K}) weights")
    xf, y = _prepare(x, K, N, out, "fp8_linear")
    if xf.shape[0] and N:
        w = weight.contiguous().view(torch.uint8)
        s = scale.to(torch.float32).contiguous()
        if lib.dsq_fp8_gemm(w.data_ptr(), s.data_ptr(), FP8_SCALE_KINDS[kind], N, K, xf.data_ptr(), xf.shape[0],
                            y.data_ptr(), threads or torch.get_num_threads()):
            raise ValueError(f"dsq_fp8_gemm refused ({N}, {K}) with a {kind} scale (or ran out of memory)")
    return _finish(x, y, bias, N, "fp8_linear")
