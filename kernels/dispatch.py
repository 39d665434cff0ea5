"""Choose the implementation of an op by device, format and shape: the model and the runtime's
quantized modules call these functions, never a kernel directly.

- Quantized matmuls (`packed_linear`, the GPU layout): on CUDA the Triton kernels when Triton
  imports; `gpu_kernel` picks the family by rows of x and format (see its docstring). Elsewhere
  the torch reference (kernels/packed.py). `packed_experts`: a MoE layer's (token, expert) pairs
  through stacked expert weights, the ids read on the device. `linear_add`: a module's output
  plus a residual, on a GPU at one row added in the int8-x GEMV's epilogue.
- GGUF, int4/int8 and FP8 weights on the CPU (`gguf_linear`, `int_linear`, `fp8_linear`): the C
  kernels (kernels/csrc) when they were built, else the torch reference with the same signature.
- A generation's prefill runs inside `int8_prefill()`: on the avx2 build, GGUF weights at M > 1
  then round x to int8 as its decode does.
- Attention (`attention_step`, `attention`) and the CPU RMS norm (`rms_norm`): the C kernels for
  an eager CPU decode step, the Triton decode kernel for a GPU one, SDPA otherwise; DeepSeek MLA's
  decode attention (`mla_decode`) over its latent rows on a GPU.
- An eager GPU step's norms, ropes, activations and MoE sums (`rms_norm_gpu`, `rope_gpu`,
  `act_mul_gpu`, `moe_combine`): one Triton launch each (kernels/triton_elementwise.py); a family
  whose kernels fail to build turns itself off (`_guarded`).
- DSQ_KERNELS=reference forces the torch reference everywhere.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from functools import lru_cache
from itertools import accumulate

import torch
import torch.nn.functional as F
from dsq.kernels import cpu, fp8_ref, gguf_ref, intq_ref, packed


ACT_Q8 = os.environ.get("DSQ_ACT_Q8", "1") != "0"
# up to this many rows of x the int8-x GEMV beats the tl.dot GEMM (docs/benchmarks.md#gpu-kernels-by-rows-of-x)
Q8_MAX_ROWS = 4
MMA = os.environ.get("DSQ_MMA", "1") != "0"
# from this many rows int4 grouped codes run faster on tensor cores than with int8 x (docs/benchmarks.md#gpu-kernels-by-rows-of-x)
MMA_MIN_ROWS = 3
# up to this many rows the tensor-core kernels beat the tl.dot GEMM (docs/benchmarks.md#gpu-kernels-by-rows-of-x)
MMA_MAX_ROWS = 64
# from this many rows (prefill) the weight written out for one cuBLAS GEMM beats the tl.dot GEMM (docs/benchmarks.md#prefill);
# DSQ_DEQUANT_ROWS=N moves it (0: never) and also sends FP8 there, which has no timing against its own GEMM
_DQ_ENV = os.environ.get("DSQ_DEQUANT_ROWS", "").strip()
DEQUANT_MIN_ROWS = int(_DQ_ENV) if _DQ_ENV.isdigit() else 128
DEQUANT_FP8 = _DQ_ENV.isdigit()
# from this many rows, past their int8-x rows, the bf16 weight and cuBLAS beat the slow tl.dot GEMM of Q5_0, Q5_K
# and Q6_K (a high-bit plane) (docs/benchmarks.md#gpu-kernels-by-rows-of-x)
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
        from dsq.kernels import triton_dequant, triton_gemm, triton_gemv, triton_gemv_q8  # noqa: F401
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


@contextmanager
def int8_prefill():
    """Within: this thread's GGUF matmuls on the CPU at M > 1 round x to int8 per 32 values where
    the kernels' build decodes that way (avx2: a generation's prompt then runs on its decode's
    contract, as llama.cpp's does, at ~2x the float tiles; docs/benchmarks.md#cpu-decode). Other
    builds, the GPU and everything outside (scoring, eval) keep x in float."""
    on = _cpu_kernels()
    if on:
        cpu.set_int8_rows(True)
    try:
        yield
    finally:
        if on:
            cpu.set_int8_rows(False)


def gguf_embedding(ids: torch.Tensor, raw: torch.Tensor, qtype: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    k = _cpu(ids, "gguf_rows")
    if k is not None and qtype in cpu.GGML_TYPES:
        return k(ids, raw, qtype, dim).to(dtype)
    return gguf_ref.gguf_embedding_ref(ids, raw, qtype, dim, dtype)


# above this many values (prefill) torch's multi-threaded rms_norm beats the one-thread C loop (docs/benchmarks.md#cpu-decode)
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight for float32 x on the CPU: the C kernel for the decode
    step's small rows in eager mode (rms_norm_cpu), torch.rms_norm otherwise."""
    y = rms_norm_cpu(x, weight, eps)
    return y if y is not None else torch.rms_norm(x, weight.shape, weight, eps)


