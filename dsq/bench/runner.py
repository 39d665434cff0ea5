"""`dsq bench` measurements: prefill and decode speed, TTFT, TPOT, peak RSS and VRAM, over
repeats and a --gpu-layers sweep, one record per run."""

from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable

from dsq.bench.metrics import release_memory
from dsq.errors import DsqError

if TYPE_CHECKING:
    from dsq.bench.metrics import PeakMemory
    from dsq.runtime.backend import Backend


@dataclass
class BenchRecord:
    backend: str
    gpu_layers: str  # as asked ("all" stays "all")
    gpu_layers_effective: int
    repeat: int
    prompt_tokens: int
    gen_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    ttft_ms: float
    tpot_ms: float
    peak_rss_mb: float  # above base_rss_mb: this configuration's own
    peak_vram_mb: float | None  # above the GPU memory in use before loading; None without a GPU
    load_s: float
    threads: int
    batch: int = 1  # sequences decoded together; token counts and rates cover all of them
    base_rss_mb: float = 0.0  # the process before loading (Python, libraries, earlier configurations' leftovers)
    experts: str = "gpu"  # where a MoE model's routed experts ran: with their layers, or "cpu" (in RAM)
    head: str = "gpu"  # where the output head ran: "cpu" in RAM (a split's --head cpu, or nothing on the GPU)
    peak_vram_mb_per_gpu: list[float] | None = None  # each GPU's own peak above its use before loading (NVML's order)
    tensor_split: list[float] | None = None  # each GPU's share of the GPU layers, as used (None: one GPU or none)

    def as_dict(self) -> dict:
        return asdict(self)


def bench_prompt(model, n_tokens: int) -> list[int]:
    """Exactly n_tokens of real English text (Python's pydoc topics), BOS first if the model wants it."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids: list[int] = []
    step = max(4 * n_tokens, 2000)
    pos = 0
    while len(ids) < n_tokens and pos < len(text):
        ids = model.tokenize(text[: pos + step], add_bos=model.add_bos, special=False)
        pos += step
    if len(ids) < n_tokens:
        raise DsqError(f"--prompt-tokens {n_tokens} is more than the benchmark text holds", "ask for fewer")
    return ids[:n_tokens]


def bench_prompts(model, n_tokens: int, batch: int) -> list[list[int]]:
    """`batch` different prompts of exactly n_tokens each: consecutive pieces of the benchmark
    text (each with BOS first if the model wants it)."""
    if batch == 1:
        return [bench_prompt(model, n_tokens)]
    bos = 1 if model.add_bos else 0
    if n_tokens <= bos:
        raise DsqError(f"--prompt-tokens {n_tokens} leaves no text in a prompt", "ask for more")
    ids = bench_prompt(model, bos + batch * (n_tokens - bos))
    head, body = ids[:bos], ids[bos:]
    per = n_tokens - bos
    return [head + body[i * per:(i + 1) * per] for i in range(batch)]


def _generate(m, prompts: list[list[int]], sampling, n: int, stats=None) -> None:
    """n tokens for each prompt, past end-of-generation: one prompt streamed, several as a batch."""
    if len(prompts) == 1:
        for _ in m.stream(prompts[0], sampling, n, stats, ignore_eos=True):
            pass
    else:
        m.generate_batch(prompts, sampling, n, ignore_eos=True, stats=stats)


def run_bench(model, *, backends=("llama.cpp",), gpu_layers=("0",), prompt_tokens: int = 512,
              gen_tokens: int = 128, repeat: int = 3, threads: int | None = None, ctx: int | None = None,
              warmup: bool = True, on_record: Callable[[BenchRecord], None] | None = None,
              on_status: Callable[[str], None] | None = None, model_opts: dict | None = None,
              batch: tuple[int, ...] = (1,)) -> list[BenchRecord]:
    """Benchmark one model (a path, or None for the built-in) across backends x gpu_layers (each a
    GpuLayers, or what GpuLayers.parse takes) x batch sizes (above 1: the native backend's batched
    decode, prompts of the same length)."""
    from dsq.bench.metrics import cuda_context_bytes
    from dsq.runtime.gpu_layers import GpuLayers

    _check_settings(backends, prompt_tokens, gen_tokens, repeat, batch)
    n_ctx = bench_ctx(ctx, prompt_tokens, gen_tokens)
    cuda_context_bytes()  # made before the first baseline: no configuration counts it
    say = on_status or (lambda s: None)
    records: list[BenchRecord] = []
    for backend in backends:
        for gl in [GpuLayers.parse(g) for g in gpu_layers]:
            say(f"{backend}: loading with --gpu-layers {gl}")
            loaded = _load(model, backend, gl, n_ctx, threads, (model_opts or {}).get(backend, {}))
            for B in batch:
                for rec in _runs(loaded, B, prompt_tokens, gen_tokens, repeat, warmup, say):
                    records.append(rec)
                    if on_record:
                        on_record(rec)
            del loaded
            release_memory()  # what this configuration held, before the next one takes its baselines
    return records


def _load(model, backend: str, gl, n_ctx: int, threads: int | None, opts: dict) -> _Loaded:
    """Load one configuration, timing it and sampling its memory above the process's before."""
    from dsq.bench.metrics import PeakMemory, gpus_used_bytes, rss_bytes
    from dsq.runtime.engine import load

    release_memory()
    base_gpus, base_rss = gpus_used_bytes(), rss_bytes()
    base_gpu = None if base_gpus is None else sum(base_gpus)
    t0 = time.perf_counter()
    with PeakMemory(baseline_gpu=base_gpu, baseline_rss=base_rss, baseline_gpus=base_gpus) as load_mem:
        m = load(model, backend=backend, ctx=n_ctx, threads=threads, gpu_layers=gl, **opts)
    return _Loaded(m, str(gl), time.perf_counter() - t0, load_mem, base_gpu, base_rss, base_gpus)


