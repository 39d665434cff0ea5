"""Start `dsq serve`: load the model on the native backend, start the engine loop, run uvicorn
until SIGTERM or Ctrl-C, then let running requests finish (uvicorn's graceful shutdown waits for
open connections) and stop the engine."""

from __future__ import annotations

import signal
import sys
import time

from dsq.errors import DsqError

DRAFT_TOKENS = 4  # --spec-tokens with --draft when not given: as measured, not tuned (docs/benchmarks.md#dsq-serve)
# the engine's thread gets the GIL back from the HTTP loop's within this once its GPU step is done
# (Python's default, 5 ms, is a third of a 32-row decode step); not yet A/B'd: docs/benchmarks.md#dsq-serve
SWITCH_INTERVAL_S = 0.001
# on a GPU with neither --kv-tokens nor --kv-memory, the paged cache takes up to this share of the
# memory free after loading: the rest is the warm-up's captured graphs and a prompt chunk's
# activations (docs/benchmarks.md#dsq-serve)
KV_SHARE = 0.7


def model_id(nm) -> str:
    """The name clients pass as `model`: the Hugging Face repo id it was fetched by, else the
    model file's or directory's name, without .gguf."""
    if nm.ref.repo:
        return nm.ref.repo
    name = nm.ref.path.name
    return name[:-5] if name.endswith(".gguf") else name


def check_port(host: str, port: int) -> None:
    """Fail before the model loads when HOST:PORT cannot be listened on."""
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise DsqError(f"cannot listen on {host}:{port}: {e.strerror or e}",
                       "pick another --port, or stop what listens there") from None


def kv_dtype(name: str | None):
    """--kv-dtype: fp8 (e4m3, a scale per token and head), bf16, fp16, fp32, or None (the model's)."""
    from dsq.runtime.native import parse_dtype
    from dsq.serve.paged import FP8, FP8_NAMES

    if name is not None and name.lower() in FP8_NAMES:
        return FP8
    return parse_dtype(name, None) if name else None


