"""`dsq serve`: an OpenAI-compatible server with continuous batching."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dsq.cli.common import command
from dsq.cli.options import Ctx, Dtype, Experts, GpuLayersOption, KvDtype, ModelArg, Revision, TensorParallel, Threads
from dsq.serve.server import KV_SHARE


@command("serve", examples=[
    "dsq serve",
    "dsq serve model.gguf --port 8080 --ctx 8192 --max-seqs 16",
    "dsq serve unsloth/DeepSeek-R1-Distill-Qwen-7B-GGUF:Q4_K_M --revision main",
    "dsq serve big.gguf --draft small.gguf --spec-tokens 4",
    "dsq serve model.gguf --gpu-layers all --tp 2",
    'curl http://127.0.0.1:8000/v1/chat/completions -d \'{"messages": [{"role": "user", "content": "Hi"}]}\'',
])
def serve(
    model: ModelArg = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (127.0.0.1: this machine only).")]
    = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port to listen on.")] = 8000,
    ctx: Ctx = 4096,
    threads: Threads = None,
    gpu_layers: GpuLayersOption = "0",
    dtype: Dtype = None,
    experts: Experts = "auto",
    tp: TensorParallel = 1,
    kv_tokens: Annotated[Optional[int], typer.Option(
        "--kv-tokens", min=1, help="Tokens the paged KV cache holds, all sequences together (default: on a GPU, "
        f"--max-seqs sequences of --ctx tokens, as far as {KV_SHARE:.0%} of the memory free after loading holds; on the "
        "CPU 4 x --ctx).")]
    = None,
    kv_memory: Annotated[Optional[float], typer.Option(
        "--kv-memory", help="MiB the paged KV cache takes (instead of --kv-tokens): fp8 holds twice bf16's tokens; "
        "a DeepSeek model's latent rows (MLA) hold many more than a llama's keys and values.")]
    = None,
    kv_dtype: KvDtype = None,
    block_size: Annotated[int, typer.Option("--block-size", help="Tokens per KV block.")] = 16,
    max_seqs: Annotated[int, typer.Option("--max-seqs", help="Most sequences decoded together in a step.")] = 32,
    prefill_chunk: Annotated[int, typer.Option(
        "--prefill-chunk", help="Most prompt tokens run in one step, between decode steps.")] = 512,
    prefix_cache: Annotated[bool, typer.Option(
        "--prefix-cache/--no-prefix-cache", help="Share KV blocks of a repeated prompt prefix.")] = True,
    spec_tokens: Annotated[Optional[int], typer.Option(
        "--spec-tokens", help="Draft tokens a step for greedy requests (speculative decoding; 0 = off; default 0, "
        "or 4 with --draft). Without --draft they come from prompt lookup (n-gram), while at most 2 requests "
        "decode. Greedy output is the same either way.")] = None,
    draft: Annotated[Optional[str], typer.Option(
        "--draft", help="A small draft model sharing MODEL's vocabulary (a .gguf, an HF directory, or 'builtin'): "
        "it proposes --spec-tokens tokens for every greedy request, the model checks them all in one batched "
        "pass. Sampled requests (temperature > 0) decode plainly.")] = None,
    drain: Annotated[float, typer.Option("--drain", help="Seconds SIGTERM waits for running requests.")] = 60.0,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key", envvar="DSQ_API_KEY", show_default=False,
        help="Require 'Authorization: Bearer KEY' on every endpoint but /health (a missing or wrong key gets 401).")]
    = None,
    max_body: Annotated[float, typer.Option(
        "--max-body", help="Largest request body in MiB; a larger one gets 413 before it is parsed.")] = 4.0,
    read_timeout: Annotated[float, typer.Option(
        "--read-timeout", help="Seconds a request's headers and body may take to arrive (from the connection's "
        "open or the previous reply); a slower one gets 408 and the connection closes.")] = 30.0,
    write_timeout: Annotated[float, typer.Option(
        "--write-timeout", help="Seconds a client may leave the reply unread before its connection is cut "
        "(and its request cancelled).")] = 60.0,
    max_connections: Annotated[Optional[int], typer.Option(
        "--max-connections", help="Most client connections served at once; a request on one more gets 503 and "
        "its connection closes (default: no limit).")] = None,
    revision: Revision = None,
) -> None:
    """Serve a model over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models,
    /health, /metrics), on dsq's native engine.

    Implemented: streaming (SSE) and not; usage counts; stop strings, max_tokens, temperature,
    top_p, seed; DeepSeek-R1 reasoning as `reasoning_content`; continuous batching (requests join
    and leave the running batch every step) over a paged KV cache with admission by free blocks
    and preemption when it is full; chunked prefill; prefix caching (hit rate in /metrics);
    --kv-dtype fp8; speculative decoding of greedy requests by prompt lookup (--spec-tokens) or
    with a draft model (--draft, its own paged KV cache; a draft whose vocabulary differs from
    MODEL's is refused); acceptance in /metrics.
    SIGTERM lets running requests finish, then exits 0. The startup line gives the KV cache's
    capacity in tokens.

    DeepSeek V2/V3 (MLA + MoE): the paged cache holds each token's latent row (kv_lora_rank +
    qk_rope_head_dim values a layer, no separate values); --experts cpu keeps the routed experts
    in RAM as with dsq run.

    On a GPU (--gpu-layers all) the same step runs eagerly (no CUDA graph yet), its decode
    attention in a Triton kernel that reads the blocks in place (DSQ_PAGED_ATTN=0: gathered, as
    on the CPU); not yet measured there. A model split between the CPU and a GPU is refused.

    --tp N splits the model over N ranks, one process each on torch.distributed (N GPUs with
    --gpu-layers all over NCCL, else N CPU processes over gloo): attention heads and MLP columns,
    DeepSeek's routed experts placed per rank; rank 0 serves and schedules (docs/cli.md).

    Against hostile clients: --api-key (or DSQ_API_KEY), a body cap (--max-body), read and
    write deadlines (--read-timeout, --write-timeout), a cap on open connections
    (--max-connections); bad requests get OpenAI-style 4xx errors, unknown fields included, and a
    prompt past the context is refused by its length before it is tokenized.

    Not implemented yet: --backend llama.cpp,
    n > 1, logprobs, tools.
    """
    from dsq.errors import DsqError
    from dsq.serve.guard import MIB, Limits
    from dsq.serve.server import build, check_port, run
    from dsq.ui import console

    for flag, v in (("--max-body", max_body), ("--read-timeout", read_timeout), ("--write-timeout", write_timeout)):
        if not v > 0:
            raise DsqError(f"{flag} must be > 0, got {v}")
    if max_connections is not None and max_connections < 1:
        raise DsqError(f"--max-connections must be at least 1, got {max_connections}",
                       "leave it out for no limit")
    if api_key is not None and not api_key.strip():
        raise DsqError("--api-key (or DSQ_API_KEY) is empty", "pass a key, or leave it out to serve without one")
    limits = Limits(api_key=api_key, max_body=int(max_body * MIB), read_timeout=read_timeout,
                    write_timeout=write_timeout, max_connections=max_connections)
    check_port(host, port)
    engine, api = build(model, ctx=ctx, threads=threads, dtype=dtype, kv_tokens=kv_tokens, kv_memory_mb=kv_memory,
                        kv_dtype_name=kv_dtype, block_size=block_size,
                        max_seqs=max_seqs, prefill_chunk=prefill_chunk, prefix_cache=prefix_cache,
                        spec_tokens=spec_tokens, draft=draft, gpu_layers=gpu_layers, experts=experts, tp=tp,
                        console=console(), revision=revision)
    run(engine, api, host, port, drain, limits)