# DSQ_GPU_ELEMENTWISE=0 keeps a GPU step's norms, ropes and activations as torch ops (the A/B of
# docs/benchmarks.md#gpu-decode)
GPU_ELEMENTWISE = os.environ.get("DSQ_GPU_ELEMENTWISE", "1") != "0"


# kernel families turned off in this process because their first build or launch failed: family -> the error
FAILED: dict[str, str] = {}


def _guarded(family: str, fn, *args):
    """fn(*args), or None once `family`'s kernels have failed here: a Triton build that fails on
    some GPU or Triton version turns that family off with a warning, and the torch ops run
    instead of the process ending. While a CUDA graph is being captured the error propagates."""
    if family in FAILED:
        return None
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - any failure of an optional kernel: keep torch's ops
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise
        FAILED[family] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        warnings.warn(f"dsq: the {family} GPU kernels failed here ({FAILED[family]}); running torch's ops "
                      "instead (please report it)", RuntimeWarning, stacklevel=2)
        return None


def _elementwise_gpu(*ts: torch.Tensor) -> bool:
    """Whether an eager GPU step's small elementwise ops go to kernels/triton_elementwise.py:
    CUDA tensors, outside torch.compile (inductor fuses the torch ops itself) and autograd."""
    return (GPU_ELEMENTWISE and ts[0].device.type == "cuda" and not torch.compiler.is_compiling()
            and not _reference() and _triton_ok()
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in ts)))


# x rounded to int8 for the q8 GEMVs in the launch of the norm, activation or decode attention that makes x, instead of a
# _quant_x launch before each GEMV that reads it: V2-Lite's all-GPU decode 376 -> 397 tok/s
# (docs/benchmarks.md#deepseek); DSQ_PRODUCER_Q8=0 turns it off
PRODUCER_Q8 = os.environ.get("DSQ_PRODUCER_Q8", "1") == "1"
# rows of x up to which the producers round it: a decode step's rows, or its (token, expert) pairs,
# which q8_experts takes at any count
PRODUCER_Q8_ROWS = 16


def _producer_q8(x: torch.Tensor) -> bool:
    """Whether the norm or activation making x (..., N) should round it to int8 as well."""
    return PRODUCER_Q8 and ACT_Q8 and x.shape[-1] % 32 == 0 and x.numel() // x.shape[-1] <= PRODUCER_Q8_ROWS


def rms_norm_gpu(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                 add: torch.Tensor | None = None):
    """base.RMSNorm on a GPU as one launch (with `add`: (x + add, its norm)), or None: the
    caller then runs torch."""
    if not _elementwise_gpu(x, weight) or weight.device != x.device:
        return None
    from dsq.kernels import triton_elementwise

    return _guarded("elementwise", triton_elementwise.rms_norm, x, weight, eps, offset, add, _producer_q8(x))


def rope_gpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor | None:
    """base.apply_rope / apply_rope_interleaved on a GPU as one launch, or None."""
    if not _elementwise_gpu(x) or cos.device != x.device:
        return None
    from dsq.kernels import triton_elementwise

    return _guarded("elementwise", triton_elementwise.rope, x, cos, sin, interleaved)


