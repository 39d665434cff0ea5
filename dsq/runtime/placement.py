"""Placement plan: which layers go to the GPU for a memory budget, and what decode speed to expect.

Bytes per layer come from the file itself (each tensor at its actual quant type), KV cache from
the context length (sliding-window layers hold only their window), plus compute buffers. The
plan uses llama.cpp's `--gpu-layers` semantics: the last N repeating layers go to the GPU, and
N = n_layer + 1 also moves the output head. Decode speed is a bandwidth model: every weight byte
is read once per token, GPU bytes at GPU bandwidth and CPU bytes at CPU bandwidth.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dsq.errors import DsqError
from dsq.runtime.gpu_layers import GpuLayers

GiB, MiB = 1 << 30, 1 << 20
# Achieved fraction of bandwidth in llama.cpp batch-1 decode, calibrated on measurements
# (docs/anchors: H200 Q4_K_M 8B 293.5 tok/s of a 920 roofline; its 16-core host 13.2 tok/s at
# ~66%); with these the model reproduces the measured --gpu-layers 8/16 sweep within 2%.
GPU_EFFICIENCY = 0.32
CPU_EFFICIENCY = 0.66
GPU_RESERVE = 512 * MiB  # CUDA context, cuBLAS workspace, fragmentation
_KNOWN_GPU_BW = {"H200": 4.25e12, "H100": 3.0e12, "A100": 1.8e12, "L40S": 0.78e12, "4090": 0.9e12,
                 "3090": 0.85e12, "A10": 0.54e12, "L4": 0.27e12, "T4": 0.28e12}


def parse_size(text: str | int | float | None) -> int | None:
    """'24G', '24GB', '24GiB', '512M', '1.5T' -> bytes (binary units). Plain numbers are GiB."""
    if text is None:
        return None
    if isinstance(text, (int, float)):
        return int(text * GiB)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", str(text))
    if not m:
        raise DsqError(f"cannot read the size {text!r}", "write it like 24G, 512M or 1.5T")
    num, unit = float(m.group(1)), m.group(2).upper()
    mult = {"": GiB, "K": 1 << 10, "M": MiB, "G": GiB, "T": 1 << 40}[unit]
    return int(num * mult)


@dataclass
class GpuInfo:
    name: str
    total_bytes: int
    free_bytes: int


def detect_gpu() -> GpuInfo | None:
    """The first NVIDIA GPU via nvidia-smi (no torch import), or None."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total,memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
        name, total, free = [x.strip() for x in out[0].split(",")]
        return GpuInfo(name, int(float(total)) * MiB, int(float(free)) * MiB)
    except Exception:
        return None


def gpu_bandwidth(gpu: GpuInfo | None) -> float:
    """Bytes/s the GPU streams weights at: a known figure for the card, else a quick copy test."""
    if gpu is not None:
        for key, bw in _KNOWN_GPU_BW.items():
            if key in gpu.name:
                return bw
    try:
        import torch

        if torch.cuda.is_available():
            x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
            y = torch.empty_like(x)
            y.copy_(x)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(10):
                y.copy_(x)
            torch.cuda.synchronize()
            return 2 * 10 * x.numel() / (time.perf_counter() - t)
    except Exception:
        pass
    return 0.5e12