def build(model: str | None, *, ctx: int, threads: int | None, dtype: str | None, kv_tokens: int | None,
          block_size: int, kv_dtype_name: str | None = None, kv_memory_mb: float | None = None,
          spec_tokens: int | None = None, draft: str | None = None, gpu_layers: str = "0", max_seqs: int,
          prefill_chunk: int, prefix_cache: bool, experts: str = "auto", tp: int = 1, console=None,
          revision: str | None = None):
    """(engine, api) for MODEL (a path or a Hugging Face repo id at REVISION) on the native backend
    (and DRAFT, a draft model, with it; `experts`: where a MoE model's routed experts run,
    runtime/experts.py; `tp`: ranks the model is split over, serve/tp.py)."""
    from dsq.runtime.engine import load
    from dsq.runtime.model_ref import resolve_model

    kv_dt = kv_dtype(kv_dtype_name)  # a bad name fails before the model loads
    if kv_tokens is not None and kv_memory_mb is not None:
        raise DsqError("--kv-tokens and --kv-memory both size the KV cache", "pass one of them")
    if kv_memory_mb is not None and kv_memory_mb <= 0:
        raise DsqError(f"--kv-memory must be > 0 MiB, got {kv_memory_mb}")
    if block_size < 1 or block_size & (block_size - 1):
        raise DsqError(f"--block-size must be a power of two, got {block_size}")
    if spec_tokens is None:
        spec_tokens = DRAFT_TOKENS if draft is not None else 0
    if spec_tokens < 0:
        raise DsqError(f"--spec-tokens must be >= 0, got {spec_tokens}", "use 0 to turn speculative decoding off")
    if draft is not None and spec_tokens == 0:
        raise DsqError("--draft proposes --spec-tokens tokens a step, and --spec-tokens is 0",
                       "pass --spec-tokens 1 or more (4 if left out), or drop --draft")
    if max_seqs < 1:
        raise DsqError(f"--max-seqs must be at least 1, got {max_seqs}")
    if prefill_chunk < 1:
        raise DsqError(f"--prefill-chunk must be at least 1, got {prefill_chunk}")
    kv_bytes = int(kv_memory_mb * 2**20) if kv_memory_mb is not None else None
    if tp != 1:
        from dsq.serve import tp as tensor_parallel

        if draft is not None:
            raise DsqError("--draft runs beside one rank, not --tp yet", "drop --draft or --tp")
        load_kw, cuda = tensor_parallel.plan(tp, model, gpu_layers=gpu_layers, threads=threads, console=console,
                                             revision=revision)
        ranks, nm = tensor_parallel.start(tp, cuda, {**load_kw, "ctx": ctx, "dtype": dtype, "cuda_graph": False,
                                                     "experts": experts}, console)
        try:
            return _build(nm, ranks, ctx=ctx, dtype=dtype, kv_tokens=kv_tokens, kv_bytes=kv_bytes, kv_dt=kv_dt,
                          block_size=block_size, max_seqs=max_seqs, prefill_chunk=prefill_chunk,
                          prefix_cache=prefix_cache, spec_tokens=spec_tokens, threads=threads, gpu_layers=gpu_layers,
                          draft=None, console=console)
        except BaseException:
            ranks.close()
            raise
    ref = resolve_model(model, console, revision)
    # one device: at --gpu-layers 0 the head stays in RAM with the layers (not its rows alone on a GPU)
    nm = load(ref, backend="native", ctx=ctx, threads=threads, dtype=dtype, gpu_layers=gpu_layers, console=console,
              cuda_graph=False, experts=experts, head="cpu")
    return _build(nm, None, ctx=ctx, dtype=dtype, kv_tokens=kv_tokens, kv_bytes=kv_bytes, kv_dt=kv_dt,
                  block_size=block_size, max_seqs=max_seqs, prefill_chunk=prefill_chunk, prefix_cache=prefix_cache,
                  spec_tokens=spec_tokens, threads=threads, gpu_layers=gpu_layers, draft=draft, console=console)


def _build(nm, ranks, *, ctx, dtype, kv_tokens, kv_bytes, kv_dt, block_size, max_seqs, prefill_chunk, prefix_cache,
           spec_tokens, threads, gpu_layers, draft, console):
    """build's engine and API over the loaded model `nm` (rank 0's share with `ranks`)."""
    from dsq.serve.api import Api
    from dsq.serve.engine import Engine
    from dsq.serve.paged import supported

    if not supported(nm.model):
        raise DsqError(f"dsq serve runs llama, qwen2, gemma3 and deepseek models; {nm.arch} is not served yet",
                       "use dsq run or dsq chat for this model")
    devices = {str(d) for d in nm.model.layer_devices()} | {str(nm.head_device)}
    if len(devices) > 1:
        raise DsqError(f"dsq serve runs a model on one device; this one is split ({', '.join(sorted(devices))})",
                       "pass --gpu-layers all (or leave it out for the CPU)")
    nm.cache = None  # the single-sequence cache: the engine keeps its own pool
    draft_nm = None
    if draft is not None:
        draft_nm = _load_draft(draft, nm, ctx=ctx, threads=threads, dtype=dtype, gpu_layers=gpu_layers,
                               console=console)
    if kv_tokens is None and kv_bytes is None and ranks is None:
        kv_bytes = default_kv_bytes(nm, max_seqs, block_size, kv_dt, draft_nm)
    engine = Engine(nm, kv_tokens=kv_tokens, kv_bytes=kv_bytes, block_size=block_size, max_seqs=max_seqs,
                    prefill_chunk=prefill_chunk, prefix_cache=prefix_cache, kv_dtype=kv_dt,
                    spec_tokens=spec_tokens, draft=draft_nm, ranks=ranks)
    return engine, Api(engine, model_id(nm))