def act_mul_gpu(g: torch.Tensor, u: torch.Tensor, gelu: bool) -> torch.Tensor | None:
    """base.act_mul (silu or tanh-approximated gelu of g, times u) on a GPU as one launch, or None."""
    if not _elementwise_gpu(g, u):
        return None
    from dsq.kernels import triton_elementwise

    return _guarded("elementwise", triton_elementwise.act_mul, g, u, gelu, _producer_q8(g))


# an MLA decode step's query rope, latent norm, key rope and cache write as one GPU launch
# (triton_elementwise.mla_write) instead of ~5: V2-Lite's all-GPU decode 397 -> 428 tok/s
# (docs/benchmarks.md#deepseek); DSQ_MLA_WRITE=0 turns it off
MLA_WRITE = os.environ.get("DSQ_MLA_WRITE", "1") == "1"


def mla_write_gpu(q_rope: torch.Tensor, c: torch.Tensor, k_rope: torch.Tensor, weight: torch.Tensor, eps: float,
                  cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, slots: torch.Tensor,
                  interleaved: bool) -> torch.Tensor | None:
    """triton_elementwise.mla_write on a GPU (the rotated q_rope; the cache row written), or None:
    the caller then runs the torch ops."""
    if not MLA_WRITE or not _elementwise_gpu(q_rope, c) or k_cache.device != q_rope.device:
        return None
    from dsq.kernels import triton_elementwise

    return _guarded("elementwise", triton_elementwise.mla_write, q_rope, c, k_rope, weight, eps, cos, sin, k_cache,
                    slots, interleaved)


def moe_combine(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype, add: torch.Tensor | None = None):
    """(y.view(T, k, H) * weights[..., None]).sum(1).to(dtype), plus `add`: one launch on a GPU, or
    None (the caller then runs torch)."""
    if not _elementwise_gpu(y):
        return None
    from dsq.kernels import triton_elementwise

    return _guarded("elementwise", triton_elementwise.moe_combine, y, weights, dtype, add)


# A MoE router's softmax / sigmoid, groups, top-k and scaling as one GPU launch (triton_elementwise.moe_route)
# instead of ~6 torch kernels: all-GPU V2-Lite decode 336 -> 356 tok/s on an H200
# (docs/benchmarks.md#deepseek); DSQ_TRITON_ROUTER=0 keeps the torch ops
TRITON_ROUTER = os.environ.get("DSQ_TRITON_ROUTER", "1") != "0"


def moe_route(logits: torch.Tensor, params):
    """(weights, ids) of a MoE router from its float32 logits as one launch on a GPU, or None (the
    caller then runs torch). `params`: a callable giving triton_elementwise.moe_route's arguments
    (called only when the kernel runs)."""
    if not TRITON_ROUTER or not _elementwise_gpu(logits):
        return None
    from dsq.kernels import triton_elementwise

    return _guarded("elementwise", lambda: triton_elementwise.moe_route(logits, **params()))


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
    # the combination also rounds o (B, 1, H * D) for o_proj, up to the producers' rows (heads of whole
    # blocks: _decode); a build of that variant that fails here leaves the plain one
    if PRODUCER_Q8 and ACT_Q8 and q.shape[0] <= PRODUCER_Q8_ROWS:
        o = _guarded("attention rounding", triton_attn.attn_decode, q, k, v, mask, scale, None, 64, True)
        if o is not None:
            return o
    return triton_attn.attn_decode(q, k, v, mask, scale)


def mla_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, c: torch.Tensor, mask: torch.Tensor, scale: float,
               table: torch.Tensor | None = None, lens: torch.Tensor | None = None) -> torch.Tensor | None:
    """DeepSeek MLA's absorbed decode attention on a GPU (triton_attn.mla_decode: the latent rows
    read in place, once for a program's heads), as (B, 1, H, R); None where it does not apply
    (the caller then attends with `attention`)."""
    if (q_lat.device.type != "cuda" or not TRITON_ATTN or _reference() or not _triton_ok()
            or torch.compiler.is_compiling() or (torch.is_grad_enabled() and q_lat.requires_grad)):
        return None
    from dsq.kernels import triton_attn

    if not triton_attn.mla_supported(q_lat, q_rope, c, mask):
        return None
    return _guarded("MLA attention", triton_attn.mla_decode, q_lat, q_rope, c, mask, scale, table, lens)


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



def attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, norms, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, kv_len: int | None,
                   mask: torch.Tensor | None, scale: float, softcap: float | None) -> torch.Tensor | None:
    """A decode step's q/k norm, rope, KV cache write and attention as one call where one
    implementation does all four: the C kernels in an eager CPU decode step without a softcap and
    with a mask (attn_step_cpu); on a GPU, outside torch.compile, for layers without q/k norms,
    the rope and the cache write in one launch, then the Triton attention (_attention_step_gpu).
    q (B, 1, H, D), k/v (B, 1, Hk, D) before norm and rope, k_cache / v_cache the layer's whole
    cache (B, Hk, S, D), written at `slots`; attention over its first kv_len slots (all when
    None). norms(): (q weight, k weight, eps), (None, None, 0.0) without q/k norms, or None when
    they cannot be fused. Returns (B, 1, H * D), or None: the caller
    then runs the four itself and calls `attention`."""
    if q.shape[1] != 1 or mask is None or softcap or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    if not q.is_cpu:
        return _attention_step_gpu(q, k, v, norms, cos, sin, k_cache, v_cache, slots, kv_len, mask, scale)
    n = norms()
    if n is None:
        return None
    S = kv_len if kv_len is not None else k_cache.shape[2]
    return attn_step_cpu(q, k, v, *n, cos, sin, k_cache, v_cache, slots, S, mask, scale)


def _attention_step_gpu(q, k, v, norms, cos, sin, k_cache, v_cache, slots, kv_len, mask, scale):
    """attention_step on a GPU for layers without q/k norms: the rope of q and k and the cache
    write as one launch (triton_elementwise.rope_write), then `attention` over the cache."""
    n = norms()
    if n is None or n[0] is not None or n[1] is not None or not _elementwise_gpu(q):
        return None
    from dsq.kernels import triton_elementwise

    qr = _guarded("elementwise", triton_elementwise.rope_write, q, k, v, cos, sin, k_cache, v_cache, slots)
    if qr is None:
        return None
    S = kv_len if kv_len is not None else k_cache.shape[2]
    return attention(qr, k_cache[:, :, :S], v_cache[:, :, :S], mask, scale)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
              softcap: float | None = None) -> torch.Tensor:
    """softmax(q k^T scale, masked) v: q (B, T, H, D), k/v (B, Hk, S, D) in q's dtype (grouped
    query heads: H a multiple of Hk), mask bool (B, 1, T, S), True to attend, or None for causal;
    with `softcap` the logits are softcap * tanh(logits / softcap). Returns (B, T, H * D).
    One query token with a mask: the C kernel in an eager CPU step (attn_decode_cpu), written-out
    ops inductor fuses when compiling for the CPU, the Triton kernel on a GPU (attn_decode_gpu),
    where each is several times cheaper than SDPA; a softcap: float32 ops; anything else: SDPA."""
    B, T = q.shape[:2]
    decode = T == 1 and mask is not None
    if decode and not softcap and q.is_cpu:
        o = attn_decode_cpu(q, k, v, mask, scale)
        if o is not None:
            return o
    qt = q.transpose(1, 2)  # (B, H, T, D)
    if softcap:
        o = _softcap_attention(qt, k, v, mask, scale, softcap)
    elif decode and q.is_cpu and torch.compiler.is_compiling():
        o = _decode_attention(qt, k, v, mask, scale)
    elif T == 1 and q.is_cuda and (o := attn_decode_gpu(qt, k, v, mask, scale)) is not None:
        return o
    else:
        o = F.scaled_dot_product_attention(qt, k, v, attn_mask=mask, scale=scale, is_causal=mask is None,
                                           enable_gqa=qt.shape[1] != k.shape[1])
    return o.transpose(1, 2).reshape(B, T, -1)


