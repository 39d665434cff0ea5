"""Quantized modules. The loader builds the checkpoint's modules (GGUFLinear, AWQLinear, GPTQLinear,
FP8Linear: tensors exactly as on disk), places them (`to_device`: GGUF blocks bound for a GPU are
converted on the way, from the CPU), then `prepare_kernels` turns each into what its device's
kernels read: on a GPU one `PackedLinear` (kernels/packed.py, Triton) for every
format; on the CPU GGUF blocks and FP8 stay as they are and AWQ/GPTQ become `IntLinear` (dsq's
internal int layout, C kernels). Every op goes through `dsq.kernels.dispatch`."""

from __future__ import annotations

import torch
from torch import nn

from dsq.kernels import dispatch, intq_ref, packed
from dsq.kernels.gguf_ref import row_bytes


class GGUFLinear(nn.Module):
    """y = x W^T + b with W kept as GGUF blocks: raw uint8 (out_features, row_bytes)."""

    def __init__(self, qtype: str, in_features: int, out_features: int, bias: bool = False,
                 device=None, dtype=torch.float32):
        super().__init__()
        self.qtype, self.in_features, self.out_features = qtype, in_features, out_features
        self.register_buffer("raw", torch.empty(out_features, row_bytes(qtype, in_features), dtype=torch.uint8,
                                                device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.gguf_linear(x, self.raw, self.qtype, self.in_features, self.bias)

    def kernel_module(self, device: torch.device | None = None) -> nn.Module:
        """The module its kernels read on `device` (default: where the blocks are): on a GPU the
        PackedLinear, converted there from wherever the blocks are (packed.from_gguf)."""
        dev = self.raw.device if device is None else torch.device(device)
        if not dispatch.use_triton(dev):
            return self
        bias = self.bias
        if bias is not None and bias.device != dev:
            bias = nn.Parameter(bias.to(dev), requires_grad=False)
        return PackedLinear(packed.from_gguf(self.raw, self.qtype, self.in_features, device=dev), bias, self.qtype)

    @staticmethod
    def fuse_rows(mods) -> GGUFLinear | None:
        """One GGUFLinear for several of one quant type, input width and device (q/k/v, gate/up):
        GGUF rows are independent blocks, so stacking the raw rows stacks the outputs (one C
        kernel call instead of several in the CPU decode step). None when they differ."""
        m0 = mods[0]
        if not all(type(m) is GGUFLinear and m.qtype == m0.qtype and m.in_features == m0.in_features
                   and m.raw.device == m0.raw.device and (m.bias is None) == (m0.bias is None) for m in mods):
            return None
        raw = torch.cat([m.raw for m in mods])
        fused = GGUFLinear(m0.qtype, m0.in_features, raw.shape[0], bias=False, device="meta")
        fused.raw = raw
        if m0.bias is not None:
            fused.bias = nn.Parameter(torch.cat([m.bias for m in mods]), requires_grad=False)
        return fused

    def extra_repr(self) -> str:
        return f"{self.qtype}, in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"

    def rows(self, start: int, stop: int) -> GGUFLinear:
        """Rows start..stop as a module of their own (a copy: this one's blocks can then be freed)."""
        part = GGUFLinear(self.qtype, self.in_features, stop - start, bias=False, device="meta")
        part.raw = self.raw[start:stop].clone()
        if self.bias is not None:
            part.bias = nn.Parameter(self.bias[start:stop].clone(), requires_grad=False)
        return part


class GGUFEmbedding(nn.Module):
    """Embedding rows kept as GGUF blocks; looked-up rows are dequantized."""

    def __init__(self, qtype: str, num_embeddings: int, dim: int, device=None, dtype=torch.float32):
        super().__init__()
        self.qtype, self.num_embeddings, self.dim, self.out_dtype = qtype, num_embeddings, dim, dtype
        self.register_buffer("raw", torch.empty(num_embeddings, row_bytes(qtype, dim), dtype=torch.uint8,
                                                device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dispatch.gguf_embedding(ids, self.raw, self.qtype, self.dim, self.out_dtype)

    def extra_repr(self) -> str:
        return f"{self.qtype}, {self.num_embeddings}x{self.dim}"


class _DequantLinear(nn.Module):
    """A Linear stored in a checkpoint's quantized format, dequantized by the reference path.
    Subclasses define `weight_float()`: the (N, K) float32 weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight_float().to(x.dtype), self.bias)


class AWQLinear(_DequantLinear):
    """AutoAWQ GEMM: qweight (K, N/8), qzeros (K/g, N/8), scales (K/g, N)."""

    def __init__(self, in_features, out_features, bias, group: int, dtype=torch.float32):
        super().__init__(in_features, out_features, bias, dtype)
        g = in_features if group == -1 else group
        self.group = group
        self.register_buffer("qweight", torch.empty(in_features, out_features // 8, dtype=torch.int32))
        self.register_buffer("qzeros", torch.empty(in_features // g, out_features // 8, dtype=torch.int32))
        self.register_buffer("scales", torch.empty(in_features // g, out_features, dtype=torch.float16))

    def weight_float(self):
        from dsq.formats.awq_gptq import awq_dequantize

        return awq_dequantize(self.qweight, self.qzeros, self.scales, self.group)

    def kernel_module(self) -> nn.Module:
        return IntLinear.build(intq_ref.from_awq(self.qweight, self.qzeros, self.scales, self.group), 4, self.bias,
                               "awq int4")


class GPTQLinear(_DequantLinear):
    """GPTQ: qweight (K*b/32, N), qzeros (G, N*b/32), scales (G, N), g_idx (K,)."""

    def __init__(self, in_features, out_features, bias, bits: int, group: int, v1: bool, dtype=torch.float32):
        super().__init__(in_features, out_features, bias, dtype)
        g = in_features if group == -1 else group
        G = -(-in_features // g)
        self.bits, self.v1 = bits, v1
        self.register_buffer("qweight", torch.empty(in_features * bits // 32, out_features, dtype=torch.int32))
        self.register_buffer("qzeros", torch.empty(G, out_features * bits // 32, dtype=torch.int32))
        self.register_buffer("scales", torch.empty(G, out_features, dtype=torch.float16))
        self.register_buffer("g_idx", torch.empty(in_features, dtype=torch.int32))

    def weight_float(self):
        from dsq.formats.awq_gptq import gptq_dequantize

        return gptq_dequantize(self.qweight, self.qzeros, self.scales, self.g_idx, self.bits, self.v1)

    def kernel_module(self) -> nn.Module:
        d = intq_ref.from_gptq(self.qweight, self.qzeros, self.scales, self.g_idx, self.bits, self.v1)
        return IntLinear.build(d, self.bits, self.bias, f"gptq int{self.bits}")


class FP8Linear(_DequantLinear):
    """FP8 e4m3 weight (N, K) with a channel, tensor or 128x128-block scale."""

    def __init__(self, in_features, out_features, bias, scale_shape: tuple, scale_name: str, dtype=torch.float32):
        super().__init__(in_features, out_features, bias, dtype)
        self.scale_name = scale_name
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer(scale_name, torch.empty(scale_shape, dtype=torch.float32))

    def weight_float(self):
        from dsq.formats.fp8_checkpoint import fp8_dequantize

        return fp8_dequantize(self.weight, getattr(self, self.scale_name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.fp8_linear(x, self.weight, getattr(self, self.scale_name), self.bias)

    def kernel_module(self) -> nn.Module:
        if dispatch.use_triton(self.weight.device) and self.in_features % 2 == 0:
            return PackedLinear(packed.from_fp8(self.weight, getattr(self, self.scale_name)), self.bias, "fp8")
        return self


class IntLinear(nn.Module):
    """dsq's internal int4/int8 layout (kernels/intq_ref.py) for the CPU kernels."""

    def __init__(self, d: dict[str, torch.Tensor], bits: int, bias: nn.Parameter | None, source: str):
        super().__init__()
        self.bits, self.source = bits, source
        self.out_features, self.in_features = d["qweight"].shape[0], d["qweight"].shape[1] * 8 // bits
        for k in ("qweight", "scales", "zeros", "perm"):
            self.register_buffer(k, d.get(k))
        self.bias = bias

    @staticmethod
    def build(d: dict[str, torch.Tensor], bits: int, bias, source: str) -> nn.Module:
        """IntLinear, or on a GPU the PackedLinear that shares its tensors."""
        if dispatch.use_triton(d["qweight"].device):
            p = packed.from_int(d["qweight"], d["scales"], d["zeros"], bits, d.get("perm"))
            return PackedLinear(p, bias, source)
        return IntLinear(d, bits, bias, source)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.int_linear(x, self.qweight, self.scales, self.zeros, self.bits, self.perm, self.bias)

    def kernel_module(self) -> nn.Module:
        """On a GPU (a CPU layer's weights streamed there) the PackedLinear sharing its tensors."""
        if not dispatch.use_triton(self.qweight.device):
            return self
        d = {"qweight": self.qweight, "scales": self.scales, "zeros": self.zeros, "perm": self.perm}
        return IntLinear.build(d, self.bits, self.bias, self.source)

    def weight_float(self) -> torch.Tensor:
        """float32 (N, K) in the checkpoint's channel order."""
        return _unpermute(intq_ref.dequantize(self.qweight, self.scales, self.zeros, self.bits), self.perm)

    def extra_repr(self) -> str:
        return f"{self.source}, in={self.in_features}, out={self.out_features}"


class PackedLinear(nn.Module):
    """Any quantized weight in the GPU layout (kernels/packed.py), run by the Triton kernels."""

    PLANES = ("lo", "sc", "hi", "d", "zp", "mn", "dmin", "perm")

    def __init__(self, p: packed.Packed, bias: nn.Parameter | None, source: str):
        super().__init__()
        self.fmt, self.in_features, self.out_features, self.source = p.fmt, p.K, p.N, source
        for k in self.PLANES:
            self.register_buffer(k, getattr(p, k))
        self.bias = bias

    @property
    def packed(self) -> packed.Packed:
        return packed.Packed(self.fmt, self.out_features, self.in_features,
                             **{k: getattr(self, k) for k in self.PLANES})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.packed_linear(x, self.packed, self.bias)

    def weight_float(self) -> torch.Tensor:
        return _unpermute(packed.dequantize(self.packed), self.perm)

    @staticmethod
    def fuse_rows(mods) -> PackedLinear | None:
        """One PackedLinear for several of the same format and input (q/k/v, gate/up), or None."""
        if not all(isinstance(m, PackedLinear) for m in mods) or len({m.bias is None for m in mods}) != 1:
            return None
        try:
            p = packed.Packed.cat([m.packed for m in mods])
        except ValueError:
            return None
        bias = None if mods[0].bias is None else nn.Parameter(torch.cat([m.bias for m in mods]),
                                                               requires_grad=False)
        return PackedLinear(p, bias, mods[0].source)

    def extra_repr(self) -> str:
        return f"{self.source}, in={self.in_features}, out={self.out_features}"


class RowSplitLinear(nn.Module):
    """An output head split by rows between a GPU and the CPU (--head 0.6 at a split): the first
    rows in VRAM, run by the GPU's kernels, the rest in RAM, run by the C kernels, the outputs
    joined in RAM, where sampling reads them. A split's captured decode step runs the GPU rows in
    its graph and only the CPU rows after it (runtime/native.py _SplitStep); this forward serves
    every other call (prompts, eager steps)."""

    out_device = torch.device("cpu")  # where its output is (models.base.module_device)

    def __init__(self, gpu_rows: nn.Module, cpu_rows: nn.Module, gpu: torch.device, gpu_dtype: torch.dtype):
        super().__init__()
        self.gpu_rows, self.cpu_rows, self.gpu, self.gpu_dtype = gpu_rows, cpu_rows, gpu, gpu_dtype
        w = next(iter(cpu_rows.parameters()), None)  # what the CPU rows read: a float head's dtype, else float32
        self.cpu_dtype = w.dtype if w is not None and w.is_floating_point() else torch.float32
        self.in_features = cpu_rows.in_features
        self.out_features = gpu_rows.out_features + cpu_rows.out_features

    @classmethod
    def split(cls, head: nn.Module, share: float, gpu: torch.device, gpu_dtype: torch.dtype) -> RowSplitLinear:
        """`head` (GGUF blocks or a float weight, in RAM) with `share` of its rows moved to `gpu`;
        the count is rounded to 128 rows (a GEMV tile) and keeps at least one row on each side."""
        n = head.out_features
        k = min(n - 1, max(1, round(share * n / 128) * 128))
        if isinstance(head, GGUFLinear):
            top, rest = head.rows(0, k), head.rows(k, n)
        elif type(head) is nn.Linear:
            top, rest = _linear_rows(head, 0, k).to(gpu_dtype), _linear_rows(head, k, n)
        else:
            from dsq.errors import DsqError

            raise DsqError(f"--head with a share of rows takes a GGUF or 16-bit head, not {type(head).__name__}",
                           "pass --head gpu or --head cpu")
        return cls(to_device(top, gpu).to(gpu), rest, gpu, gpu_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top = self.gpu_rows(x.to(self.gpu, self.gpu_dtype))
        return self.join(x, top.cpu())

    def join(self, x: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        """The whole output from x (any device) and the GPU rows' output `top`, already in RAM."""
        rest = self.cpu_rows(x.to("cpu", self.cpu_dtype))
        return torch.cat([top.to(rest.dtype), rest], -1)

    def extra_repr(self) -> str:
        return f"gpu rows={self.gpu_rows.out_features}, cpu rows={self.cpu_rows.out_features}"


def _linear_rows(m: nn.Linear, start: int, stop: int) -> nn.Linear:
    part = nn.Linear(m.in_features, stop - start, bias=m.bias is not None, device="meta")
    part.weight = nn.Parameter(m.weight[start:stop].clone(), requires_grad=False)
    if m.bias is not None:
        part.bias = nn.Parameter(m.bias[start:stop].clone(), requires_grad=False)
    return part


def _unpermute(w: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    return w if perm is None else w[:, torch.argsort(perm)]


def to_device(module: nn.Module, device: torch.device) -> nn.Module:
    """module moved to `device` (returned: the module itself may be replaced). Where that device's
    kernels are Triton's, each GGUF block module still on the CPU becomes its PackedLinear straight
    from there, a chunk of rows at a time (packed.from_gguf): the GPU never holds a module's file
    blocks beside its kernel layout, nor the conversion's transient of a whole module (an 8B
    Q4_K_M GGUF's load peaked ~1.4 GB above what it kept, docs/benchmarks.md#split-between-gpu-and-cpu)."""
    if dispatch.use_triton(device):
        for name in [n for n, m in module.named_modules() if isinstance(m, GGUFLinear) and m.raw.device.type == "cpu"]:
            new = module.get_submodule(name).kernel_module(device)
            if not name:
                return new
            set_module(module, name, new)
            del new
    return module.to(device)


def prepare_kernels(model: nn.Module) -> int:
    """Replace each quantized module by the one its device's kernels read (after placement).
    Returns how many were replaced. Holds no module beyond its turn, so each one's source weights
    are freed as soon as it is replaced: on a GPU the file's blocks and the kernels' layout then
    never both fill memory (an 8B Q4_K_M GGUF peaked at 10.9 GB of VRAM holding both, 4.9 each)."""
    n = 0
    for name in [name for name, m in model.named_modules() if hasattr(m, "kernel_module")]:
        m = model.get_submodule(name)
        new = m.kernel_module()
        if new is not m:
            set_module(model, name, new)
            n += 1
    return n


def set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)
