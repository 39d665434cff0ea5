"""Placement plan: what goes on the GPU for a memory budget, and the decode speed to expect.

Bytes per layer come from the file itself (each tensor at its actual quant type), the KV cache from
the context length, plus compute buffers. Each backend places a `--gpu-layers N` its own way:
- llama.cpp: the last N layers on the GPU, and N = n_layer + 1 the output head too; the token
  embedding stays on the CPU. Its plan is the largest N that fits.
- native: the last N layers, the output head whenever any layer is there and at 0 layers where
  llama.cpp's CUDA build reserves VRAM for it (or, at a split, in RAM with --head cpu or a share of
  its rows: the plan weighs them); the token embedding in
  RAM (with every layer on the GPU, host-mapped: runtime/host_mapped.py); each layer's KV cache on
  its layer's device (float32 for the CPU layers of a split). Its plan is the N that fits with the
  fastest predicted decode.
Decode speed is a bandwidth model: every weight byte is read once per token, GPU bytes at the GPU's
bandwidth and CPU bytes at the CPU's (machine.Bandwidths, calibrated by `dsq offload --calibrate`),
each scaled by the backend's achieved share of it, plus a split's per-token exchange.
MoE models (native): `experts="cpu"` keeps every layer's routed experts in RAM, whatever device the
rest of the layer is on; a token then reads its share of them at the CPU's bandwidth and each MoE
layer on the GPU exchanges the hidden state once. `experts="auto"` takes the faster of the two
placements that fit.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dsq.errors import DsqError
from dsq.runtime.gpu_layers import GpuLayers, head_arg, head_share
from dsq.runtime.machine import Bandwidths, GpuInfo, detect_gpu, detect_gpus, machine_bandwidths
from dsq.runtime.model_shape import ModelShape, load_shape

__all__ = ["GpuInfo", "ModelShape", "Plan", "detect_gpu", "detect_gpus", "parse_size", "plan_placement"]

GiB, MiB = 1 << 30, 1 << 20
GPU_RESERVE = 512 * MiB  # CUDA context, cuBLAS workspace, fragmentation
BACKENDS = ("native", "llama.cpp")
EXPERTS = ("auto", "gpu", "cpu")  # where a MoE model's routed experts sit (--experts)
# Rows of one native prompt chunk (runtime/native.py PREFILL_CHUNK), what its GPU buffers hold.
NATIVE_CHUNK_ROWS = 512


@dataclass(frozen=True)
class Efficiency:
    """The share of a memory's measured bandwidth a backend's batch-1 decode reaches."""

    cpu: float
    gpu: float


EFFICIENCY = {
    # llama-bench on the H200 machine, random 8B Q4_K_M at --gpu-layers 0-99 (docs/benchmarks.md#offload-model).
    "llama.cpp": Efficiency(cpu=0.80, gpu=0.32),
    # dsq bench -b native on the same file and splits: the C kernels' float32 decode, the GPU part a
    # captured, uncompiled step with the one-launch kernels (354-357 tok/s all on the GPU, two calls;
    # docs/benchmarks.md#offload-model).
    "native": Efficiency(cpu=0.85, gpu=0.40),
}
# Bytes per K/V element by device: llama.cpp keeps f16 everywhere; native keeps the GPU layers' bf16
# and the CPU layers' float32, the C attention kernels' dtype (docs/benchmarks.md#split-between-gpu-and-cpu).
_KV_ELEMENT = {"llama.cpp": {"GPU": 2, "CPU": 2}, "native": {"GPU": 2, "CPU": 4}}
# Weights the native runtime holds in float32 on the CPU (its C kernels' dtype), twice their bytes
# in the file; quantized blocks stay as stored (docs/benchmarks.md#split-between-gpu-and-cpu).
_NATIVE_CPU_WIDENED = {"F16", "BF16"}


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
class LayerCost:
    name: str
    weight_bytes: int
    kv_bytes: int
    types: dict[str, int] = field(default_factory=dict)  # quant type -> bytes
    device: str = "CPU"
    expert_bytes: int = 0  # of weight_bytes as stored in the file: the routed experts
    gpu: int | None = None  # which GPU (0, 1, ...) a layer with device "GPU" is on


@dataclass
class Plan:
    model: str
    ctx: int
    vram_budget: int
    ram_budget: int | None
    gpu_layers: int  # --gpu-layers N of the backend (llama.cpp: n_layer + 1 is everything; native: n_layer)
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
    backend: str = "llama.cpp"
    gpu_layers_arg: str = "0"  # what to pass as --gpu-layers for this placement ("all" for everything)
    embed_device: str = "CPU"
    min_gpu_bytes: int = 0  # GPU memory the smallest placement with a layer on the GPU needs
    split_overhead_s: float = 0.0  # per token, counted where the CPU and the GPU each hold a part
    bandwidth_source: str = ""
    experts: str = "gpu"  # the routed experts with their layers ("gpu"), or all in RAM ("cpu")
    expert_bytes_cpu: int = 0  # routed experts held in RAM
    head: str = "gpu"  # the native backend's --head for it: "gpu", "cpu", or the share of its rows in VRAM
    # several GPUs: per GPU {"gpu", "budget_bytes", "bytes", "layers": [first, last] or None, "output"}
    gpus: list[dict] = field(default_factory=list)
    tensor_split: list[float] | None = None  # the shares the GPU layers were divided by (several GPUs)

    def as_dict(self) -> dict:
        """The plan, its gpu_layers the layers on the GPU (gpu_layers_arg: the backend's count,
        which for llama.cpp counts the output head as one more)."""
        return {**asdict(self), "gpu_layers": sum(lc.device == "GPU" for lc in self.layers)}


def _kv_len(ctx: int, swa: bool, window: int, n_ubatch: int = 512, swa_full: bool = True) -> int:
    if swa and window and not swa_full:
        return min(ctx, -(-(window + n_ubatch) // 256) * 256)
    return ctx


@dataclass(frozen=True)
class _Option:
    """One placement: per layer on the GPU?, the output head's share of rows on the GPU (1: all
    of it; native splits also a share, the rest in RAM); both backends keep the token embedding in RAM."""

    n: int  # the backend's --gpu-layers count for it
    on_gpu: tuple[bool, ...]
    head: float

    @property
    def head_gpu(self) -> bool:
        return self.head == 1.0

    @property
    def split(self) -> bool:
        """The CPU and the GPU each hold a part of the per-token work (one exchange each way): some
        layers, or with none the output head's rows."""
        return (any(self.on_gpu) or self.head > 0) and not (all(self.on_gpu) and self.head_gpu)


