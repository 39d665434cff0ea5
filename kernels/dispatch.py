"""Choose the implementation for a quantized op by device, format and shape.

- CUDA: the Triton kernels over the packed layout (kernels/triton_qlinear.py) when Triton imports.
  `gpu_kernel` decides: MMA_MIN_ROWS..MMA_MAX_ROWS rows of bf16/fp16 x against int4 grouped codes
  (AWQ/GPTQ) take the tensor-core kernel (kernels/triton_mma.py) unless DSQ_MMA=0; up to
  Q8_MAX_ROWS rows of x (decode) with integer codes take the int8-activation kernels (x rounded to
  int8 per 32 elements as llama.cpp does, packed.linear_ref_q8) unless DSQ_ACT_Q8=0 (Q6_K, which
  that kernel takes at one row only, one row at a time); above that,
  up to MMA_MAX_ROWS, other 4-bit codes (Q4_K, Q4_0, int4 in groups of 32) take the tensor-core
  kernel that scales the weights before the MMA (triton_mma.mma_linear_scaled); from
  DEQUANT_MIN_ROWS rows (prefill; Q5/Q6_K formats from the rows int8 x leaves them) the weight is
  written out in bf16 for one cuBLAS GEMM; the rest the float-x ones.
- CPU: the C kernels (kernels/csrc) when they were built.
- Anything else, or DSQ_KERNELS=reference: the torch reference with the same signature.
Shape is decided inside each kernel family (GEMV at M=1, tiles and tl.dot / blocked rows above).
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
from dsq.kernels import cpu, fp8_ref, gguf_ref, intq_ref, packed


ACT_Q8 = os.environ.get("DSQ_ACT_Q8", "1") != "0"
# Up to this many rows of x take the int8-activation kernels: on an H200 (int4, 28672x8192) the int8-x
# kernel with MR rows (then _gemm_q8, now _gemv_q8 with MR) ran at 1.65-1.77x bf16 at M = 2 and 1.16x
# at 4 against the tl.dot GEMM's 0.77-0.83x, and lost at 8 (0.61x vs 0.84x) and 16 (0.39x vs 0.78x)
# (docs/benchmarks.md, session 4; the register-prefetch candidates are not yet measured there)
Q8_MAX_ROWS = 4
MMA = os.environ.get("DSQ_MMA", "1") != "0"
# From this many rows of x int4 grouped codes take the bf16 tensor-core kernel (triton_mma): on an H200
# it beat the int8-x kernel at 4 rows on the four decode shapes (11.5-57.4 us against 23.8-92.8 in the
# same run) and lost to it at 2 on three of them (docs/benchmarks.md, session 6)
MMA_MIN_ROWS = 3
# Up to this many rows the tensor-core kernels take x. Session 7 on an H200 (int4 g128, the four
# decode shapes): at 32 rows 0.70-1.02x bf16 against the tl.dot GEMM's 0.23-0.50x, at 64 rows
# 0.41-0.65x against 0.24-0.54x (a tie at 28672x8192: 219.7 vs 214.5 us); Q4_K at 16 rows with the
# weight-scaling variant 0.56-0.65x against 0.33-0.47x (docs/benchmarks.md, session 7)
MMA_MAX_ROWS = 64
# From this many rows of x (prefill) a weight is written out in x's dtype and multiplied by cuBLAS
# (triton_qlinear.dequant_linear) instead of the tl.dot GEMM. On an H200 (session 8, the four decode
# shapes) at 128 rows: Q4_K 0.34-0.47x bf16 against the GEMM's 0.16-0.28x, Q6_K 0.27-0.35x against
# 0.11-0.18x, int4 g128 0.38-0.53x against 0.24-0.56x (the GEMM won at 28672x8192 only); at 2048 rows
# 0.77-0.92x against 0.11-0.48x; end to end a 512-token prompt of an 8B Q4_K_M GGUF prefilled at 14011
# tok/s against 7654 (docs/benchmarks.md, session 8). DSQ_DEQUANT_ROWS=N moves it (0: never); FP8
# (untimed against its own GEMM) takes it only when DSQ_DEQUANT_ROWS is set.
_DQ_ENV = os.environ.get("DSQ_DEQUANT_ROWS", "").strip()
DEQUANT_MIN_ROWS = int(_DQ_ENV) if _DQ_ENV.isdigit() else 128
DEQUANT_FP8 = _DQ_ENV.isdigit()
# The tl.dot GEMM of formats with a high-bit plane (Q5_0, Q5_K, Q6_K) is slow at any row count: on an
# H200 (session 8) Q6_K at 2-64 rows 0.10-0.27x bf16 against 0.24-0.37x for the bf16 weight and
# cuBLAS, Q5_K at 8 and 64 rows 0.13-0.29x against 0.23-0.37x. So they take the bf16 weight from
# this many rows, after the int8-x kernels (Q5: up to Q8_MAX_ROWS rows; Q6_K: one GEMV a row, 0.39-1.09x
# at 2-4 rows). (Q8_0's GEMM kept up: 0.47-0.59x against 0.32-0.53x.)
DEQUANT_HI_BITS_ROWS = 2


# _reference() runs ~200 times a CPU decode step: read os.environ's own dict (what os.environ.get
# reads, ~50x cheaper than the call) so DSQ_KERNELS set at any time, from the process's start or
# with os.environ / monkeypatch.setenv later, still takes effect at the next call
try:
    _ENV, _ENV_KEY, _ENV_REF = os.environ._data, os.environ.encodekey("DSQ_KERNELS"), os.environ.encodevalue("reference")
except AttributeError:  # an os.environ without CPython's internals
    _ENV = None


def _reference() -> bool:
    if _ENV is not None:
        return _ENV.get(_ENV_KEY) == _ENV_REF
    return os.environ.get("DSQ_KERNELS") == "reference"


@lru_cache(maxsize=1)
def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401
        from dsq.kernels import triton_qlinear  # noqa: F401
    except Exception:  # noqa: BLE001 - no Triton, or one that cannot build here: keep the reference
        return False
    return True


def use_triton(device: torch.device | str) -> bool:
    """Whether weights on `device` should be packed for the Triton kernels."""
    return torch.device(device).type == "cuda" and not _reference() and _triton_ok()


def _cpu_kernels() -> bool:
    """Whether CPU tensors go to the C kernels (DSQ_KERNELS is read at every call)."""
    return not _reference() and cpu.available()


def _cpu(x: torch.Tensor, fn: str):
    """The C kernel `fn` when x is on the CPU and the kernels were built, else None. Under
    torch.compile: the same kernel as an operator it can trace (kernels/ops.py)."""
    if not x.is_cpu:
        return None
    if torch.compiler.is_compiling():
        from dsq.kernels import ops

        return getattr(ops, fn) if ops.available() else None
    return getattr(cpu, fn) if _cpu_kernels() else None


def gguf_linear(x: torch.Tensor, raw: torch.Tensor, qtype: str, in_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    k = _cpu(x, "gguf_linear")
    if k is not None and qtype in cpu.GGML_TYPES:
        return k(x, raw, qtype, in_features, bias)
    return gguf_ref.gguf_linear_ref(x, raw, qtype, in_features, bias)


def gguf_embedding(ids: torch.Tensor, raw: torch.Tensor, qtype: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    k = _cpu(ids, "gguf_rows")
    if k is not None and qtype in cpu.GGML_TYPES:
        return k(ids, raw, qtype, dim).to(dtype)
    return gguf_ref.gguf_embedding_ref(ids, raw, qtype, dim, dtype)


# above this many values torch's multi-threaded rms_norm wins over the one-thread C loop (prefill)
RMS_NORM_C_MAX = 1 << 15


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """The C RMS norm for a small contiguous float32 x on the CPU in eager mode (the decode step's
    norms), or None: the caller then runs torch.rms_norm."""
    if (x.numel() > RMS_NORM_C_MAX or x.dtype != torch.float32 or weight.dtype != torch.float32 or not x.is_cpu
            or not weight.is_cpu or not x.is_contiguous() or not weight.is_contiguous() or weight.ndim != 1
            or x.shape[-1] != weight.shape[0] or torch.compiler.is_compiling() or not _cpu_kernels()
            or not cpu.has("dsq_rms_norm") or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return None
    return cpu.rms_norm(x, weight, eps, check=False)


def attn_decode_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float) -> torch.Tensor | None:
    """The C decode attention (kernels/cpu.py attn_decode: q (B, 1, H, D) contiguous, k/v cache
    slices (B, Hk, S, D), mask (B, 1, 1, S) bool) in eager mode on the CPU, as (B, 1, H * D);
    None when it does not apply (the caller then runs SDPA)."""
    if (q.dtype != torch.float32 or k.dtype != torch.float32 or v.dtype != torch.float32 or not q.is_cpu
            or not q.is_contiguous() or k.stride(-1) != 1 or k.stride(-2) != k.shape[-1] or v.stride() != k.stride()
            or (mask is not None and not mask.is_contiguous()) or torch.compiler.is_compiling()
            or not _cpu_kernels() or not cpu.has("dsq_attn_decode")
            or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))):
        return None
    return cpu.attn_decode(q, k, v, mask, scale)


TRITON_ATTN = os.environ.get("DSQ_TRITON_ATTN", "1") != "0"


def attn_decode_gpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float) -> torch.Tensor | None:
    """The Triton decode attention (kernels/triton_attn.py: q (B, H, 1, D), k/v cache slices
    (B, Hk, S, D), mask (B, 1, 1, S) bool) on a GPU, as (B, 1, H * D); under torch.compile one
    operator call the graph keeps. None when it does not apply (the caller then runs SDPA);
    DSQ_TRITON_ATTN=0 keeps SDPA."""
    if (not TRITON_ATTN or mask is None or q.device.type != "cuda" or _reference() or not _triton_ok()
            or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))):
        return None
    from dsq.kernels import triton_attn

    if not triton_attn.supported(q, k, v, mask):
        return None
    if torch.compiler.is_compiling():
        from dsq.kernels import ops

        return ops.attn_decode(q, k, v, mask, scale)
    return triton_attn.attn_decode(q, k, v, mask, scale)


def attn_step_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                  k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, S: int,
                  mask: torch.Tensor | None, scale: float) -> torch.Tensor | None:
    """The eager CPU decode step's q/k norm, rope, KV cache write and attention in one C call
    (kernels/cpu.py attn_step), as (B, 1, H * D); None when it does not apply (the caller then
    runs them op by op). Checks here only what the model's decode step can vary (dtypes, layouts);
    cpu.attn_step is called without its own checks."""
    if (torch.compiler.is_compiling() or not _cpu_kernels() or not cpu.has("dsq_attn_step")
            or q.dtype != torch.float32 or k_cache.dtype != torch.float32 or not q.is_cpu or not k_cache.is_cpu
            or q.shape[1] != 1 or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1
            or q.stride(-2) != q.shape[-1] or k.stride(-2) != q.shape[-1] or v.stride(-2) != q.shape[-1]
            or not k_cache.is_contiguous() or v_cache.stride() != k_cache.stride()
            or not cos.is_contiguous() or not sin.is_contiguous() or cos.dtype != torch.float32
            or slots.dtype != torch.int64 or slots.numel() != 1 or not 1 <= S <= k_cache.shape[2]
            or (q_weight is not None and q_weight.dtype != torch.float32)
            or (k_weight is not None and k_weight.dtype != torch.float32)
            or (mask is not None and mask.numel() != q.shape[0] * S)
            or (mask is not None and (mask.dtype != torch.bool or not mask.is_contiguous()))
            or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))):
        return None
    return cpu.attn_step(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, slots, S, mask, scale,
                         check=False)


def int_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
               perm: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """dsq's internal int4/int8 layout (kernels/intq_ref.py)."""
    k = _cpu(x, "int_linear")
    if k is not None:
        return k(x, qweight, scales, zeros, bits, perm, bias)
    return intq_ref.int_linear_ref(x, qweight, scales, zeros, bits, perm, bias)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    k = _cpu(x, "fp8_linear")
    if k is not None:
        return k(x, weight, scale, bias)
    return fp8_ref.fp8_linear_ref(x, weight, scale, bias)