def cpu_bandwidth(cache: Path | None = None) -> float:
    """Bytes/s this machine's CPUs read memory at (torch sum over 256 MiB), cached per machine."""
    from dsq.runtime.builtin import cache_dir

    path = cache or (cache_dir() / "cpu_bandwidth.json")
    key = f"{os.uname().nodename}:{os.cpu_count()}"
    try:
        data = json.loads(path.read_text())
        if key in data:
            return float(data[key])
    except (OSError, ValueError):
        data = {}
    import torch

    x = torch.ones(64 * MiB, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    bw = x.numel() * 4 / best
    data[key] = bw
    try:
        path.write_text(json.dumps(data))
    except OSError:
        pass
    return bw


# ---------------------------------------------------------------------------------------------
@dataclass
class LayerCost:
    name: str
    weight_bytes: int
    kv_bytes: int
    types: dict[str, int] = field(default_factory=dict)  # quant type -> bytes
    device: str = "CPU"


@dataclass
class ModelShape:
    """What the planner needs to know about a model, read from GGUF or HF."""

    name: str
    arch: str
    n_layer: int
    n_ctx_train: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_vocab: int
    n_ff: int
    layers: list[dict[str, int]]  # per block: type -> bytes
    embed_bytes: int
    output_bytes: int  # the output head (tied models: a copy of the embedding)
    output_type: str
    misc_bytes: int  # norms and other small non-block tensors
    swa_layers: list[bool]
    sliding_window: int = 0


def shape_from_gguf(path: Path) -> ModelShape:
    from dsq.formats.gguf_file import GGUFFile

    g = GGUFFile(path)
    a = g.arch_field
    n_layer = g.n_layers
    layers: list[dict[str, int]] = [dict() for _ in range(n_layer)]
    embed = output = misc = 0
    out_type = ""
    for t in g.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m and int(m.group(1)) < n_layer:
            d = layers[int(m.group(1))]
            d[t.type_name] = d.get(t.type_name, 0) + t.n_bytes
        elif t.name == "token_embd.weight":
            embed = t.n_bytes
            if not out_type:
                out_type = t.type_name
        elif t.name == "output.weight":
            output, out_type = t.n_bytes, t.type_name
        else:
            misc += t.n_bytes
    if output == 0:  # tied: llama.cpp duplicates the embedding as the output head
        output = embed
    n_embd = int(a("embedding_length", 0))
    n_head = int(a("attention.head_count", 1) or 1)
    if isinstance(a("attention.head_count"), list):
        n_head = max(a("attention.head_count"))
    n_head_kv = a("attention.head_count_kv", n_head)
    n_head_kv = max(n_head_kv) if isinstance(n_head_kv, list) else int(n_head_kv)
    hk = int(a("attention.key_length", n_embd // max(1, n_head)))
    hv = int(a("attention.value_length", hk))
    window = int(a("attention.sliding_window", 0) or 0)
    swa = _gguf_sliding_layers(g, window, n_layer)
    tokens = g.field("tokenizer.ggml.tokens")
    ff = a("feed_forward_length", 0)
    return ModelShape(g.name, g.arch, n_layer, int(a("context_length", 4096)), n_embd, n_head, n_head_kv,
                      hk, hv, len(tokens) if tokens else 0, max(ff) if isinstance(ff, list) else int(ff),
                      layers, embed, output, out_type, misc, swa, window)


def _gguf_sliding_layers(g, window: int, n_layer: int) -> list[bool]:
    """Per layer: sliding-window attention? A pattern list says; else the architecture's period."""
    from dsq.models.arch import sliding_from_gguf
    from dsq.models.registry import find_gguf

    pattern = g.arch_field("attention.sliding_window_pattern")
    entry = find_gguf(g.arch)
    period = entry.sliding_period if entry else 0
    if isinstance(pattern, list) or (window and period):
        return sliding_from_gguf(pattern, n_layer, period)[:n_layer]
    return [False] * n_layer


def _hf_sliding_layers(cfg: dict, window: int, n_layer: int) -> list[bool]:
    from dsq.models.registry import find_model_type

    arch = find_model_type(cfg.get("model_type", ""))
    if window and arch and arch.sliding_layers:
        return arch.sliding_layers(cfg)
    return [False] * n_layer


def shape_from_hf(path: Path) -> ModelShape:
    from dsq.formats.hf import HFModelDir
    from dsq.models.arch import head_dim

    hf = HFModelDir(path)
    cfg = hf.config
    hf.require("num_hidden_layers", "hidden_size", "num_attention_heads")
    n_layer = cfg["num_hidden_layers"]
    layers: list[dict[str, int]] = [dict() for _ in range(n_layer)]
    embed = output = misc = 0
    out_type = ""
    for name in hf.tensor_names():
        sl = hf._handle(name).get_slice(name)
        dtype = sl.get_dtype()
        n = 1
        for d in sl.get_shape():
            n *= d
        nbytes = n * {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "I32": 4, "I8": 1, "U8": 1}.get(dtype, 2)
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m and int(m.group(1)) < n_layer:
            d = layers[int(m.group(1))]
            d[dtype] = d.get(dtype, 0) + nbytes
        elif name.endswith("embed_tokens.weight"):
            embed, out_type = nbytes, out_type or dtype
        elif name == "lm_head.weight":
            output, out_type = nbytes, dtype
        else:
            misc += nbytes
    output = output or embed
    hd = head_dim(cfg)
    window = int(cfg.get("sliding_window") or 0)
    swa = _hf_sliding_layers(cfg, window, n_layer)
    return ModelShape(path.name, cfg.get("model_type", "?"), n_layer, int(cfg.get("max_position_embeddings", 4096)),
                      cfg["hidden_size"], cfg["num_attention_heads"],
                      cfg.get("num_key_value_heads") or cfg["num_attention_heads"], hd, hd,
                      int(cfg.get("vocab_size", 0)), int(cfg.get("intermediate_size", 0)), layers, embed, output,
                      out_type, misc, swa, window)


@dataclass
class Plan:
    model: str
    ctx: int
    vram_budget: int
    ram_budget: int | None
    gpu_layers: int  # llama.cpp --gpu-layers value
    n_layer: int
    layers: list[LayerCost]
    output_bytes: int
    output_device: str
    embed_bytes: int
    compute_gpu_bytes: int
    compute_cpu_bytes: int
    gpu_total_bytes: int
    cpu_total_bytes: int
    gpu_bw: float
    cpu_bw: float
    bytes_per_token_gpu: int
    bytes_per_token_cpu: int
    roofline_tok_s: float
    predicted_tok_s: float
    fits_ram: bool | None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _kv_len(ctx: int, swa: bool, window: int, n_ubatch: int = 512, swa_full: bool = True) -> int:
    if swa and window and not swa_full:
        return min(ctx, -(-(window + n_ubatch) // 256) * 256)
    return ctx


def plan_placement(model: str | Path | ModelShape, vram: int, ctx: int = 4096, ram: int | None = None,
                   gpu_bw: float | None = None, cpu_bw: float | None = None, n_ubatch: int = 512,
                   reserve: int = GPU_RESERVE, swa_full: bool = True) -> Plan:
    """Choose llama.cpp's --gpu-layers for `vram` bytes; predict decode tok/s.

    swa_full: sliding-window layers keep a full-context KV cache (what dsq's llama.cpp backend
    does, so that chat turns can reuse the cached prefix); False sizes them to the window.
    """
    if isinstance(model, ModelShape):
        shape = model
    else:
        p = Path(model)
        shape = shape_from_hf(p) if p.is_dir() else shape_from_gguf(p)
    if ctx < 1:
        raise DsqError(f"--ctx must be positive, got {ctx}")
    kv_el = 2  # f16 K and V
    layers = []
    for i, types in enumerate(shape.layers):
        kv = shape.n_head_kv * (shape.head_dim_k + shape.head_dim_v) * kv_el * _kv_len(
            ctx, shape.swa_layers[i] if i < len(shape.swa_layers) else False, shape.sliding_window, n_ubatch,
            swa_full)
        layers.append(LayerCost(f"blk.{i}", sum(types.values()), kv, dict(types)))
    ub = min(n_ubatch, ctx)
    # logits + a handful of activations + attention scores for one micro-batch (f32)
    compute = ub * 4 * (shape.n_vocab + 8 * shape.n_embd + 2 * shape.n_ff) + ub * shape.n_head * min(ctx, 4096) * 4
    compute_cpu = ub * 4 * (8 * shape.n_embd + 2 * shape.n_ff)

    def gpu_need(ngl: int) -> int:
        if ngl == 0:
            return 0
        on, head = GpuLayers(ngl).split(shape.n_layer)
        need = sum(lc.weight_bytes + lc.kv_bytes for lc, g in zip(layers, on) if g) + compute + reserve
        return need + (shape.output_bytes if head else 0)

    ngl = 0
    for cand in range(shape.n_layer + 1, 0, -1):
        if gpu_need(cand) <= vram:
            ngl = cand
            break
    on_gpu, head_on_gpu = GpuLayers(ngl).split(shape.n_layer)
    for lc, g in zip(layers, on_gpu):
        lc.device = "GPU" if g else "CPU"
    out_dev = "GPU" if head_on_gpu else "CPU"
    gpu_w = sum(lc.weight_bytes for lc in layers if lc.device == "GPU")
    gpu_kv = sum(lc.kv_bytes for lc in layers if lc.device == "GPU")
    cpu_w = sum(lc.weight_bytes for lc in layers if lc.device == "CPU")
    cpu_kv = sum(lc.kv_bytes for lc in layers if lc.device == "CPU")
    out_gpu = shape.output_bytes if out_dev == "GPU" else 0
    out_cpu = shape.output_bytes if out_dev == "CPU" else 0
    gpu_total = gpu_need(ngl)
    cpu_total = shape.embed_bytes + shape.misc_bytes + cpu_w + cpu_kv + compute_cpu + (
        out_cpu if shape.output_bytes != shape.embed_bytes else 0)

    notes = []
    gpu = None
    if gpu_bw is None:
        gpu = detect_gpu()
        gpu_bw = gpu_bandwidth(gpu) if (gpu or vram) else 0.0
        if gpu is None and vram:
            notes.append("no GPU detected here: GPU bandwidth assumed 500 GB/s (set --gpu-bw)")
    if cpu_bw is None:
        cpu_bw = cpu_bandwidth()
    # per decoded token: every weight byte once, the KV cache at this context, one embedding row
    tok_gpu = gpu_w + gpu_kv + out_gpu
    tok_cpu = cpu_w + cpu_kv + out_cpu + shape.misc_bytes
    t_roof = (tok_gpu / gpu_bw if tok_gpu else 0.0) + (tok_cpu / cpu_bw if tok_cpu else 0.0)
    t_pred = (tok_gpu / (gpu_bw * GPU_EFFICIENCY) if tok_gpu else 0.0) + (
        tok_cpu / (cpu_bw * CPU_EFFICIENCY) if tok_cpu else 0.0)
    fits_ram = None if ram is None else cpu_total <= ram
    if fits_ram is False:
        notes.append("the CPU share does not fit the --ram budget")
    if ngl == 0 and vram:
        notes.append("not even one layer fits the VRAM budget")
    return Plan(shape.name, ctx, vram, ram, ngl, shape.n_layer, layers, shape.output_bytes, out_dev,
                shape.embed_bytes, compute if ngl else 0, compute_cpu, gpu_total, cpu_total, gpu_bw, cpu_bw,
                tok_gpu, tok_cpu, 1.0 / t_roof if t_roof else 0.0, 1.0 / t_pred if t_pred else 0.0,
                fits_ram, notes)