def _option(shape: ModelShape, backend: str, n: int) -> _Option:
    """The placement `--gpu-layers n` makes on `backend` (n counted as GpuLayers.count counts)."""
    if backend == "llama.cpp":
        on, head = GpuLayers(n).split(shape.n_layer)
        return _Option(n, tuple(on), float(head))
    k = min(n, shape.n_layer)
    on = tuple(i >= shape.n_layer - k for i in range(shape.n_layer))
    return _Option(k, on, float(k > 0))


def _options(shape: ModelShape, backend: str) -> list[_Option]:
    """Every placement the backend can make, from nothing on the GPU to everything; native also
    each split with its head in RAM (--head cpu) or a share of its rows in VRAM (HEAD_SHARES), and
    with no layer on the GPU the head's rows alone there (what llama.cpp's CUDA build reserves
    VRAM for at -ngl 0, llama_split_reserve)."""
    top = shape.n_layer + 1 if backend == "llama.cpp" else shape.n_layer
    opts = [_option(shape, backend, n) for n in range(top + 1)]
    if backend == "native":
        opts += [_Option(o.n, o.on_gpu, h) for o in opts if 0 <= o.n < shape.n_layer
                 for h in (0.0, *HEAD_SHARES, 1.0) if h != o.head]
    return opts


