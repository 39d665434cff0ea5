"""The native backend: dsq's own torch engine for llama, qwen2, gemma3 and DeepSeek V2/V3 (HF or
GGUF weights).

One preallocated KV cache per model; a new request reuses the cached KV of the longest common
token prefix (chat turns prefill only what is new). On CUDA, with every layer on the GPU, the
decode step is captured once as a CUDA graph and replayed, so small models are not bound by
kernel launches. On the CPU, `compile` has torch.compile fuse the decode step's small ops
around the C kernels (_CompiledStep).
"""

from __future__ import annotations

import os
import types
import warnings
from pathlib import Path
from typing import Iterator

import torch

from dsq.errors import DsqError
from dsq.kernels import dispatch
from dsq.models.base import cross_device
from dsq.models.registry import gguf_name
from dsq.runtime import fused_layer
from dsq.runtime.generate import GenStats, TokenEvent
from dsq.runtime.gpu_layers import GpuLayers
from dsq.runtime.model_ref import ModelRef
from dsq.runtime.sampling import Sampler, SamplingParams
from dsq.runtime.streamed import STREAM_MIN_ROWS, StreamedLayers

PREFILL_CHUNK = 512
_RECENT = 64  # tokens of each sequence the repeat penalty looks back over
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "f16": torch.float16, "fp32": torch.float32, "float32": torch.float32, "f32": torch.float32}


def parse_dtype(name: str | None, default: torch.dtype) -> torch.dtype:
    if name is None or name == "auto":
        return default
    if name.lower() not in _DTYPES:
        raise DsqError(f"unknown dtype {name!r}", "use bf16, fp16 or fp32")
    return _DTYPES[name.lower()]


def _tokenizer(path: Path, kind: str, config: dict):
    if kind == "gguf":
        from dsq.runtime.tokenizer import GGUFTokenizer

        return GGUFTokenizer(path)
    from dsq.runtime.tokenizer import HFTokenizer

    return HFTokenizer(path, config)


def _graphed(run, pool=None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`run()` (over static input tensors) captured as a CUDA graph, after two warm-up runs on a
    side stream, its memory from `pool` (a graph_pool_handle several graphs share) if given;
    (graph, its output tensor)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.inference_mode():
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
        out = run()
    return graph, out


class _GraphedStep:
    """The decode step (B, 1) captured as a CUDA graph over the full-length cache (the warm-up
    writes slot 0, which any real prompt overwrites)."""

    def __init__(self, model, cache, batch: int):
        dev = torch.device("cuda")
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)
        self.pad = torch.zeros(batch, dtype=torch.long, device=dev)
        self.graph, self.out = _graphed(lambda: model(self.tok, self.slot, cache, self.pad, last_only=True))

    def __call__(self, tok: torch.Tensor, slot: int, pad: torch.Tensor) -> torch.Tensor:
        self.tok.copy_(tok)
        self.slot.fill_(slot)
        self.pad.copy_(pad)
        self.graph.replay()
        return self.out


# A model all on one GPU runs a full prompt chunk (PREFILL_CHUNK tokens) as a CUDA graph: eagerly the
# host's launches, ~800 for Qwen2-7B's 512 tokens, took 37 ms on the H100 machine where the GPU's
# kernels took 19, graphed 19.7 (docs/benchmarks.md#all-on-the-gpu-h100-machine-2026-12-06-with-the-prefill-graphs);
# DSQ_PREFILL_GRAPH=0 keeps the chunks eager
PREFILL_GRAPH = os.environ.get("DSQ_PREFILL_GRAPH", "1") != "0"

# How the decode loop waits for a step's tokens: spinning (the fastest wake-up), unless the step runs C
# calls on the host's threads (routed experts in RAM, queued on the stream: model.host_work_in_step);
# then asleep on a blocking event, so the waiting thread does not spin on a core those threads want.
# DSQ_BLOCKING_WAIT=0 always spins, 1 always sleeps (docs/benchmarks.md#experts-in-ram-where-decodes-time-goes-h100-machine-2026-12-07-late-night:
# inside the host's spread, 70.8-75.2 tok/s asleep against 71.0-72.5 spinning)
BLOCKING_WAIT = os.environ.get("DSQ_BLOCKING_WAIT", "")


