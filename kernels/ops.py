"""The C CPU kernels as torch operators (`torch.ops.dsq.*`), so `torch.compile` can trace a model
through them: dynamo cannot see into a ctypes call, but it keeps an operator with a fake (shape
only) implementation in the graph, and inductor fuses the small ops around it.

The GPU layout's kernels (Triton, kernels/triton_*.py) are one more operator,
`dsq::packed_linear`, for the same reason: a compiled GPU decode step keeps each quantized matmul
as one opaque call and fuses everything between them.

Eager code calls `dsq.kernels.cpu` directly (the dispatcher's path costs a few microseconds per
call); the dispatcher routes here only while compiling. The operators are defined with a plain
`torch.library.Library` rather than `torch.library.custom_op`: the compiled graph calls them on
every step, and the lighter registration is ~2 us a call against ~5-10 us.
"""

from __future__ import annotations

import dataclasses

import torch

from dsq.kernels import cpu, dispatch
from dsq.kernels.packed import Fmt, Packed


@torch.compiler.assume_constant_result
def available() -> bool:
    """dispatch's answer to "do CPU tensors go to the C kernels?", a constant to torch.compile
    (which would otherwise trace the library lookup). Decided once per graph."""
    return dispatch._cpu_kernels()


_lib = torch.library.Library("dsq", "DEF")
_lib.define("gguf_linear(Tensor x, Tensor raw, str qtype, int in_features, Tensor? bias=None) -> Tensor")
_lib.define("gguf_rows(Tensor ids, Tensor raw, str qtype, int dim) -> Tensor")
_lib.define("int_linear(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, int bits, Tensor? perm=None, "
            "Tensor? bias=None) -> Tensor")
_lib.define("fp8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias=None) -> Tensor")
# the GPU layout (kernels/packed.py): fmt = Fmt's fields as ints, in order
_lib.define("packed_linear(Tensor x, Tensor lo, Tensor sc, Tensor? hi, Tensor? d, Tensor? zp, Tensor? mn, "
            "Tensor? dmin, Tensor? perm, Tensor? bias, int[] fmt, int N, int K) -> Tensor")
_lib.define("packed_experts(Tensor x, Tensor ids, Tensor lo, Tensor sc, Tensor? hi, Tensor? d, Tensor? zp, "
            "Tensor? mn, Tensor? dmin, int[] fmt, int N, int K, int n_expert) -> Tensor")

# the GPU decode attention (kernels/triton_attn.py)
_lib.define("attn_decode(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor")

# the kernels as they are (each returns a new tensor of x's dtype)
_lib.impl("gguf_linear", cpu.gguf_linear, "CPU")
_lib.impl("gguf_rows", cpu.gguf_rows, "CPU")
_lib.impl("int_linear", cpu.int_linear, "CPU")
_lib.impl("fp8_linear", cpu.fp8_linear, "CPU")


# the operator carries Fmt as its fields' values in order, as ints; these turn them back (int or bool)
_FMT_FIELDS = tuple(k.name for k in dataclasses.fields(Fmt))
_FMT_KINDS = [type(getattr(Fmt(), k)) for k in _FMT_FIELDS]


def _packed_linear(x, lo, sc, hi, d, zp, mn, dmin, perm, bias, fmt, N, K):
    """The Triton kernels on a GPU, the torch reference elsewhere (dispatch.packed_linear)."""
    p = Packed(Fmt(*(kind(v) for kind, v in zip(_FMT_KINDS, fmt))), N, K, lo, sc, hi=hi, d=d, zp=zp, mn=mn,
               dmin=dmin, perm=perm)
    return dispatch.packed_linear(x, p, bias)


_lib.impl("packed_linear", _packed_linear, "CPU")
_lib.impl("packed_linear", _packed_linear, "CUDA")