def default_kv_bytes(nm, max_seqs: int, block_size: int, kv_dt, draft=None) -> int | None:
    """The paged cache's bytes when neither --kv-tokens nor --kv-memory sizes it, on one device: on
    a GPU, room for max_seqs sequences of the whole context (so that as many requests as may run
    never preempt each other), as far as KV_SHARE of the memory free after loading holds (with a
    `draft` model, its pool of as many blocks in that share too), and never less than the CPU's
    default; None on the CPU (the engine's default: 4 x --ctx tokens)."""
    import torch

    from dsq.serve.paged import PagedKV

    dev = nm.head_device
    if dev.type != "cuda":
        return None
    per_block = PagedKV.bytes_per_block(nm.model, block_size, kv_dt or nm.model.dtype)
    both = per_block + (PagedKV.bytes_per_block(draft.model, block_size, kv_dt or draft.model.dtype) if draft else 0)
    need = max_seqs * -(-(nm.n_ctx + 1) // block_size)
    floor = -(-4 * nm.n_ctx // block_size)
    free, _ = torch.cuda.mem_get_info(dev)
    return max(min(need, int(free * KV_SHARE) // both), floor) * per_block


def _load_draft(draft: str, nm, *, ctx: int, threads, dtype, gpu_layers: str, console):
    """--draft: the draft model on the target's device, refused unless it shares the target's
    vocabulary and PagedKV can run it."""
    from dsq.runtime.engine import load
    from dsq.serve.draft import check_draft
    from dsq.serve.paged import supported

    try:
        dm = load(None if draft == "builtin" else draft, backend="native", ctx=ctx, threads=threads, dtype=dtype,
                  gpu_layers=gpu_layers, console=console, cuda_graph=False, head="cpu")
    except DsqError as e:
        hint = e.hint and e.hint.replace("nothing for the built-in model", "'builtin' for the built-in model")
        raise type(e)(f"--draft: {e.message}", hint) from None
    if not supported(dm.model):
        raise DsqError(f"--draft {draft}: a {dm.arch} model cannot be a draft model yet",
                       "pick a llama, qwen2, gemma3 or deepseek draft from the target's family")
    where = {str(d) for d in dm.model.layer_devices()} | {str(dm.head_device)}
    if where != {str(nm.head_device)}:
        raise DsqError(f"--draft {draft} runs on {', '.join(sorted(where))}, the target on {nm.head_device}",
                       "keep both on one device: --gpu-layers all (or leave it out for the CPU)")
    check_draft(nm, dm, draft)
    dm.cache = None
    return dm


def _spec_note(engine) -> str:
    if not engine.spec_tokens:
        return ""
    if engine.drafter is None:
        return f", prompt-lookup drafts of {engine.spec_tokens} tokens"
    m = engine.drafter.metrics()
    return (f", draft model {model_id(engine.drafter.nm)} proposing {engine.spec_tokens} tokens, its KV cache "
            f"{m['draft_kv_bytes'] / 2**20:.0f} MiB more")


def _tp_note(engine) -> str:
    if engine.ranks is None:
        return ""
    g = engine.ranks.group
    return f", tensor-parallel over {g.world} ranks ({g.backend}; the KV MiB are each rank's)"


def uvicorn_config(app, host: str, port: int, limits, drain_s: float = 60.0):
    """uvicorn's settings for APP behind `limits` (serve/guard.py): the guard, the deadlines, and
    --max-connections, above which a request gets 503 and its connection closes."""
    import uvicorn

    from dsq.serve.guard import Guard, protocol

    # uvicorn answers 503 once its open connections reach the limit, counting the one asking
    limit = limits.max_connections + 1 if limits.max_connections else None
    # (uvicorn's warnings are one line per refused or malformed request: a hostile client's to write)
    return uvicorn.Config(Guard(app, limits), host=host, port=port, log_level="error", access_log=False,
                          timeout_graceful_shutdown=drain_s, lifespan="off", limit_concurrency=limit,
                          http=protocol(limits.read_timeout, limits.write_timeout))


def run(engine, api, host: str, port: int, drain_s: float = 60.0, limits=None) -> None:
    """Serve API on HOST:PORT behind `limits` (serve/guard.py: API key, body cap, read and write
    deadlines, most connections; its defaults when None) until SIGTERM or Ctrl-C."""
    import uvicorn

    from dsq.serve.guard import Limits

    limits = limits or Limits()
    server = uvicorn.Server(uvicorn_config(api.app(), host, port, limits, drain_s))
    # SIGTERM during the warm-up (minutes on a cold cache) stops it: no request is running yet
    signal.signal(signal.SIGTERM, _stop_warm_up)
    try:
        _warm_up(engine)
        # From here uvicorn takes SIGTERM while it runs (its drain), and re-raises it once it has shut
        # down: ours takes that, so the process ends with status 0. One that comes before uvicorn's
        # handler is in place asks it to exit as soon as it starts. (Set inside the try: a SIGTERM
        # between the warm-up's end and this line still stops the server here.)
        signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    except _WarmUpStopped:
        if engine.ranks is not None:
            engine.ranks.close()
        sys.stderr.write("dsq serve: stopped during the warm-up\n")
        return
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    engine.start()
    for note in getattr(engine.nm, "tp_notes", []):
        sys.stderr.write(f"dsq serve: note: --tp: {note}\n")
    m = engine.metrics()
    sys.stderr.write(f"dsq serve: {api.model_id} on http://{host}:{port}/v1 (native engine, KV cache of "
                     f"{m['kv_blocks_total'] * m['kv_block_size']} tokens: {m['kv_blocks_total']} blocks of "
                     f"{m['kv_block_size']} in {m['kv_dtype']}, {m['kv_bytes'] / 2**20:.0f} MiB, "
                     f"context {engine.n_ctx}, up to {engine.max_seqs} "
                     f"sequences a step{_spec_note(engine)}{_tp_note(engine)}"
                     f"{', API key required' if limits.api_key else ''})\n")
    sys.stderr.flush()
    try:
        server.run()
    finally:
        engine.stop()
        if engine.ranks is not None:
            engine.ranks.close()
    if not server.started:
        raise DsqError(f"could not listen on {host}:{port}", "pick another --port (is one server already there?)")
    sys.stderr.write("dsq serve: stopped\n")


class _WarmUpStopped(BaseException):
    """SIGTERM came during the warm-up (not an Exception: the kernels' guards catch those and go on)."""


def _stop_warm_up(*_) -> None:
    raise _WarmUpStopped


def _warm_up(engine) -> None:
    """The engine's GPU warm-up, with its progress and what it captured on stderr (on the CPU nothing
    compiles: no warm-up)."""
    if engine.device.type == "cuda":
        sys.stderr.write(f"dsq serve: warming up the GPU kernels (batches up to {engine.max_seqs}, prompt chunks "
                         f"up to {engine.prefill_chunk} tokens)...\n")
        sys.stderr.flush()
        t0 = time.perf_counter()
        done = engine.warm_up()
        parts = ", ".join(f"{k} {v:.0f} s" for k, v in done.get("seconds", {}).items())
        took = f"warmed up in {time.perf_counter() - t0:.0f} s" + (f" ({parts})" if parts else "")
        if done["graphs"]:
            lengths = sorted({t for t, _ in done["chunk_graphs"]})
            chunks = f", prompt chunks of {', '.join(map(str, lengths))} tokens" if lengths else ""
            dec = [b for b in done["graphs"] if b <= engine.max_seqs]
            mixed = [b for b in done["graphs"] if b > engine.max_seqs]
            mixed = f", steps with prompt tokens of {', '.join(map(str, mixed))} rows" if mixed else ""
            took += (f"; decode steps of {', '.join(map(str, dec))} rows{mixed}{chunks} captured "
                     f"as CUDA graphs")
        sys.stderr.write(f"dsq serve: {took}\n")