class _PrefillGraphs:
    """Full prompt chunks of one sequence, captured as CUDA graphs: one per attention span S (the
    chunk's last slot + 1 rounded up to PREFILL_CHUNK times a power of two, at most the cache), over
    static ids and slots, so a chunk at any position replays the graph of its span, masked to its
    slots as the eager chunk is. A span's first chunk runs eagerly (its kernels built, its output
    real), then its graph is captured as the decode step's is (_graphed: its warm-ups rewrite the
    same keys and values) for the next; a capture that fails leaves every chunk eager, with a
    warning. `dev`: where the static buffers live (the CPU under tests' stand-in graphs)."""

    def __init__(self, model, cache, dev: torch.device = torch.device("cuda")):
        self.model, self.cache = model, cache
        self.ids = torch.zeros(1, PREFILL_CHUNK, dtype=torch.long, device=dev)
        self.slots = torch.zeros(PREFILL_CHUNK, dtype=torch.long, device=dev)
        self.pad = torch.zeros(1, dtype=torch.long, device=dev)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.failed = False

    def span(self, end: int) -> int:
        """The attention span of a chunk ending before slot `end`."""
        s = PREFILL_CHUNK
        while s < end:
            s *= 2
        return min(s, self.cache.length)

    def takes(self, chunk: torch.Tensor, start: int) -> bool:
        return not self.failed and chunk.shape == (1, PREFILL_CHUNK) and start + PREFILL_CHUNK <= self.cache.length

    def __call__(self, chunk: torch.Tensor, start: int) -> torch.Tensor:
        """Logits (1, 1, V) of the chunk's last token; its keys and values written at start.."""
        S = self.span(start + PREFILL_CHUNK)
        self.ids.copy_(chunk, non_blocking=True)
        torch.arange(start, start + PREFILL_CHUNK, out=self.slots)
        if S in self.graphs:
            graph, out = self.graphs[S]
            graph.replay()
            return out.clone()  # the next replay rewrites the graph's own
        run = lambda: self.model(self.ids, self.slots, self.cache, self.pad, kv_len=S, last_only=True)  # noqa: E731
        out = run()
        try:
            self.graphs[S] = _graphed(run, self.pool)
        except Exception as e:  # noqa: BLE001 - eager chunks work without the graphs
            self.failed = True
            self.graphs.clear()
            warnings.warn(f"capturing a prompt chunk failed, prefilling eagerly: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}", RuntimeWarning, stacklevel=3)
        return out


def _gpu_part(model, x, start: int, slot, cache, pad):
    """A split model's GPU part of a decode step: layers start.., the final norm, the head."""
    return model.head(model.forward_layers(x, start, len(model.model.layers), slot, cache, pad), last_only=True)


def _gpu_layers_part(model, x, start: int, slot, cache, pad):
    """The GPU part of a split model whose head is in RAM: layers start.. and the final norm, in
    float32 (what the head's C kernels read)."""
    return model.model.norm(model.forward_layers(x, start, len(model.model.layers), slot, cache, pad)).float()


def _gpu_rows_part(model, x, start: int, slot, cache, pad):
    """The GPU part of a split model whose head is split by rows: layers start.., the final norm,
    and the head's GPU rows; the normed hidden state in float32 (what the head's C kernels read)
    and the GPU rows' logits, also in float32, which the CPU joins to its own."""
    h = model.model.norm(model.forward_layers(x, start, len(model.model.layers), slot, cache, pad))
    return h.float(), model.lm_head.gpu_rows(h).float()


class _SplitStep:
    """The decode step of a model split between the CPU and one GPU: the embedding and the first
    `start` layers run eagerly on the CPU (the C kernels, float32), the rest of the layers (none
    with every layer on the CPU), the final norm and the head are one CUDA graph (of the
    torch.compile'd part with `compile`). The hidden state crosses once per token, through pinned
    memory; the GPU's pad is copied only when it changes. A head in RAM (--head cpu) runs after
    the graph, on the CPU: the graph ends with the final norm, and the normed hidden state comes
    back once more. A head split by rows (--head 0.6) runs its GPU rows at the graph's end; their
    logits come back with the hidden state, and the CPU runs only the rest."""

    def __init__(self, model, cache, start: int, batch: int, compile_mode: str | None | bool = False):
        dev = torch.device("cuda")
        self.model, self.cache, self.start = model, cache, start
        layers = model.model.layers
        dt = (layers[start].input_layernorm if start < len(layers) else model.model.norm).weight.dtype
        self.x = torch.zeros(batch, 1, model.args.hidden_size, dtype=dt, device=dev)
        self.host = torch.zeros(batch, 1, model.args.hidden_size, dtype=dt, pin_memory=True)
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)
        self.pad = torch.zeros(batch, dtype=torch.long, device=dev)
        self._pad_on_gpu = torch.zeros(batch, dtype=torch.long)
        from dsq.models.base import module_device

        self.head_on_cpu = module_device(model.lm_head).type == "cpu"
        self.head_rows = hasattr(model.lm_head, "gpu_rows")  # (qmodules.RowSplitLinear)
        part = _gpu_rows_part if self.head_rows else _gpu_layers_part if self.head_on_cpu else _gpu_part
        if compile_mode is not False:
            # only the GPU part: the CPU layers compiled decoded slower on the H200 host's 16 cores
            # (docs/benchmarks.md#split-between-gpu-and-cpu)
            part = torch.compile(part, dynamic=False, mode=compile_mode)
        self.graph, self.out = _graphed(lambda: part(model, self.x, start, self.slot, cache, self.pad))
        self.outs = self.out if self.head_rows else (self.out,)
        if self.head_on_cpu:  # the normed hidden state (and any GPU rows' logits) come back through pinned memory
            self.back = [torch.empty(o.shape, dtype=o.dtype, pin_memory=True) for o in self.outs]
            self.back_ready = torch.cuda.Event()

    def __call__(self, tok: torch.Tensor, slot: int, pad: torch.Tensor) -> torch.Tensor:
        pad, tok = pad.cpu(), tok.cpu()
        slots = torch.tensor([slot])
        x = self.model.forward_layers(self.model.embed(tok), 0, self.start, slots, self.cache, pad, slot + 1)
        self.host.copy_(x)
        self.x.copy_(self.host, non_blocking=True)
        self.slot.fill_(slot)
        if not torch.equal(pad, self._pad_on_gpu):
            self.pad.copy_(pad)
            self._pad_on_gpu = pad.clone()
        self.graph.replay()
        if self.head_on_cpu:
            for b, o in zip(self.back, self.outs):
                b.copy_(o, non_blocking=True)
            self.back_ready.record()
            self.back_ready.synchronize()
            if self.head_rows:
                return self.model.softcap(self.model.lm_head.join(*self.back))
            return self.model.logits(self.back[0])
        return self.out