def packed_linear(x: torch.Tensor, p: packed.Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The GPU layout (kernels/packed.py). Under torch.compile: the same as one operator it keeps."""
    if torch.compiler.is_compiling():
        from dsq.kernels import ops

        return ops.packed_linear_op(x, p, bias)
    if x.device.type == "cuda" and not _reference() and _triton_ok():
        from dsq.kernels import triton_qlinear

        kind = gpu_kernel(p, x.numel() // p.K, x.dtype)
        if kind in ("mma", "mma_scaled"):
            from dsq.kernels import triton_mma

            if kind == "mma":
                return triton_mma.mma_linear(x, p, bias)
            return triton_mma.mma_linear_scaled(x, p, bias)
        if kind == "q8":
            return triton_qlinear.q8_linear(x, p, bias)
        if kind == "q8_rows":
            return triton_qlinear.q8_rows_linear(x, p, bias)
        if triton_qlinear.supported(p, x):
            if kind == "dequant":
                return triton_qlinear.dequant_linear(x, p, bias)
            return triton_qlinear.packed_linear(x, p, bias)
    return packed.linear_ref(x, p, bias)


def gpu_kernel(p: packed.Packed, rows: int, dtype: torch.dtype) -> str:
    """Which Triton kernel family takes `rows` rows of x on a GPU: "mma" (bf16 tensor cores, a few
    rows, int4 grouped codes), "q8" (int8 x, up to Q8_MAX_ROWS rows), "q8_rows" (the one-row int8-x
    GEMV a row: Q6_K at 2..Q8_MAX_ROWS rows), "mma_scaled" (tensor cores with the weights scaled
    first: other 4-bit codes, Q8_MAX_ROWS..MMA_MAX_ROWS rows), "dequant" (the weight written out for
    cuBLAS, from DEQUANT_MIN_ROWS rows, Q5/Q6_K from DEQUANT_HI_BITS_ROWS) or "float"."""
    dq = DEQUANT_MIN_ROWS and (DEQUANT_FP8 or p.fmt.codes != packed.FP8)
    if dq and rows >= DEQUANT_MIN_ROWS:
        return "dequant"
    mma_rows = MMA and MMA_MIN_ROWS <= rows <= MMA_MAX_ROWS and dtype in (torch.bfloat16, torch.float16)
    if mma_rows:
        from dsq.kernels import triton_mma  # only here: one row (decode) never needs it

        if triton_mma.supported(p, rows):
            return "mma"
    if ACT_Q8 and rows <= Q8_MAX_ROWS and packed.q8_ok(p, rows):
        return "q8"
    if ACT_Q8 and rows <= Q8_MAX_ROWS and packed.q8_ok(p, 1):
        return "q8_rows"
    if mma_rows and triton_mma.supported_scaled(p, rows):  # int8 x won at 4 rows (0.93-1.06x vs 0.72-0.83x)
        return "mma_scaled"
    if dq and p.fmt.hi_bits and rows >= DEQUANT_HI_BITS_ROWS:
        return "dequant"
    return "float"


def implementation(device: str = "cpu", qtype: str = "Q4_K") -> str:
    """Which implementation a call would use (for reports)."""
    if use_triton(device):
        return "Triton"
    x = torch.empty(0, device=device)
    if _cpu(x, "gguf_linear") is not None:
        return f"C ({cpu.library()[1]})"
    return "torch reference"
