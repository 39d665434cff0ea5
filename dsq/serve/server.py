"""Start `dsq serve`: load the model on the native backend, start the engine loop, run uvicorn
until SIGTERM or Ctrl-C, then let running requests finish (uvicorn's graceful shutdown waits for
open connections) and stop the engine."""

from __future__ import annotations

import signal
import sys

from dsq.errors import DsqError


def model_id(nm) -> str:
    """The name clients pass as `model`: the model file's or directory's name, without .gguf."""
    name = nm.ref.path.name
    return name[:-5] if name.endswith(".gguf") else name


def build(model: str | None, *, ctx: int, threads: int | None, dtype: str | None, kv_tokens: int | None,
          block_size: int, max_seqs: int, prefill_chunk: int, prefix_cache: bool, console=None):
    """(engine, api) for MODEL on the native backend."""
    from dsq.runtime.engine import load
    from dsq.serve.api import Api
    from dsq.serve.engine import Engine
    from dsq.serve.paged import supported

    if block_size < 1 or block_size & (block_size - 1):
        raise DsqError(f"--block-size must be a power of two, got {block_size}")
    if max_seqs < 1:
        raise DsqError(f"--max-seqs must be at least 1, got {max_seqs}")
    if prefill_chunk < 1:
        raise DsqError(f"--prefill-chunk must be at least 1, got {prefill_chunk}")
    nm = load(model, backend="native", ctx=ctx, threads=threads, dtype=dtype, console=console, cuda_graph=False)
    if not supported(nm.model):
        raise DsqError(f"dsq serve runs llama, qwen2 and gemma3 models; {nm.arch} is not served yet",
                       "use dsq run or dsq chat for this model")
    if any(d.type != "cpu" for d in nm.model.layer_devices()):
        raise DsqError("dsq serve runs on the CPU for now", "leave --gpu-layers out")
    nm.cache = None  # the single-sequence cache: the engine keeps its own pool
    engine = Engine(nm, kv_tokens=kv_tokens or 4 * ctx, block_size=block_size, max_seqs=max_seqs,
                    prefill_chunk=prefill_chunk, prefix_cache=prefix_cache)
    return engine, Api(engine, model_id(nm))


def run(engine, api, host: str, port: int, drain_s: float = 60.0) -> None:
    import uvicorn

    config = uvicorn.Config(api.app(), host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=drain_s, lifespan="off")
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it has shut down: a handler of ours takes
    # it, so SIGTERM ends the process with status 0 after the drain
    signal.signal(signal.SIGTERM, lambda *_: None)
    engine.start()
    m = engine.metrics()
    sys.stderr.write(f"dsq serve: {api.model_id} on http://{host}:{port}/v1 (native engine, {m['kv_blocks_total']} "
                     f"KV blocks of {m['kv_block_size']} tokens, context {engine.n_ctx}, up to {engine.max_seqs} "
                     "sequences a step)\n")
    sys.stderr.flush()
    try:
        server.run()
    finally:
        engine.stop()
    if not server.started:
        raise DsqError(f"could not listen on {host}:{port}", "pick another --port (is one server already there?)")
    sys.stderr.write("dsq serve: stopped\n")