def _decode_step(model, tok, slots, cache, pad, kv_len: int):
    """The decode step _CompiledStep compiles (a private copy of this function per model)."""
    return model(tok, slots, cache, pad, kv_len=kv_len, last_only=True)


class _CompiledStep:
    """The CPU decode step (B, 1) under torch.compile. Inductor fuses each layer's ~60 small ops
    (norms, rope, attention, residuals, the KV write) into a few C++ loops around the C kernels,
    which it calls as operators (kernels/ops.py): ~30% off the built-in model's step on 2 cores
    (17.5 -> 12.5 ms). Compiling takes ~40 s on 2 cores the first time, ~7 s once inductor's
    on-disk cache holds the graph's kernels.

    - One graph for every cache position: compiled once, here, with kv_len symbolic (writing
      cache slot 1, which any real prompt overwrites).
    - Dynamo keeps compiled code per Python code object, so each model compiles a private copy of
      _decode_step: its graph can then skip the guards on the model's modules (~1 ms a step for
      18 layers: the model does not change after loading) without another model reusing it.
      fullgraph=True: a graph break would compile frames of the shared model code.
    - Any failure (no C++ compiler, a graph break) raises: the caller keeps the eager step."""

    def __init__(self, model, cache, batch: int, mode: str | None):
        code = _decode_step.__code__.replace(co_name=f"_decode_step_{id(self):x}")
        fn = types.FunctionType(code, _decode_step.__globals__, code.co_name)
        skip = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
        opts = {"mode": mode} if mode or skip is None else {"options": {"guard_filter_fn": skip}}
        self.model, self.fn = model, torch.compile(fn, dynamic=None, fullgraph=True, **opts)
        cfg = getattr(torch.compiler, "config", None)
        dyn = cfg is not None and hasattr(cfg, "dynamic_sources")
        with torch.inference_mode():  # (inference tensors, as in stream(): guards check it)
            tok = torch.zeros(batch, 1, dtype=torch.long)
            pad = torch.zeros(batch, dtype=torch.long)
            if dyn:
                with cfg.patch(dynamic_sources="L['kv_len']"):
                    self(tok, torch.tensor([1]), cache, pad, 2)
            else:  # older torch: the second length makes kv_len dynamic (a second compile)
                self(tok, torch.tensor([1]), cache, pad, 2)
                self(tok, torch.tensor([2]), cache, pad, 3)

    def __call__(self, tok, slots, cache, pad, kv_len: int) -> torch.Tensor:
        return self.fn(self.model, tok, slots, cache, pad, kv_len)


def _split_head(model: Path | None, placed: GpuLayers, n_ctx: int, gpu) -> str:
    """The default --head of a model split between the GPU and the CPU, at 0 layers too
    (placement.split_head), with the GPU's free memory; "gpu" for a model that is not split, or
    with layers on the GPU whose shape cannot be read; "cpu" without a GPU or at 0 layers then."""
    if gpu is None or placed.n_gpu_layers < 0:
        return "gpu"
    if model is None:
        return "gpu" if placed.n_gpu_layers else "cpu"
    from dsq.runtime.placement import split_head

    free, _ = torch.cuda.mem_get_info(gpu)
    return split_head(model, placed.n_gpu_layers, n_ctx, free)