def _softcap_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                       softcap: float) -> torch.Tensor:
    """Attention with capped logits in float32 (SDPA has no softcap): q (B, H, T, D) -> (B, H, T, D)."""
    rep = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.tanh((q.float() @ kr.float().transpose(-1, -2)) * scale / softcap) * softcap
    if mask is None:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    s = s.masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ vr.float()).to(q.dtype)


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token's attention written out, q (B, H, 1, D) -> (B, H, 1, D): under torch.compile
    inductor fuses it into two short loops, where SDPA stays an opaque call costing several times more."""
    B, H, _, D = q.shape
    Hk = k.shape[1]
    qg = q.reshape(B, Hk, H // Hk, 1, D)  # query heads by KV head
    s = (qg * k[:, :, None]).sum(-1) * scale  # (B, Hk, rep, S)
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return (p[..., None] * v[:, :, None]).sum(-2).reshape(B, H, 1, D)


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


def _triton_device(x: torch.Tensor) -> bool:
    """Whether the GPU layout's matmuls of x go to the Triton kernels: CUDA, unless DSQ_KERNELS=reference
    or Triton cannot build here."""
    return x.device.type == "cuda" and not _reference() and _triton_ok()


def packed_linear(x: torch.Tensor, p: packed.Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The GPU layout (kernels/packed.py). Under torch.compile: the same as one operator it keeps."""
    if torch.compiler.is_compiling():
        from dsq.kernels import ops

        return ops.packed_linear_op(x, p, bias)
    if _triton_device(x):
        y = _triton_linear(gpu_kernel(p, x.numel() // p.K, x.dtype), x, p, bias)
        if y is not None:
            return y
    return packed.linear_ref(x, p, bias)


# a decode step's residual add (x + mlp(h)) in the epilogue of the down projection's int8-x GEMV
# (linear_add) instead of a launch of its own, one a layer; DSQ_FUSE_RESIDUAL=0 keeps the separate add
FUSE_RESIDUAL = os.environ.get("DSQ_FUSE_RESIDUAL", "1") != "0"


def linear_add(module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """module(x) + residual. One row of x through a GPU-layout module without a bias of its own
    (a PackedLinear: `packed` and `bias` None) that the one-row int8-x GEMV takes ("q8"), the
    residual that row's shape, dtype and device, contiguous: the residual is that GEMV's bias,
    added in float32 to the sums before their one rounding to x's dtype, in the GEMV's launch
    (through packed_linear, so under torch.compile the same operator with its bias). Anything
    else (the CPU, prefill, other kernels, float weights, a module's own bias or hooks,
    DSQ_FUSE_RESIDUAL=0): module(x) + residual as it was."""
    p = _residual_epilogue(module, x, residual)
    if p is None:
        return module(x) + residual
    return packed_linear(x, p, residual.view(-1))


def _residual_epilogue(module, x: torch.Tensor, residual: torch.Tensor) -> packed.Packed | None:
    """The module's Packed weight when linear_add can add `residual` in its GEMV, else None."""
    if not FUSE_RESIDUAL or not _triton_device(x) or getattr(module, "bias", None) is not None:
        return None
    if getattr(module, "_forward_hooks", None) or getattr(module, "_forward_pre_hooks", None):
        return None  # a hook (calibration's capture) sees the module called
    p = getattr(module, "packed", None)
    if (not isinstance(p, packed.Packed) or x.numel() != p.K or residual.shape != (*x.shape[:-1], p.N)
            or residual.dtype != x.dtype or residual.device != x.device or not residual.is_contiguous()
            or (torch.is_grad_enabled() and residual.requires_grad)):
        return None
    return p if gpu_kernel(p, 1, x.dtype) == "q8" else None


def packed_experts(x: torch.Tensor, p: packed.Packed, ids: torch.Tensor, n_expert: int) -> torch.Tensor:
    """MoE pairs through their experts' weights stacked in one Packed (triton_gemv.gemv_experts:
    y[i] = x[i // (P / T)] W_ids[i]^T), the expert ids never leaving the device: on CUDA the
    Triton kernel, with x rounded to int8 (triton_gemv_q8.q8_experts) for the formats the int8-x
    GEMV takes unless DSQ_ACT_Q8=0, as a dense decode step's one row does; elsewhere the torch
    reference (packed.experts_ref). Under torch.compile: one operator."""
    if torch.compiler.is_compiling():
        from dsq.kernels import ops

        return ops.packed_experts_op(x, p, ids, n_expert)
    if x.device.type == "cuda" and not _reference() and _triton_ok():
        from dsq.kernels import triton_common, triton_gemv, triton_gemv_q8

        if ACT_Q8 and packed.q8_ok(p, 1):  # x rounded to int8, as the dense decode's GEMV (Q8_MAX_ROWS)
            return triton_gemv_q8.q8_experts(x, p, ids, n_expert)
        if triton_common.supported(p, x):
            return triton_gemv.gemv_experts(x, p, ids, n_expert)
    return packed.experts_ref(x, p, ids, n_expert)


# A prompt chunk's experts read their quantized weights straight into the tensor cores (one launch a
# projection: triton_mma.grouped_mma_scaled for 4-bit codes, triton_gemm.grouped_linear for the rest) rather
# than writing them out in bf16 for torch's grouped GEMM; DSQ_MOE_FUSED=0 keeps the written-out path
# (benchmarks/moe_prefill.py times both: fused 1.42 ms, written out 1.59 ms for V2-Lite's 512-token chunk on an
# H100, docs/benchmarks.md#part-3-with-the-fused-moe-prompt-path-h100-machine-2026-12-07-evening)
MOE_FUSED = os.environ.get("DSQ_MOE_FUSED", "1") != "0"


_TENSOR_CORES, _FUSED = "grouped experts (tensor cores)", "grouped experts (fused)"


def grouped_fused(x: torch.Tensor, p: packed.Packed, n_expert: int) -> str | None:
    """Which fused grouped kernel takes x's rows against the stack `p` of n_expert weights here (its
    family: _TENSOR_CORES, triton_mma.grouped_mma_scaled, or _FUSED, triton_gemm.grouped_linear), or
    None: on CUDA with MOE_FUSED, x in bf16 or fp16, a weight without act-order whose experts are
    whole blocks of scale rows, a family that has not failed here."""
    if not (MOE_FUSED and x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16)
            and not torch.compiler.is_compiling() and not _reference() and _triton_ok() and p.perm is None):
        return None
    from dsq.kernels import triton_common, triton_mma

    if triton_mma.supported_scaled(p, 1) and _TENSOR_CORES not in FAILED:
        return _TENSOR_CORES
    if triton_common.supported(p, x) and not (p.N // n_expert) % p.fmt.sc_rows and _FUSED not in FAILED:
        return _FUSED
    return None


def grouped_experts(x: torch.Tensor, p: packed.Packed, counts, n_expert: int,
                    slab_bytes: int | None = None) -> torch.Tensor:
    """y (P, N) = each row of x (P, K) through its expert's weight, the rows grouped by expert in
    order (counts[e] rows of expert e: a prompt chunk's (token, expert) pairs sorted by expert; a
    list, or an int tensor on x's device that the fused kernels read there, with no host sync);
    `p` stacks n_expert weights of N = p.N / n_expert rows. Each chosen expert's weight is read
    once for all its rows (once a tile of them on the fused path). On CUDA: one fused grouped launch
    (`grouped_fused`), or a slab of consecutive experts at a time written out in x's dtype by one
    dequantize launch and multiplied by one grouped GEMM (`grouped_gemm`); elsewhere, or where
    those fail, one packed_linear per chosen expert."""
    family = grouped_fused(x, p, n_expert)
    if family is not None:
        from dsq.kernels import triton_gemm, triton_mma

        fn = triton_mma.grouped_mma_scaled if family == _TENSOR_CORES else triton_gemm.grouped_linear
        y = _guarded(family, fn, x, p, counts, n_expert)
        if y is not None:
            return y
    if isinstance(counts, torch.Tensor):
        counts = counts.tolist()  # the other paths need them on the host
    gpu = x.device.type == "cuda" and not torch.compiler.is_compiling() and not _reference() and _triton_ok()
    if gpu and hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16:  # CUDA's grouped GEMM: bf16
        from dsq.kernels import triton_common

        # the grouped GEMM's rows of x and of W in whole 16-byte vectors (CUTLASS's alignment)
        if triton_common.tiles_ok(p) and not (p.K * x.element_size()) % 16 and not (p.N // n_expert) % 8:
            y = _guarded("grouped experts", grouped_gemm, x, p, counts, n_expert, slab_bytes)
            if y is not None:
                return y
    N = p.N // n_expert
    y = torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
    r = 0
    for e, c in enumerate(counts):
        if c:
            y[r:r + c] = packed_linear(x[r:r + c], p.rows(e * N, (e + 1) * N))
        r += c
    return y


def grouped_gemm(x: torch.Tensor, p: packed.Packed, counts: list[int], n_expert: int,
                 slab_bytes: int | None = None, dequantize=None) -> torch.Tensor:
    """grouped_experts' GPU path (any device with the Triton kernels, the interpreter included):
    runs of consecutive chosen experts whose weights in x's dtype fit `slab_bytes`
    (triton_dequant.SLAB_BYTES), each written out by one `dequantize` (triton_dequant.dequantize)
    into one buffer and multiplied with its rows by one torch._grouped_mm (offsets on the device,
    no host sync)."""
    from dsq.kernels import triton_dequant

    dequantize = dequantize or triton_dequant.dequantize
    N, K = p.N // n_expert, p.K
    per = N * K * x.element_size()
    group = max(1, (slab_bytes or triton_dequant.SLAB_BYTES) // per)
    runs, e = [], 0  # (first expert, last + 1) of each slab, empty experts at its ends left out
    while e < n_expert:
        if not counts[e]:
            e += 1
            continue
        end = min(n_expert, e + group)
        while not counts[end - 1]:
            end -= 1
        runs.append((e, end))
        e = end
    y = torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
    if not runs:
        return y
    buf = torch.empty(max(b - a for a, b in runs) * N, K, dtype=x.dtype, device=x.device)
    starts = list(accumulate(counts, initial=0))  # expert e's rows: starts[e]..starts[e + 1] - 1
    for a, b in runs:
        w = dequantize(p.rows(a * N, b * N), x.dtype, out=buf[:(b - a) * N])
        ends = torch.tensor([starts[e + 1] - starts[a] for e in range(a, b)], dtype=torch.int32)
        r0, r1 = starts[a], starts[b]
        y[r0:r1] = torch._grouped_mm(x[r0:r1], w.view(b - a, N, K).transpose(1, 2),
                                     offs=ends.to(x.device, non_blocking=True))
    return y


def _triton_linear(kind: str, x: torch.Tensor, p: packed.Packed, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The Triton kernel family `kind` (gpu_kernel's answer), or None when the float-x kernels do
    not take this weight (the caller then runs the reference)."""
    if kind in ("mma", "mma_scaled"):
        from dsq.kernels import triton_mma

        return (triton_mma.mma_linear if kind == "mma" else triton_mma.mma_linear_scaled)(x, p, bias)
    from dsq.kernels import triton_common, triton_dequant, triton_gemm, triton_gemv_q8

    if kind in ("q8", "q8_rows"):
        return (triton_gemv_q8.q8_linear if kind == "q8" else triton_gemv_q8.q8_rows_linear)(x, p, bias)
    if not triton_common.supported(p, x):
        return None
    return (triton_dequant.dequant_linear if kind == "dequant" else triton_gemm.packed_linear)(x, p, bias)


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
    if mma_rows and triton_mma.supported_scaled(p, rows):  # after int8 x, the faster up to 4 rows
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