# the shares of a split's head rows the planner weighs for VRAM left over by whole layers: tenths,
# finer than one 8B layer (~0.3 of its Q6_K head) (docs/benchmarks.md#split-between-gpu-and-cpu)
HEAD_SHARES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def head_gpu_bytes(output_bytes: int, share: float) -> int:
    """The planner's bytes for `share` of the output head's rows on the GPU: that share of the file's
    bytes (the packed rows hold it within 3%: tests/test_head_rows.py)."""
    return round(output_bytes * share)


# How much more VRAM than llama.cpp's at the same --gpu-layers a native split may take by default,
# as a share of its layers' bytes; and what dsq's split takes beyond llama.cpp's with the head in RAM
# (+38..60 MiB measured on the 8B at 8-24 layers), off that margin first
# (docs/benchmarks.md#does-a-split-beat-llamacpp-and-at-what-vram)
SPLIT_VRAM_MARGIN = 0.10
SPLIT_BASE_EXTRA = 64 * MiB
# llama.cpp's CUDA build, at every split, reserves GPU memory for its worst-case prompt graph: a copy
# of the output head it keeps in RAM (it runs a prompt's large matmuls on the GPU) and a micro-batch's
# float32 logits. Measured at 0 layers: 1256 MiB against dsq's 720 on Qwen2-7B (head 426 + logits 297
# = 723) in three calls; on Llama-3-8B 1194 once but 898 twice, where only the logits' room was there
# (dsq with the head in RAM: 782). dsq holds the head itself in that room at a split; at 0 layers in
# the logits' room alone (docs/benchmarks.md#splits-in-rounds-h100-machine-2026-12-08).
LLAMA_SPLIT_UBATCH = 512


def llama_split_reserve(shape: ModelShape, n: int = 1) -> int:
    """GPU bytes llama.cpp's CUDA build reserves at a split of n layers beyond them: the output head's
    copy and a micro-batch's logits; at 0 layers the logits only (the head's copy was not there on
    every shape measured)."""
    return (shape.output_bytes if n else 0) + LLAMA_SPLIT_UBATCH * 4 * shape.n_vocab


def split_head(model: str | Path | ModelShape, n: int, ctx: int, free_vram: int | None = None) -> str:
    """The --head a native split of the last `n` layers takes when none is asked for: the largest
    share of the output head's rows ("gpu", the whole, then tenths, HEAD_SHARES) that fits in what
    llama.cpp's split reserves for the head and its logits (llama_split_reserve) plus
    SPLIT_VRAM_MARGIN of those layers' bytes less SPLIT_BASE_EXTRA, and in `free_vram` by the plan's
    count; "gpu" where every layer is on the GPU. --gpu-layers N asks for the VRAM of N layers as
    llama.cpp places them: the head's rows, read every token, are the fastest use of it (a head in
    RAM is ~20% of an 8B split's token). At 0 layers that room is llama.cpp's reserve for the logits
    alone (its CUDA build holds it at -ngl 0 too): four tenths of an 8B's head; a head tied to the
    embedding stays in RAM there."""
    shape = load_shape(model)
    if not 0 <= n < shape.n_layer:
        return "gpu"
    if not shape.output_bytes or shape.tied:
        return "gpu" if n else "cpu"
    on = _option(shape, "native", n).on_gpu
    layers = sum(sum(t.values()) for t, g in zip(shape.layers, on) if g)
    room = SPLIT_VRAM_MARGIN * layers - SPLIT_BASE_EXTRA + llama_split_reserve(shape, n)
    native = None if free_vram is None else _Costs(shape, ctx, "native", 512, True, None, GPU_RESERVE)
    for share in (1.0, *sorted(HEAD_SHARES, reverse=True)):
        fits = native is None or native.gpu_bytes(_Option(n, on, share)) <= free_vram
        if head_gpu_bytes(shape.output_bytes, share) <= room and fits:
            return head_arg(share)
    return "cpu"