class NativeModel:
    backend = "native"

    def __init__(self, path: str | Path, kind: str, *, ref: ModelRef | None = None, n_ctx: int = 4096,
                 gpu_layers: GpuLayers | int | str = 0, dtype: str | None = None, kv_dtype: str | None = None,
                 threads: int | None = None, seed: int | None = None, cuda_graph: bool = True, fuse: bool = True,
                 compile: bool | str = False, experts: str = "auto", head: str | None = None,
                 tensor_split: list[float] | None = None, tp: tuple[int, int] | None = None):
        """tensor_split: each visible GPU's share of the GPU layers (--tensor-split); tp: (rank, ranks)
        to keep rank's share of each layer on its own GPU (runtime/tp.py), its notes in tp_notes."""
        from dsq.runtime import gpu_layers as gl
        from dsq.runtime.experts import parse_experts, resolve_experts
        from dsq.runtime.gpu_layers import parse_head
        from dsq.runtime.native_loader import load_gguf, load_hf

        self.path = Path(path)
        if threads:
            torch.set_num_threads(threads)
        self.tp, self.tp_notes = tp or (0, 1), []
        gpus = gl.visible_gpus()
        if self.tp[1] > 1 and gpus:  # a rank of --tp: its own GPU only (serve/tp.py sets it current)
            if tensor_split is not None:
                raise DsqError("--tensor-split places layers over GPUs and --tp splits each layer over them",
                               "pass one of them")
            gpus = [torch.device("cuda", torch.cuda.current_device())]
        gpu = gpus[0] if gpus else None  # the first GPU: the one-GPU decisions below (experts, head)
        if tensor_split is not None and gpus:
            gl.check_tensor_split(tensor_split, len(gpus))
        asked = GpuLayers.parse(gpu_layers)
        file = self.path if kind == "gguf" else None
        shape_of = self.path if kind in ("gguf", "hf") else None
        # where the routed experts run (runtime/experts.py): "cpu" or "gpu" from here on
        self.experts = resolve_experts(parse_experts(experts), shape_of, n_ctx, gpu,
                                       asked.resolve(file, n_ctx) if not asked.auto else asked)
        placed = asked.resolve(file, n_ctx, experts=self.experts, tensor_split=tensor_split).on(gpu)
        # each GPU's share of the GPU layers: as asked (--tensor-split), else its free memory
        self.tensor_split = None
        if gpus and placed.n_gpu_layers != 0:
            self.tensor_split = list(tensor_split) if tensor_split is not None else gl.free_shares(gpus)
        loader = load_gguf if kind == "gguf" else load_hf
        # the head: as asked, else where --gpu-layers auto's plan put it, else at a split the share
        # of its rows that the VRAM of llama.cpp's placement leaves (placement.split_head)
        head = parse_head(head) if head is not None else placed.head or _split_head(
            shape_of, placed, n_ctx, gl.last_gpu(gpus, self.tensor_split) if gpus else None)
        # bf16 where any of it runs on a GPU (the CPU layers of a split compute in float32 all the same)
        on_gpu = placed.n_gpu_layers != 0 or gl.head_alone(placed, gpus, head)
        dt = parse_dtype(dtype, torch.bfloat16 if on_gpu else torch.float32)
        shard = None
        if self.tp[1] > 1:
            from dsq.runtime import tp as tensor_parallel

            shard = lambda m: tensor_parallel.shard(m, *self.tp, self.tp_notes)  # noqa: E731
        model, config = loader(self.path, dt, placed, gpus, experts=self.experts, head=head, shares=self.tensor_split,
                               shard=shard)
        self._setup(model, config, _tokenizer(self.path, kind, config), ref=ref or ModelRef(kind, self.path),
                    n_ctx=n_ctx, gpu_layers=placed, kv_dtype=kv_dtype, seed=seed, cuda_graph=cuda_graph, fuse=fuse,
                    compile=compile)

    @classmethod
    def from_model(cls, model, config: dict, tokenizer, *, ref: ModelRef | None = None, **kw) -> "NativeModel":
        """Wrap a model already in memory (benchmarks, tests); its ref names no file unless given."""
        self = cls.__new__(cls)
        self.path = Path("<memory>")
        self._setup(model, config, tokenizer, ref=ref or ModelRef("hf", self.path), **kw)
        return self

    def _setup(self, model, config, tokenizer, *, ref: ModelRef, n_ctx: int = 4096,
               gpu_layers: GpuLayers | int | str = 0, kv_dtype=None, seed=None, cuda_graph: bool = True,
               fuse: bool = True, compile: bool | str = False) -> None:
        from dsq.models.base import module_device

        self.model, self.config, self.tokenizer = model, config, tokenizer
        self.ref = ref
        if not hasattr(self, "experts"):  # from_model: as the model holds them
            from dsq.models.deepseek_model import CPURoutedExperts

            self.experts = "cpu" if any(isinstance(m, CPURoutedExperts) for m in model.modules()) else "gpu"
        self.n_threads = torch.get_num_threads()
        self.gpu_layers = GpuLayers.parse(gpu_layers)
        self.dtype = model.dtype
        if fuse:
            model.fuse_projections()
        self.arch = gguf_name(config["model_type"])
        self.n_ctx = n_ctx
        self.kv_dtype = parse_dtype(kv_dtype, self.dtype)
        self.cache = model.make_cache(1, n_ctx, self.kv_dtype)
        self.cached: list[int] = []  # tokens whose keys/values fill cache slots 0..len-1
        self.last_prefill_tokens = 0  # how many prompt tokens the last request had to run
        self.head_device = module_device(model.lm_head)
        self.seed = seed
        self._prepare_steps(model, cuda_graph, compile)
        # CPU layers whose decode step is one C call; last: the pointers are taken from the tensors as
        # they end up (StreamedLayers moves the CPU layers' weights into pinned memory)
        self.fused_layers = fused_layer.attach(model)
        if torch.cuda.is_initialized():
            # what fusing the projections and capturing the step freed goes back to the driver: all on
            # an H200, 0.5 GB stayed reserved beside the 4.5 GB allocated (docs/benchmarks.md#split-between-gpu-and-cpu)
            torch.cuda.empty_cache()

    def _prepare_steps(self, model, cuda_graph: bool, compile: bool | str) -> None:
        """The decode step: captured as a CUDA graph with every layer on one GPU (compiled first
        with `compile`); with the layers split between the CPU and one GPU, the GPU part captured
        (_SplitStep); on the CPU, compiled with `compile` (_CompiledStep); eager otherwise, and
        always for a model whose step depends on its tokens (MoE routing: model.graph_safe, unless
        its routed experts are in RAM and queued on the stream, runtime/experts.py)."""
        self._moe = any(hasattr(layer.mlp, "experts") for layer in model.model.layers)
        self._wait_blocks = BLOCKING_WAIT == "1" or (BLOCKING_WAIT != "0" and model.host_work_in_step)
        if not model.graph_safe:
            if compile:
                warnings.warn("--compile: this model routes tokens to experts, so its decode step runs eagerly",
                              stacklevel=3)
            cuda_graph, compile = False, False
        self._step = model
        mode = None if compile is True or compile == "default" else compile
        devs = [str(d) for d in model.layer_devices()]
        # every layer on the CPU, the final norm and the head's rows on the GPU: a split after the last layer
        head_only = set(devs) == {"cpu"} and model.placement is not None and str(model.placement.norm) == "cuda:0"
        on_cpu = set(devs) == {"cpu"} and self.head_device.type == "cpu" and not head_only
        if compile and not on_cpu:  # True, or an inductor mode such as "max-autotune-no-cudagraphs"
            self._step = torch.compile(model, dynamic=False, mode=mode)
        self._graph = None
        self._split = None
        split = (set(devs) == {"cpu", "cuda:0"} and devs == sorted(devs)) or head_only
        self._batch = None  # (B, cache length, cache, captured step) of the last batch (generate_batch)
        if cuda_graph and (str(self.head_device) == "cuda:0" or split):
            if set(devs) == {"cuda:0"}:
                self._graph = self._capture_moe(model) if self._moe else self._capture(self.cache, 1)
            elif split:
                self._split = self._capture_split(model, devs.index("cuda:0") if not head_only else len(devs),
                                                  mode if compile else False)
        # full prompt chunks as CUDA graphs where the decode step is one (every layer on one GPU) and a
        # chunk has no host sync (no routing, or experts on the GPU whose counts stay there)
        self._prefill_graphs = (_PrefillGraphs(model, self.cache) if PREFILL_GRAPH and self._graph is not None
                                and model.prefill_graph_safe else None)
        self._streamed = None  # the CPU layers' prompt chunks on the GPU
        n_cpu = devs.count("cpu")
        if n_cpu and torch.cuda.is_available() and (split or on_cpu):
            self._streamed = StreamedLayers(model, n_cpu, torch.device("cuda:0"), torch.bfloat16)
        self._compiled = None  # the CPU decode step under torch.compile
        if compile and on_cpu and fused_layer.covers_all(model):
            # the one C call per layer decodes faster than inductor's code (docs/benchmarks.md#cpu-decode)
            warnings.warn("--compile: every layer decodes as one C call on the CPU, faster than the compiled "
                          "step, so it is not compiled (DSQ_FUSED_LAYER=0 compiles it instead)", stacklevel=3)
            compile = False
        if compile and on_cpu:
            try:
                self._compiled = _CompiledStep(model, self.cache, 1, mode)
            except Exception as e:  # noqa: BLE001 - any compile failure: the eager step still works
                warnings.warn(f"torch.compile of the CPU decode step failed, decoding eagerly: "
                              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", stacklevel=3)

    # -- tokenizer interface shared with the llama.cpp backend ----------------------------
    def tokenize(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos, special=special)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def is_eog(self, token: int) -> bool:
        return self.tokenizer.is_eog(token)

    def has_token(self, text: str) -> bool:
        return self.tokenizer.has(text)

    def longest_token_bytes(self) -> int:
        return self.tokenizer.longest_token_bytes()

    def chat_template(self) -> str | None:
        return self.tokenizer.chat_template()

    @property
    def bos_token(self) -> str:
        return self.tokenizer.bos_token

    @property
    def eos_token(self) -> str:
        return self.tokenizer.eos_token

    @property
    def add_bos(self) -> bool:
        return self.tokenizer.add_bos

    # -- compute --------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the cached prefix: the next request prefills its whole prompt."""
        self.cached = []

    @torch.inference_mode()
    def logits(self, tokens: list[int]):
        """Logits for every position of one sequence, without touching the chat cache. (T, V)."""
        out = self.model(torch.tensor([tokens]))
        return out[0].float().cpu().numpy()

    @torch.inference_mode()
    def logits_batch(self, windows: list[list[int]]):
        """logits() of several sequences of one length in one forward pass. (B, T, V)."""
        return self.model(torch.tensor(windows)).float().cpu().numpy()

    def _prefill(self, ids: list[int], start: int, cache, pad: torch.Tensor) -> torch.Tensor:
        """Run ids (B, T) into cache slots start.. ; return the last position's logits (B, V). On the
        CPU's avx2 kernels the prompt rounds x to int8 as decode does (dispatch.int8_prefill);
        logits() keeps the float model."""
        with dispatch.int8_prefill():
            return self._prefill_chunks(ids, start, cache, pad)

    def _prefill_chunks(self, ids: list[int], start: int, cache, pad: torch.Tensor) -> torch.Tensor:
        dev = self.head_device
        x = torch.as_tensor(ids, dtype=torch.long)
        if x.ndim == 1:
            x = x[None]
        out, streamed = None, False
        for i in range(0, x.shape[1], PREFILL_CHUNK):
            chunk = x[:, i:i + PREFILL_CHUNK]
            slots = torch.arange(start + i, start + i + chunk.shape[1])
            kv_len = start + i + chunk.shape[1]
            if self._streamed is not None and STREAM_MIN_ROWS and chunk.numel() >= STREAM_MIN_ROWS:
                out, streamed = self._streamed_prefill(chunk, slots, cache, pad, kv_len), True
            elif self._prefill_graphs is not None and cache is self.cache and self._prefill_graphs.takes(chunk, start + i):
                out = self._prefill_graphs(chunk, start + i)
            else:
                out = self.model(chunk, slots, cache, pad, kv_len=kv_len, last_only=True)
        if streamed:  # the streamed layers' transient GPU memory goes back (decode holds none of it)
            torch.cuda.empty_cache()
        return out[:, -1].to(dev)

    def _streamed_prefill(self, ids: torch.Tensor, slots: torch.Tensor, cache, pad: torch.Tensor, kv_len: int):
        """A prompt chunk of a split model with its CPU layers run on the GPU (StreamedLayers)."""
        m, n = self.model, self._streamed.n
        pad = pad.cpu() if pad is not None else torch.zeros(ids.shape[0], dtype=torch.long)
        x = self._streamed.run(m.embed(ids), slots, cache, pad, kv_len)
        if n == len(m.model.layers) and m.placement is not None:
            # every layer streamed: x is on the GPU, where the placement has the last layer on the CPU;
            # it goes to the final norm's device itself (a head in RAM: back to the CPU)
            x = cross_device(x[:, -1:], m.placement.norm, m.dtype)
        x = m.forward_layers(x, n, len(m.model.layers), slots, cache, pad, kv_len)
        return m.head(x, last_only=True)

    def _decode(self, tok: torch.Tensor, slot: int, cache, pad: torch.Tensor) -> torch.Tensor:
        """One step for (B,) tokens at cache slot `slot`; logits (B, V)."""
        if self._graph is not None and cache is self.cache:
            return self._graph(tok[:, None], slot, pad)[:, -1]
        if self._split is not None and cache is self.cache:
            return self._split(tok[:, None], slot, pad)[:, -1]
        slots = torch.tensor([slot], device=tok.device)
        if self._compiled is not None and cache is self.cache:
            return self._compiled(tok[:, None], slots, cache, pad, slot + 1)[:, -1]
        return self.model(tok[:, None], slots, cache, pad, kv_len=slot + 1, last_only=True)[:, -1]

    def _reuse_prefix(self, prompt_ids: list[int]) -> int:
        """Keep the cached prefix the prompt shares (at least its last token is run again, for fresh
        logits); returns its length, and counts the prompt tokens left to run."""
        keep = 0
        for a, b in zip(self.cached, prompt_ids):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(prompt_ids) - 1)
        self.cached = self.cached[:keep]
        self.last_prefill_tokens = len(prompt_ids) - keep
        return keep

    @torch.inference_mode()
    def stream(self, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int,
               stats: GenStats | None = None, ignore_eos: bool = False) -> Iterator[TokenEvent]:
        stats = stats if stats is not None else GenStats()
        if len(prompt_ids) >= self.n_ctx:
            raise DsqError(f"the prompt is {len(prompt_ids)} tokens, the context holds {self.n_ctx}",
                           "pass a larger --ctx or a shorter prompt")
        if not prompt_ids:
            raise DsqError("the prompt is empty")
        sampler = Sampler(sampling, self.head_device)
        budget = max(1, min(max_tokens, self.n_ctx - len(prompt_ids)))  # one token at least, as llama.cpp's
        pad = torch.zeros(1, dtype=torch.long, device="cuda" if self._graph is not None else None)
        keep = self._reuse_prefix(prompt_ids)
        stats.start(len(prompt_ids))
        logits = self._prefill(prompt_ids[keep:], keep, self.cache, pad)
        self.cached = list(prompt_ids)
        recent = torch.tensor([prompt_ids[-_RECENT:]], device=self.head_device)
        decoder = _Decoder(self, sampler, self.cache, pad, self._graph, recent, window=_RECENT, cached=self.cached)
        detok = self.tokenizer.stream()
        try:
            for (t,) in decoder.steps(logits, len(prompt_ids), budget):
                if not stats.take(t, not ignore_eos and self.is_eog(t)):
                    break
                text = detok.push(t)
                if text:
                    yield TokenEvent(t, text)
        finally:
            stats.finish()
        tail = detok.flush()
        if tail:
            yield TokenEvent(-1, tail)

    def _capture_moe(self, model) -> _GraphedStep | None:
        """A MoE step with its experts in RAM captured as one CUDA graph (their C calls as host
        nodes); a capture that fails costs a warning, and the step runs eagerly (still without a
        host sync per layer)."""
        try:
            return self._capture(self.cache, 1)
        except Exception as e:  # noqa: BLE001 - the eager step works without the graph
            warnings.warn(f"capturing the MoE decode step failed, decoding eagerly: "
                          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", stacklevel=3)
            torch.cuda.synchronize()
            return None

    def _capture_split(self, model, start: int, compile_mode) -> _SplitStep:
        """The split decode step, its GPU part compiled when asked; a compile that fails to capture
        costs a warning and the eager part is captured instead."""
        try:
            return _SplitStep(model, self.cache, start, 1, compile_mode)
        except Exception as e:  # noqa: BLE001 - the compiled part failed: capture the eager one
            if compile_mode is False:
                raise
            warnings.warn(f"torch.compile of the decode step failed, decoding without it: "
                          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", stacklevel=3)
            return _SplitStep(model, self.cache, start, 1)

    def _capture(self, cache, B: int) -> _GraphedStep:
        """The decode step for B sequences over `cache`, captured as a CUDA graph. A compiled step
        that fails to capture is dropped for the eager one (with a warning), for good."""
        try:
            return _GraphedStep(self._step, cache, B)
        except Exception as e:  # noqa: BLE001 - the compiled step failed: capture the eager one
            if self._step is self.model:
                raise
            warnings.warn(f"torch.compile of the decode step failed, decoding without it: "
                          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", stacklevel=3)
            self._step = self.model
            return _GraphedStep(self.model, cache, B)

    def _batch_step(self, B: int, length: int):
        """(cache, captured decode step) for a batch of B sequences of up to `length` tokens, kept
        for the next batch of that size that fits (the cache is `length` rounded up to a power of
        two, at most the context: a step attends over all of it); None where steps are not
        captured (CPU, layers split) or the GPU has no room for it (the eager step then runs)."""
        if self._graph is None:
            return None
        if self._batch is None or self._batch[0] != B or self._batch[1] < length:
            self._batch = None  # free the last one first
            cap = min(self.n_ctx, max(256, 1 << (length - 1).bit_length()))
            try:
                cache = self.model.make_cache(B, cap, self.kv_dtype)
                self._batch = (B, cap, cache, self._capture(cache, B))
            except Exception as e:  # noqa: BLE001 - out of memory, or a MoE step that did not capture
                if not isinstance(e, torch.cuda.OutOfMemoryError) and not self._moe:
                    raise
                cache = None  # release it before handing the memory back
                torch.cuda.empty_cache()
                return None
        return self._batch[2], self._batch[3]

    @torch.inference_mode()
    def generate_batch(self, prompts: list[list[int]], sampling: SamplingParams, max_tokens: int,
                       ignore_eos: bool = False, stats: GenStats | None = None) -> list[list[int]]:
        """Several prompts at once (left-padded into one batch). Returns the generated ids per
        prompt; `stats` gets the timings (rates count every sequence's tokens). On one GPU the decode
        step of each batch size is captured as a CUDA graph once, as the single-sequence one is."""
        if not prompts or any(not p for p in prompts):
            raise DsqError("every prompt of a batch needs at least one token")
        B, longest = len(prompts), max(len(p) for p in prompts)
        length = longest + max_tokens
        if length > self.n_ctx:
            raise DsqError(f"the longest prompt plus --max-tokens is {length} tokens, the context holds {self.n_ctx}",
                           "pass a larger --ctx")
        stats = stats if stats is not None else GenStats()
        captured = self._batch_step(B, length)
        cache, graph = captured if captured else (self.model.make_cache(B, length, self.kv_dtype), None)
        ids, pad = _left_padded(prompts, longest)
        sampler = Sampler(sampling, self.head_device)
        stats.start(sum(len(p) for p in prompts))
        logits = self._prefill(ids, 0, cache, pad)
        recent = ids[:, -_RECENT:].to(self.head_device)
        decoder = _Decoder(self, sampler, cache, pad.cuda() if graph else pad, graph, recent, window=recent.shape[1])
        out: list[list[int]] = [[] for _ in range(B)]
        done = [False] * B
        try:
            for toks in decoder.steps(logits, longest, max_tokens):
                stats.take_step(B, self._keep_rows(toks, out, done, ignore_eos))
                if all(done):
                    break
        finally:
            stats.finish()
        if all(done):
            stats.finish_reason = "stop"
        return out

    def _keep_rows(self, toks: list[int], out: list[list[int]], done: list[bool], ignore_eos: bool) -> int:
        """Append each unfinished row's token to its output, or mark the row done at an
        end-of-generation token; returns how many tokens were kept."""
        kept = 0
        for i, t in enumerate(toks):
            if done[i]:
                continue
            if not ignore_eos and self.is_eog(t):
                done[i] = True
            else:
                out[i].append(t)
                kept += 1
        return kept


def _left_padded(prompts: list[list[int]], longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as one (B, longest) batch, each at the right end; and each one's padding (B,)."""
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.tensor(p)
    return ids, torch.tensor([longest - len(p) for p in prompts])


class _Decoder:
    """The decode loop of `stream` and `generate_batch`: B rows a step, each step's tokens out on
    the host. A step samples the rows' next tokens (with the repeat penalty over the last
    `window` tokens of each row), hands them to the host, then runs them through the model at the
    next cache slot.

    With a captured step (a CUDA graph), step k+1 is launched before step k's tokens reach the host
    (through pinned memory), so the CPU's per-token work (sync, detokenize, yield) overlaps the
    GPU's. A launched step whose tokens turn out to end generation only wrote a cache slot that
    `cached` does not claim: `cached` (the tokens whose keys/values fill the cache, row 0) gains a
    token once its step has run."""

    def __init__(self, nm: NativeModel, sampler: Sampler, cache, pad: torch.Tensor, graph, recent: torch.Tensor,
                 window: int, cached: list[int] | None = None):
        self.nm, self.sampler, self.cache, self.pad, self.graph = nm, sampler, cache, pad, graph
        self.recent, self.window, self.cached = recent, window, cached
        pinned = graph is not None
        self.host = torch.empty(recent.shape[0], dtype=torch.long, pin_memory=True) if pinned else None
        self.ready = torch.cuda.Event(blocking=nm._wait_blocks) if pinned else None

    def steps(self, logits: torch.Tensor, start: int, n: int) -> Iterator[list[int]]:
        """The tokens of up to n steps after the prompt's `logits`, the first step's model run at
        cache slot `start`. Stop iterating to end early: no step is run for tokens nobody took."""
        for step in range(n):
            tok = self._sample(logits)
            ahead = None
            if self.graph is not None and step < n - 1:
                ahead = self.graph(tok[:, None], start + step, self.pad)[:, -1]
            toks = self._to_host(tok)
            yield toks
            if step == n - 1:
                return
            logits = ahead if ahead is not None else self.nm._decode(tok, start + step, self.cache, self.pad)
            if self.cached is not None:
                self.cached.append(toks[0])
            keep = self.recent[:, 1:] if self.recent.shape[1] >= self.window else self.recent
            self.recent = torch.cat((keep, tok[:, None]), dim=1)

    def _sample(self, logits: torch.Tensor) -> torch.Tensor:
        tok = self.sampler(logits, self.recent)
        if self.host is not None:
            self.host.copy_(tok, non_blocking=True)
            self.ready.record()
        return tok

    def _to_host(self, tok: torch.Tensor) -> list[int]:
        if self.host is None:
            return tok.tolist()
        self.ready.synchronize()
        return self.host.tolist()