def bench_ctx(ctx: int | None, prompt_tokens: int, gen_tokens: int) -> int:
    """The context a bench run loads with: `ctx`, and at least the prompt and the generated tokens."""
    return max(ctx or 0, prompt_tokens + gen_tokens + 8)


def _check_settings(backends, prompt_tokens: int, gen_tokens: int, repeat: int, batch: tuple[int, ...]) -> None:
    from dsq.runtime.engine import BACKENDS

    if prompt_tokens < 1 or gen_tokens < 2 or repeat < 1:
        raise DsqError("--prompt-tokens >= 1, --gen-tokens >= 2 and --repeat >= 1 are needed")
    if any(b < 1 for b in batch):
        raise DsqError("--batch sizes must be at least 1")
    if any(b > 1 for b in batch) and any(be != "native" for be in backends):
        raise DsqError("--batch above 1 runs on the native backend only", "pass --backend native")
    for b in backends:
        if b not in BACKENDS:
            raise DsqError(f"unknown backend {b!r}", f"choose from: {', '.join(BACKENDS)}")


@dataclass
class _Loaded:
    """A model loaded for the bench: --gpu-layers as asked, load time and peak memory."""

    model: Backend
    asked: str  # str(GpuLayers): as the user typed it
    load_s: float
    load_mem: PeakMemory  # peak memory while loading
    base_gpu: int | None  # GPU memory in use before loading (None without a GPU)
    base_rss: int  # the process's RSS before loading
    base_gpus: list[int] | None = None  # each GPU's memory in use before loading


def _runs(loaded: _Loaded, B: int, prompt_tokens: int, gen_tokens: int, repeat: int, warmup: bool, say):
    """The timed runs of one loaded model at batch size B, a record each."""
    from dsq.bench.metrics import PeakMemory
    from dsq.runtime.generate import GenStats
    from dsq.runtime.sampling import SamplingParams

    m = loaded.model
    greedy = SamplingParams(temperature=0.0, top_k=0, top_p=1.0)
    prompts = bench_prompts(m, prompt_tokens, B)
    # warm-up on the real prompts: one-time work (kernel autotuning for the prefill's shapes,
    # compiling and capturing this batch size's step) stays out of the timed runs
    if warmup:
        m.reset()
        _generate(m, prompts, greedy, 4)
    for r in range(repeat):
        say(f"{m.backend} --gpu-layers {loaded.asked}" + (f" --batch {B}" if B > 1 else "") + f": run {r + 1}/{repeat}")
        st = GenStats()
        m.reset()  # no prefix reuse between repeats: every run prefills the whole prompt
        with PeakMemory(baseline_gpu=loaded.base_gpu, baseline_rss=loaded.base_rss,
                        baseline_gpus=loaded.base_gpus) as mem:
            _generate(m, prompts, greedy, gen_tokens, st)
        yield _record(loaded, r, B, st, mem)


def _record(loaded: _Loaded, r: int, B: int, st, mem) -> BenchRecord:
    m = loaded.model
    return BenchRecord(
        backend=m.backend, gpu_layers=loaded.asked, gpu_layers_effective=m.gpu_layers.n_gpu_layers, repeat=r,
        prompt_tokens=st.prompt_tokens, gen_tokens=st.generated_tokens,
        prefill_tok_s=round(st.prefill_tok_s, 2), decode_tok_s=round(st.decode_tok_s, 2),
        ttft_ms=round(st.ttft_s * 1000, 3), tpot_ms=round(st.tpot_ms, 3),
        peak_rss_mb=_mib(max(mem.peak_rss, loaded.load_mem.peak_rss)),
        peak_vram_mb=None if mem.peak_gpu is None else _mib(max(mem.peak_gpu, loaded.load_mem.peak_gpu or 0)),
        load_s=round(loaded.load_s, 3), threads=m.n_threads, batch=B, base_rss_mb=_mib(loaded.base_rss),
        experts=getattr(m, "experts", "gpu"), head=_head_place(m),
        peak_vram_mb_per_gpu=_peaks_each(mem.peak_gpus, loaded.load_mem.peak_gpus),
        tensor_split=_split_used(m))


