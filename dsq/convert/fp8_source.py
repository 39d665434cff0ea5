"""FP8 checkpoints read as float, one tensor or one block at a time.

DeepSeek publishes V3 / R1 with every Linear weight in float8_e4m3fn and a float32
`weight_scale_inv` per 128x128 block beside it (compressed-tensors FP8 names it `weight_scale`).
What converts or quantizes such a checkpoint onward reads it through here: the scale tensors are
hidden and each FP8 weight is dequantized when it is read, into the checkpoint's own float dtype
(bf16 for DeepSeek), so a float copy of the whole model is never made.

- `dequantize_tensors`: a name -> tensor mapping (one decoder block's, as the quantization driver
  reads it) with its FP8 weights dequantized and its scales dropped.
- `float_view`: an HF directory as the GGUF converter reads it (tensor names, shapes, one tensor
  at a time), dequantized where it is FP8; the directory itself when it has no FP8 weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from dsq.formats.hf import HFModelDir

SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")


def is_scale(name: str) -> bool:
    return name.endswith(SCALE_SUFFIXES)


def is_fp8(t) -> bool:
    import torch

    return getattr(t, "dtype", None) in (torch.float8_e4m3fn, torch.float8_e5m2)


def float_dtype(cfg: dict) -> "torch.dtype":
    """The checkpoint's float dtype (config torch_dtype / dtype), which dequantized weights take."""
    import torch

    name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.bfloat16


def dequantize(name: str, weight: "torch.Tensor", scale: "torch.Tensor", dtype: "torch.dtype") -> "torch.Tensor":
    """One FP8 weight as float `dtype` (the one place a checkpoint's FP8 weights become float)."""
    from dsq.formats.fp8_checkpoint import fp8_dequantize

    return fp8_dequantize(weight, scale).to(dtype)


def _scale_of(name: str, has) -> str | None:
    base = name[: -len(".weight")] if name.endswith(".weight") else None
    if base is None:
        return None
    return next((base + s for s in SCALE_SUFFIXES if has(base + s)), None)


def dequantize_tensors(tensors: dict[str, Any], dtype: "torch.dtype") -> dict[str, Any]:
    """`tensors` with each FP8 weight that has a scale beside it dequantized to `dtype`, and the
    scales left out; everything else as given."""
    out = {}
    for name, t in tensors.items():
        if is_scale(name):
            continue
        scale = _scale_of(name, tensors.__contains__) if is_fp8(t) else None
        out[name] = dequantize(name, t, tensors[scale], dtype) if scale else t
    return out


class FloatView:
    """An HF directory with FP8 weights, read as float one tensor at a time (what the GGUF
    converter asks of an HFModelDir: names, shapes, tensors, config, tokenizer files)."""

    def __init__(self, hf: "HFModelDir"):
        self.hf = hf
        self.dtype = float_dtype(hf.config)
        self.config = {k: v for k, v in hf.config.items() if k != "quantization_config"}

    def __getattr__(self, name: str):
        return getattr(self.hf, name)

    def tensor_names(self) -> list[str]:
        return [n for n in self.hf.tensor_names() if not is_scale(n)]

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self.hf.tensor_shape(name)

    def get_tensor(self, name: str):
        t = self.hf.get_tensor(name)
        scale = _scale_of(name, self.hf.weight_map.__contains__) if is_fp8(t) else None
        return dequantize(name, t, self.hf.get_tensor(scale), self.dtype) if scale else t


def has_fp8_weights(hf: "HFModelDir") -> bool:
    return any(is_scale(n) for n in hf.tensor_names())


def float_view(hf: "HFModelDir"):
    """`hf` as float: a FloatView when it holds FP8 weights with scales, else `hf` itself."""
    return FloatView(hf) if has_fp8_weights(hf) else hf