def _default_head(shape: ModelShape, n: int, ctx: int, budgets: list[int]) -> str:
    """The --head the native runtime takes without one at a given count of n layers (split_head,
    with one GPU's budget as its free memory); in RAM at 0 layers with no VRAM at all (no GPU)."""
    if not n and not any(budgets):
        return "cpu"
    return split_head(shape, n, ctx, budgets[0] if len(budgets) == 1 and budgets[0] > 0 else None)


class _Costs:
    """Bytes one model at one context needs on each device, and reads per token, on one backend."""

    def __init__(self, shape: ModelShape, ctx: int, backend: str, n_ubatch: int, swa_full: bool,
                 kv_tokens: int | None, reserve: int, experts_cpu: bool = False):
        self.shape, self.backend, self.reserve = shape, backend, reserve
        self.shares: list[float] | None = None  # several GPUs: each one's share of the GPU layers
        self.experts_cpu = experts_cpu and bool(shape.expert_bytes)
        stored = shape.expert_bytes or [0] * shape.n_layer
        self.experts = stored if self.experts_cpu else [0] * shape.n_layer  # bytes kept in RAM per layer
        self.kv_el = _KV_ELEMENT[backend]
        full = swa_full or backend == "native"  # the native cache holds every slot on every layer
        per_slot = shape.n_head_kv * (shape.head_dim_k + shape.head_dim_v)
        lens = [_kv_len(ctx, i < len(shape.swa_layers) and shape.swa_layers[i], shape.sliding_window, n_ubatch, full)
                for i in range(shape.n_layer)]
        self.weights = [sum(t.values()) for t in shape.layers]
        self.cpu_weights = [_cpu_weight(t, backend) for t in shape.layers]
        # what a token reads of each: MoE blocks run only the chosen routed experts
        self.gpu_read = [shape.read_bytes(i, w) - self._expert_read(i) for i, w in enumerate(self.weights)]
        self.cpu_read = [shape.read_bytes(i, w) for i, w in enumerate(self.cpu_weights)]
        self.kv_slots = [per_slot * n for n in lens]  # elements held
        self.kv_read = [per_slot * min(kv_tokens or ctx, n) for n in lens]  # elements read per token
        ub = min(n_ubatch, ctx)
        # a micro-batch's activations (f32) on the CPU; on the GPU also its logits and attention scores
        self.compute_cpu = ub * 4 * (8 * shape.n_embd + 2 * shape.n_ff)
        self.llama_compute_gpu = self.compute_cpu + ub * 4 * shape.n_vocab + ub * shape.n_head * min(ctx, 4096) * 4

    def _expert_read(self, i: int) -> int:
        """Of layer i's stored bytes a token reads, those of its routed experts kept in RAM."""
        e = self.experts[i]
        if not e or not self.shape.n_expert:
            return 0
        return e * self.shape.n_expert_used // self.shape.n_expert

    def moe_on_gpu(self, opt: _Option) -> int:
        """MoE layers on the GPU whose experts are in RAM: one exchange each per token."""
        return sum(1 for i, g in enumerate(opt.on_gpu) if g and self.experts[i])

    def compute_gpu(self, opt: _Option) -> int:
        if self.backend == "llama.cpp":
            return self.llama_compute_gpu
        return _native_compute_bytes(self.shape, max(self.weights, default=0), opt.split)

    def layer_kv(self, i: int, on_gpu: bool) -> int:
        return self.kv_slots[i] * self.kv_el["GPU" if on_gpu else "CPU"]

    def gpu_bytes(self, opt: _Option) -> int:
        """GPU memory the placement needs (0 with nothing on the GPU)."""
        if not any(opt.on_gpu) and not opt.head:
            return 0
        s = self.shape
        layers = sum(w - self.experts[i] + self.layer_kv(i, True) for i, w in enumerate(self.weights)
                     if opt.on_gpu[i])
        return layers + head_gpu_bytes(s.output_bytes, opt.head) + self.compute_gpu(opt) + self.reserve

    def gpu_bytes_each(self, opt: _Option) -> list[int]:
        """Each GPU's memory for the placement (over several GPUs: by `shares`, gpu_division); a GPU
        that holds nothing needs none."""
        if self.shares is None:
            return [self.gpu_bytes(opt)]
        counts, head_at = gpu_division(self.backend, sum(opt.on_gpu), opt.head > 0, self.shares)
        gpu_layers = [i for i, g in enumerate(opt.on_gpu) if g]
        out, at = [], 0
        for d, n in enumerate(counts):
            mine = gpu_layers[at:at + n]
            at += n
            used = sum(self.weights[i] - self.experts[i] + self.layer_kv(i, True) for i in mine)
            if d == head_at:
                used += head_gpu_bytes(self.shape.output_bytes, opt.head)
            out.append(used + self.compute_gpu(opt) + self.reserve if mine or d == head_at else 0)
        return out

    def cpu_bytes(self, opt: _Option) -> int:
        s = self.shape
        layers = sum(w + self.layer_kv(i, False) for i, w in enumerate(self.cpu_weights) if not opt.on_gpu[i])
        layers += sum(e for i, e in enumerate(self.experts) if opt.on_gpu[i])
        head = 0 if s.tied else s.output_bytes - head_gpu_bytes(s.output_bytes, opt.head)
        return layers + head + s.embed_bytes + s.misc_bytes + self.compute_cpu

    def per_token(self, opt: _Option) -> tuple[int, int]:
        """(GPU bytes, CPU bytes) read per decoded token: every weight once (of routed experts,
        the share a token runs), the KV cache it attends over, the output head; one embedding row
        is too small to count."""
        el, s = self.kv_el, self.shape
        gpu = cpu = 0
        for i, g in enumerate(opt.on_gpu):
            if g:
                gpu += self.gpu_read[i] + self.kv_read[i] * el["GPU"]
                cpu += self._expert_read(i)
            else:
                cpu += self.cpu_read[i] + self.kv_read[i] * el["CPU"]
        on = head_gpu_bytes(s.output_bytes, opt.head)
        return gpu + on, cpu + s.output_bytes - on + s.misc_bytes

    def seconds(self, opt: _Option, bw: Bandwidths) -> float:
        """Predicted seconds per decoded token."""
        eff = EFFICIENCY[self.backend]
        gpu, cpu = self.per_token(opt)
        return _transfer(gpu, bw.gpu * eff.gpu) + _transfer(cpu, bw.cpu * eff.cpu) + self.overhead(opt, bw)

    def overhead(self, opt: _Option, bw: Bandwidths) -> float:
        """Per token: a layer split's exchange, one more per MoE layer on the GPU whose experts
        are in RAM (the same round trip of one hidden state), and over several GPUs one per boundary
        between them (counted as that round trip too)."""
        between = 0
        if self.shares is not None:
            counts, head_at = gpu_division(self.backend, sum(opt.on_gpu), opt.head > 0, self.shares)
            between = gpu_boundaries(counts, head_at)
        return (bw.split_overhead_s if opt.split else 0.0) + bw.split_overhead_s * (self.moe_on_gpu(opt) + between)

    def roofline_seconds(self, opt: _Option, bw: Bandwidths) -> float:
        """Seconds a token's bytes take at the memories' ceilings (the CPU's: the faster of its probes)."""
        gpu, cpu = self.per_token(opt)
        return _transfer(gpu, bw.gpu) + _transfer(cpu, bw.cpu_ceiling)