def _peaks_each(run: list[int] | None, load: list[int] | None) -> list[float] | None:
    """Each GPU's peak over the load and the run, in MiB."""
    if run is None:
        return None
    return [_mib(max(a, b)) for a, b in zip(run, load if load and len(load) == len(run) else run)]


def _split_used(m) -> list[float] | None:
    """The shares the GPU layers were divided by, where several GPUs held them."""
    split = getattr(m, "tensor_split", None)
    return list(split) if split is not None and len(split) > 1 else None


def _head_place(m) -> str:
    """Where a loaded model's output head runs: "gpu", "cpu", or the share of its rows on the GPU
    (--head 0.6, native) (llama.cpp: on the GPU with every layer, where its build offloads)."""
    dev = getattr(m, "head_device", None)
    if dev is not None:
        rows = getattr(m.model.lm_head, "gpu_rows", None)  # (qmodules.RowSplitLinear)
        if rows is not None:
            return f"{rows.out_features / m.model.lm_head.out_features:.2g}"
        return "gpu" if dev.type == "cuda" else "cpu"
    from dsq.runtime.llama_cpp_backend import supports_gpu_offload

    return "gpu" if m.gpu_layers.n_gpu_layers < 0 and supports_gpu_offload() else "cpu"


def _mib(n: int) -> float:
    return round(n / 2**20, 1)


def machine_info() -> dict:
    import os

    from dsq.runtime.llama_cpp_backend import supports_gpu_offload
    from dsq.runtime.machine import cpu_model
    from dsq.runtime.placement import detect_gpu

    gpu = detect_gpu()
    return {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "gpu": gpu.name if gpu else None,
            "llama_cpp_gpu_offload": supports_gpu_offload(), "python": platform.python_version(), **cpu_builds()}


def cpu_builds() -> dict:
    """What computes on the CPU: the native kernels' build (DSQ_CPU_ISA forces one) and the
    instruction sets llama.cpp was compiled with, from its libraries (LLAMA_CPP_LIB_PATH's, if set)."""
    import os

    from dsq.kernels import cpu
    from dsq.runtime.llama_cpp_backend import system_info

    try:
        lib, isa = cpu.library()
        native = isa if lib is not None else f"none ({isa})"
    except (RuntimeError, ValueError) as e:
        native = f"none ({e})"
    flags = [kv.split("=")[0].replace("CPU :", "").strip() for kv in system_info().split("|")
             if kv.strip().endswith("= 1")]
    return {"native_cpu_kernels": native, "llama_cpp_cpu": " ".join(flags),
            "llama_cpp_lib": os.environ.get("LLAMA_CPP_LIB_PATH") or "llama_cpp's own"}


def run_chat_bench(model, *, backends=("llama.cpp",), turns: int = 8, user_tokens: int = 64, gen_tokens: int = 16,
                   threads: int | None = None, ctx: int = 4096, on_status=None,
                   model_opts: dict | None = None) -> list[dict]:
    """A growing conversation: TTFT of each turn, with the history kept in the KV cache.

    With prefix reuse, turn N prefills only its new message, so TTFT stays flat as the history grows.
    """
    from pydoc_data.topics import topics

    from dsq.runtime.conversation import Conversation
    from dsq.runtime.engine import load
    from dsq.runtime.sampling import SamplingParams

    text = "\n\n".join(topics[k] for k in sorted(topics))
    rows = []
    for backend in backends:
        if on_status:
            on_status(f"{backend}: loading")
        m = load(model, backend=backend, ctx=ctx, threads=threads, **((model_opts or {}).get(backend, {})))
        conversation = Conversation(m, sampling=SamplingParams(temperature=0), max_tokens=gen_tokens)
        pos = 0
        for turn in range(turns):
            ids = m.tokenize(text[pos:pos + 8 * user_tokens], add_bos=False, special=False)[:user_tokens]
            msg = m.detokenize(ids)
            pos += len(msg)
            if on_status:
                on_status(f"{backend}: turn {turn + 1}/{turns}")
            conversation.send(msg)
            st = conversation.last_stats
            rows.append({"backend": backend, "turn": turn + 1, "history_tokens": st.prompt_tokens,
                         "ttft_ms": round(st.ttft_s * 1000, 2),
                         "prefilled_tokens": getattr(m, "last_prefill_tokens", None)})
        del m
    return rows