def _packed_experts(x, ids, lo, sc, hi, d, zp, mn, dmin, fmt, N, K, n_expert):
    """dispatch.packed_experts (the grouped GEMV over MoE pairs)."""
    p = Packed(Fmt(*(kind(v) for kind, v in zip(_FMT_KINDS, fmt))), N, K, lo, sc, hi=hi, d=d, zp=zp, mn=mn,
               dmin=dmin)
    return dispatch.packed_experts(x, p, ids, n_expert)


_lib.impl("packed_experts", _packed_experts, "CPU")
_lib.impl("packed_experts", _packed_experts, "CUDA")


def _attn_decode_cuda(q, k, v, mask, scale):
    from dsq.kernels import triton_attn

    return triton_attn.attn_decode(q, k, v, mask, scale)


def _attn_decode_cpu(q, k, v, mask, scale):
    from dsq.kernels import triton_attn

    return triton_attn.attn_decode_ref(q, k, v, mask, scale).to(q.dtype)


_lib.impl("attn_decode", _attn_decode_cuda, "CUDA")
_lib.impl("attn_decode", _attn_decode_cpu, "CPU")


def packed_linear_op(x, p, bias=None):
    """dispatch.packed_linear as one operator call that torch.compile keeps opaque in its graph (it
    cannot trace the Triton launcher and its autotuner), fusing the small ops around it."""
    fmt = [int(getattr(p.fmt, k)) for k in _FMT_FIELDS]
    return torch.ops.dsq.packed_linear.default(x, p.lo, p.sc, p.hi, p.d, p.zp, p.mn, p.dmin, p.perm, bias, fmt,
                                               p.N, p.K)


def packed_experts_op(x, p, ids, n_expert):
    """dispatch.packed_experts as one operator call (as packed_linear_op)."""
    fmt = [int(getattr(p.fmt, k)) for k in _FMT_FIELDS]
    return torch.ops.dsq.packed_experts.default(x, ids, p.lo, p.sc, p.hi, p.d, p.zp, p.mn, p.dmin, fmt, p.N, p.K,
                                                n_expert)


# shapes only: N output features = the weight's rows
@torch.library.register_fake("dsq::gguf_linear", lib=_lib)
def _gguf_linear_fake(x, raw, qtype, in_features, bias=None):
    return x.new_empty(*x.shape[:-1], raw.shape[0])


@torch.library.register_fake("dsq::gguf_rows", lib=_lib)
def _gguf_rows_fake(ids, raw, qtype, dim):
    return ids.new_empty(*ids.shape, dim, dtype=torch.float32)


@torch.library.register_fake("dsq::int_linear", lib=_lib)
def _int_linear_fake(x, qweight, scales, zeros, bits, perm=None, bias=None):
    return x.new_empty(*x.shape[:-1], qweight.shape[0])


@torch.library.register_fake("dsq::fp8_linear", lib=_lib)
def _fp8_linear_fake(x, weight, scale, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.register_fake("dsq::attn_decode", lib=_lib)
def _attn_decode_fake(q, k, v, mask, scale):
    return q.new_empty(q.shape[0], 1, q.shape[1] * q.shape[3])


@torch.library.register_fake("dsq::packed_linear", lib=_lib)
def _packed_linear_fake(x, lo, sc, hi, d, zp, mn, dmin, perm, bias, fmt, N, K):
    return x.new_empty(*x.shape[:-1], N)


@torch.library.register_fake("dsq::packed_experts", lib=_lib)
def _packed_experts_fake(x, ids, lo, sc, hi, d, zp, mn, dmin, fmt, N, K, n_expert):
    return x.new_empty(ids.numel(), N // n_expert)


gguf_linear = torch.ops.dsq.gguf_linear.default
gguf_rows = torch.ops.dsq.gguf_rows.default
int_linear = torch.ops.dsq.int_linear.default
fp8_linear = torch.ops.dsq.fp8_linear.default
attn_decode = torch.ops.dsq.attn_decode.default