def _cpu_weight(types: dict[str, int], backend: str) -> int:
    """A layer's weight bytes in CPU memory on `backend` (types: stored type -> bytes in the file)."""
    if backend != "native":
        return sum(types.values())
    return sum(n * (2 if t.upper() in _NATIVE_CPU_WIDENED else 1) for t, n in types.items())


def _transfer(nbytes: int, rate: float) -> float:
    return nbytes / rate if nbytes and rate > 0 else 0.0


# a weight written out for a long prompt's cuBLAS GEMM, a slab of rows at a time (triton_dequant.SLAB_BYTES)
_DEQUANT_SLAB = 128 << 20


def _native_compute_bytes(shape: ModelShape, widest_layer: int, split: bool) -> int:
    """GPU memory the native runtime uses beyond weights and cache: a prompt chunk's bf16
    activations, one row of float32 logits, a slab of a weight written out in bf16 for a long
    prompt's cuBLAS matmul, and in a split the CPU layers' modules streamed in for a prompt chunk,
    a few at a time: under a layer (docs/benchmarks.md#split-between-gpu-and-cpu)."""
    acts = NATIVE_CHUNK_ROWS * 2 * (8 * shape.n_embd + 2 * shape.n_ff)
    dequant = min(_DEQUANT_SLAB, 2 * 2 * shape.n_ff * shape.n_embd)
    return acts + 4 * shape.n_vocab + dequant + (widest_layer if split else 0)


