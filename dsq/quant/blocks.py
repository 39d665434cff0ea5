"""One decoder block in memory at a time: read its weights, run calibration activations through
it, and watch what its Linears see. Shared by the driver, the methods and the importance matrix."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from dsq.errors import DsqError

# What each Linear reads, by its own name: Linears of one module reading the same input form one
# group (q/k/v; DeepSeek's q_a + kv_a; an expert's gate/up), and the inputs come in the order a
# block computes them, so a stage's inputs are those of a block whose earlier stages are quantized.
INPUT_OF = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "q_a_proj": "attn_in",
            "kv_a_proj_with_mqa": "attn_in", "q_b_proj": "q_latent", "kv_b_proj": "kv_latent",
            "o_proj": "attn_out", "gate_proj": "mlp_in", "up_proj": "mlp_in", "down_proj": "mlp_mid"}
STAGES = (("attn_in",), ("q_latent", "kv_latent"), ("attn_out",), ("mlp_in",), ("mlp_mid",), ("other",))
PHASES: dict[str, float] = {}  # seconds per phase of the last runs (calibration forwards, solves, ...)


class phase:
    """Adds the seconds its body takes (GPU work included) to PHASES[name]."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.t = time.perf_counter()

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        PHASES[self.name] = PHASES.get(self.name, 0.0) + time.perf_counter() - self.t


def device_for(device: str) -> torch.device:
    """"auto": the GPU when there is one."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def default_dtype(dev: torch.device) -> torch.dtype:
    """Blocks compute in float32 on a CPU and in bfloat16 on a GPU."""
    return torch.float32 if dev.type == "cpu" else torch.bfloat16


def meta_model(mod, args) -> nn.Module:
    """The model with no weights: blocks are materialized one at a time."""
    with torch.device("meta"):
        return mod.Model(args)


def embed_calibration(hf, args, ids: torch.Tensor) -> torch.Tensor:
    """The activations entering block 0 for calibration token ids (n, T) -> (n, T, H) float32."""
    emb = hf.get_tensor("model.embed_tokens.weight").float()
    hidden = emb[ids]
    if args.embed_scale:
        hidden = hidden * float(torch.tensor(args.embed_scale, dtype=emb.dtype))
    return hidden


def block_tensors(hf, i: int) -> dict[str, torch.Tensor]:
    """Block i's tensors by name inside the block, memory-mapped; an FP8 checkpoint's weights
    (DeepSeek's weight_scale_inv) dequantized to its float dtype, this block's only."""
    from dsq.convert.fp8_source import dequantize_tensors, float_dtype

    prefix = f"model.layers.{i}."
    raw = {n: t for n, t in hf.mmap_tensors().items() if n.startswith(prefix)}
    return {n[len(prefix):]: t for n, t in dequantize_tensors(raw, float_dtype(hf.config)).items()}


def materialize(layer: nn.Module, tensors: dict[str, torch.Tensor], device, dtype) -> None:
    """The block's weights in `dtype` on `device` (bf16 on a GPU, not float32), copied in one
    tensor at a time."""
    layer.to_empty(device=device).to(dtype)
    state = layer.state_dict(keep_vars=True)
    names = {k for k in tensors if not k.endswith("inv_freq")}
    missing, unexpected = sorted(set(state) - names), sorted(names - set(state))
    if missing or unexpected:
        raise DsqError(f"block weights do not match the config (missing {missing[:2]}, unexpected {unexpected[:2]})")
    with torch.no_grad():
        for k in names:
            state[k].copy_(tensors[k].to(dtype))


def linears(layer: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}


def input_stages(names) -> list[list[list[str]]]:
    """The Linears `names` (inside a block, in module order) as stages of groups, each group the
    Linears of one module that read one input (see INPUT_OF)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for n in names:
        parent, _, leaf = n.rpartition(".")
        kind = INPUT_OF.get(leaf, "other")
        groups.setdefault((kind, parent if kind != "other" else n), []).append(n)
    stages = [[g for (kind, _), g in groups.items() if kind in stage] for stage in STAGES]
    return [s for s in stages if s]


def input_groups(names) -> list[list[str]]:
    """`input_stages` flattened, in stage order."""
    return [g for stage in input_stages(names) for g in stage]


@contextmanager
def plain_attention(layer: nn.Module):
    """DeepSeek's latent attention on its plain path (kv_b_proj called as a Linear, so hooks see
    its inputs); the same outputs as the absorbed path."""
    mods = [(m, m.absorb) for m in layer.modules() if hasattr(m, "absorb")]
    for m, _ in mods:
        m.absorb = False
    try:
        yield
    finally:
        for m, was in mods:
            m.absorb = was


def home(hidden: torch.Tensor, dev: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Where the calibration activations live: on the GPU (in the compute dtype, so nothing is
    lost) when they fit comfortably, else in CPU memory (then every pass copies them over)."""
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        if hidden.numel() * torch.finfo(dtype).bits // 8 < 0.3 * free:
            return hidden.to(dev, dtype)
    return hidden.cpu()


def run_block(layer, hidden: torch.Tensor, ctx, device, dtype, batch: int) -> torch.Tensor:
    """hidden (n, T, H) -> the block's outputs (n, T, H), where and as `hidden` is stored."""
    from dsq.models.base import PassThroughCache

    cos, sin, mask, slots = ctx
    out = torch.empty_like(hidden)
    cache = PassThroughCache()
    with torch.no_grad():
        for b in range(0, hidden.shape[0], batch):
            x = hidden[b:b + batch].to(device=device, dtype=dtype)
            out[b:b + batch] = layer(x, cos, sin, mask, cache, slots, None).to(out.device, out.dtype)
    return out


@dataclass
class Block:
    """One materialized decoder block, as a method quantizes it."""

    layer: nn.Module
    linears: dict[str, nn.Linear]  # the Linears to quantize, by name inside the block (skipped ones left out)
    hidden: torch.Tensor | None  # the calibration activations entering the block
    ctx: Any  # the block's rotary tables, mask and cache slots
    device: torch.device
    dtype: torch.dtype
    batch: int
    routing: dict[int, int] = field(default_factory=dict)  # routed expert -> calibration tokens it saw
    fallback: set[int] = field(default_factory=set)  # experts quantized by RTN for want of tokens

    def run(self) -> torch.Tensor:
        """The block's outputs on the calibration activations (each MoE layer's router choosing
        the experts every token goes through)."""
        with plain_attention(self.layer):
            return run_block(self.layer, self.hidden, self.ctx, self.device, self.dtype, self.batch)


class Capture:
    """Forward pre-hooks on Linears: each Linear's inputs, as rows (m, K), go to the `add` of its
    accumulator, made by `make(linear)`. A context manager: the hooks go on exit."""

    def __init__(self, mods: dict[str, nn.Linear], make: Callable[[nn.Linear], Any]):
        self.data: dict[str, Any] = {}
        self.handles = []
        for name, m in mods.items():
            self.data[name] = make(m)
            self.handles.append(m.register_forward_pre_hook(self._hook(self.data[name])))

    @staticmethod
    def _hook(acc):
        def hook(module, args):
            acc.add(args[0].reshape(-1, args[0].shape[-1]))
        return hook

    def __enter__(self) -> "Capture":
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