def gpu_division(backend: str, k: int, head: bool, shares: list[float]) -> tuple[list[int], int | None]:
    """(GPU layers per GPU, the GPU of the output head or None) for k GPU layers over GPUs with
    `shares`, as `backend` divides them: native as GpuLayers.devices (the layers in proportion, the
    head on the last GPU with a share); llama.cpp counts the head as one more part, the last."""
    from dsq.runtime.gpu_layers import divide_layers

    last = max(i for i, s in enumerate(shares) if s > 0)
    if backend == "llama.cpp" and head:
        counts = divide_layers(k + 1, shares)
        at = max(i for i, n in enumerate(counts) if n)
        counts[at] -= 1
        return counts, at
    return divide_layers(k, shares), (last if head else None)


def _fits(costs: _Costs, opt: _Option, budgets: list[int]) -> bool:
    return all(b <= v for b, v in zip(costs.gpu_bytes_each(opt), budgets))


def _choose(costs: _Costs, options: list[_Option], budgets: list[int], bw: Bandwidths) -> _Option:
    """llama.cpp: the most layers that fit. native: of those that fit, the fastest predicted."""
    fits = [o for o in options if _fits(costs, o, budgets)]
    if costs.backend == "llama.cpp":
        return max(fits, key=lambda o: o.n)
    return min(fits, key=lambda o: (costs.seconds(o, bw), o.n, -o.head))


def _bandwidths(cpu_bw: float | None, gpu_bw: float | None, vram: int, notes: list[str]) -> Bandwidths:
    """The machine's figures (machine_bandwidths), noting a GPU budget planned on a machine without one."""
    gpu = None if cpu_bw and gpu_bw else detect_gpu()
    if gpu is None and not gpu_bw and vram:
        notes.append("no GPU detected here: GPU bandwidth assumed 500 GB/s (set --gpu-bw)")
    bw = machine_bandwidths(gpu, cpu_bw=cpu_bw, gpu_bw=gpu_bw)
    notes.extend(bw.notes)
    return bw


def plan_placement(model: str | Path | ModelShape, vram: int | list[int], ctx: int = 4096, ram: int | None = None,
                   gpu_bw: float | None = None, cpu_bw: float | None = None, n_ubatch: int = 512,
                   reserve: int = GPU_RESERVE, swa_full: bool = True, *, backend: str = "llama.cpp",
                   gpu_layers: GpuLayers | int | str | None = None, kv_tokens: int | None = None,
                   bandwidths: Bandwidths | None = None, experts: str = "gpu", head: str | None = None,
                   tensor_split: list[float] | None = None) -> Plan:
    """Choose what `backend` puts on the GPU for `vram` bytes (or take `gpu_layers` as given; 'auto'
    chooses) and predict decode tok/s.

    vram: one budget, or one per GPU: the GPU layers then go over the GPUs in contiguous ranges in
    proportion to `tensor_split` (default: the budgets), the output head on the last (gpu_division),
    and a placement fits when each GPU's part fits its budget.
    swa_full: llama.cpp's sliding-window layers keep a full-context KV cache (what dsq's llama.cpp
    backend does, so that chat turns can reuse the cached prefix); False sizes them to the window.
    kv_tokens: tokens in the cache while decoding (default: a full context), what attention reads.
    bandwidths: the machine's figures (default: machine_bandwidths, with gpu_bw / cpu_bw first).
    experts: "gpu" (the routed experts with their layers), "cpu" (all in RAM: native only), or
    "auto" (native: of the two, the faster predicted placement that fits).
    head: with a given native split, "cpu" keeps the output head in RAM (--head cpu), a share such
    as "0.6" that share of its rows in VRAM; choosing, the plan weighs all of them.
    """
    shape = load_shape(model)
    if ctx < 1:
        raise DsqError(f"--ctx must be positive, got {ctx}")
    if backend not in BACKENDS:
        raise DsqError(f"unknown backend {backend!r}", f"choose one of: {', '.join(BACKENDS)}")
    if experts not in EXPERTS:
        raise DsqError(f"--experts takes {', '.join(EXPERTS)}, got {experts!r}")
    if experts == "cpu" and backend != "native":
        raise DsqError("--experts cpu is the native backend's placement",
                       "pass --backend native (llama.cpp's own tools take -ot exps=CPU)")
    budgets = list(vram) if isinstance(vram, (list, tuple)) else [vram]
    if not budgets:
        budgets = [0]
    vram = sum(budgets)
    shares = list(tensor_split) if tensor_split is not None else [float(max(b, 0)) for b in budgets]
    if len(shares) != len(budgets):
        raise DsqError(f"--tensor-split has {len(shares)} shares for {len(budgets)} GPU budgets",
                       "give one share per GPU")
    if not any(shares):
        shares = [1.0] * len(budgets)
    notes: list[str] = []
    bw = bandwidths or _bandwidths(cpu_bw, gpu_bw, vram, notes)
    given = None if gpu_layers is None else GpuLayers.parse(gpu_layers)
    kinds = ["gpu", "cpu"] if experts == "auto" and backend == "native" and shape.expert_bytes else [
        "cpu" if experts == "cpu" else "gpu"]
    picked = []
    for kind in kinds:
        costs = _Costs(shape, ctx, backend, n_ubatch, swa_full, kv_tokens, reserve, experts_cpu=kind == "cpu")
        costs.shares = shares if len(budgets) > 1 else None
        if given is None or given.auto:
            opt = _choose(costs, _options(shape, backend), budgets, bw)
        else:
            opt = _option(shape, backend, given.count(shape.n_layer))
            if backend == "native" and 0 <= opt.n < shape.n_layer:
                opt = _Option(opt.n, opt.on_gpu, head_share(head or _default_head(shape, opt.n, ctx, budgets)))
        picked.append((not _fits(costs, opt, budgets), costs.seconds(opt, bw), kind, costs, opt))
    _, _, kind, costs, opt = min(picked, key=lambda p: p[:2])  # one that fits, then the fastest
    plan = _plan(shape, costs, opt, bw, vram, ctx, ram, notes, chosen=given is None or given.auto)
    if len(budgets) > 1:
        _over_gpus(plan, costs, opt, budgets)
    plan.experts = kind if shape.expert_bytes else "gpu"
    plan.expert_bytes_cpu = sum(costs.experts)
    if costs.experts_cpu:
        plan.notes.append(f"routed experts in RAM: {plan.expert_bytes_cpu / MiB:.0f} MiB, a token reads "
                          f"{sum(costs._expert_read(i) for i in range(shape.n_layer)) / MiB:.0f} "
                          f"MiB of them; the hidden state crosses once per MoE layer")
    return plan


def _plan(shape: ModelShape, costs: _Costs, opt: _Option, bw: Bandwidths, vram: int, ctx: int,
          ram: int | None, notes: list[str], chosen: bool) -> Plan:
    experts = shape.expert_bytes or [0] * shape.n_layer
    layers = [LayerCost(f"blk.{i}", costs.weights[i] if g else costs.cpu_weights[i], costs.layer_kv(i, g),
                        dict(shape.layers[i]), "GPU" if g else "CPU", experts[i]) for i, g in enumerate(opt.on_gpu)]
    tok_gpu, tok_cpu = costs.per_token(opt)
    t_pred, t_roof = costs.seconds(opt, bw), costs.roofline_seconds(opt, bw)
    gpu_total, cpu_total = costs.gpu_bytes(opt), costs.cpu_bytes(opt)
    # the smallest placement with a layer on the GPU (native: its head in RAM)
    min_gpu = min(costs.gpu_bytes(o) for o in _options(shape, costs.backend) if o.n == 1) if shape.n_layer else 0
    fits_ram = None if ram is None else cpu_total <= ram
    notes += _plan_notes(opt, vram, gpu_total, min_gpu, fits_ram, chosen, costs.backend)
    if shape.expert_bytes:
        notes.append(f"MoE: {sum(shape.expert_bytes) / MiB:.0f} MiB of routed experts in {sum(map(bool, experts))} "
                     f"layers; a token reads {shape.n_expert_used} of {shape.n_expert} in each")
    everything = all(opt.on_gpu) and opt.head_gpu
    return Plan(shape.name, ctx, vram, ram, opt.n, shape.n_layer, layers, shape.output_bytes,
                "GPU" if opt.head_gpu else "CPU" if not opt.head else "GPU+CPU", shape.embed_bytes, costs.compute_gpu(opt) if gpu_total else 0,
                costs.compute_cpu, gpu_total, cpu_total, bw.gpu, bw.cpu, tok_gpu, tok_cpu,
                1.0 / t_roof if t_roof else 0.0, 1.0 / t_pred if t_pred else 0.0, fits_ram, notes,
                backend=costs.backend, gpu_layers_arg="all" if everything else str(opt.n),
                min_gpu_bytes=min_gpu,
                split_overhead_s=costs.overhead(opt, bw), bandwidth_source=bw.source,
                head=head_arg(opt.head))


def _over_gpus(plan: Plan, costs: _Costs, opt: _Option, budgets: list[int]) -> None:
    """The plan's GPU part over several GPUs: which layers each holds, its bytes, where the head is."""
    counts, head_at = gpu_division(costs.backend, sum(opt.on_gpu), opt.head > 0, costs.shares)
    each = costs.gpu_bytes_each(opt)
    on = [lc for lc in plan.layers if lc.device == "GPU"]
    at = 0
    plan.gpus = []
    for d, (n, used, budget) in enumerate(zip(counts, each, budgets)):
        for lc in on[at:at + n]:
            lc.gpu = d
        names = [lc.name for lc in on[at:at + n]]
        at += n
        plan.gpus.append({"gpu": d, "budget_bytes": budget, "bytes": used, "n_layers": n,
                          "layers": [names[0], names[-1]] if names else None, "output": d == head_at})
        if used > budget:
            plan.notes.append(f"GPU {d} needs ~{used / MiB:.0f} MiB, more than its {budget / MiB:.0f} MiB budget")
    plan.tensor_split = list(costs.shares)
    plan.gpu_total_bytes = sum(each)


def gpu_boundaries(counts: list[int], head_at: int | None) -> int:
    """Boundaries between GPUs the hidden state crosses a token: the GPUs holding a part, less one."""
    return max(sum(1 for d, n in enumerate(counts) if n or d == head_at) - 1, 0)


def _plan_notes(opt: _Option, vram: int, gpu_total: int, min_gpu: int, fits_ram: bool | None, chosen: bool,
                backend: str) -> list[str]:
    notes = []
    if fits_ram is False:
        notes.append("the CPU share does not fit the --ram budget")
    if chosen and opt.n == 0 and vram and min_gpu > vram:
        notes.append(f"not even one layer fits the VRAM budget (the first needs ~{min_gpu / MiB:.0f} MiB)")
    if not chosen and vram and gpu_total > vram:
        notes.append(f"this placement needs ~{gpu_total / MiB:.0f} MiB of GPU memory, more than the "
                     f"{vram / MiB:.0f} MiB budget")
    return notes
