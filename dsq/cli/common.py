"""The Typer app, the error boundary every command runs inside, and shared option types."""

from __future__ import annotations

import functools
import os
import sys
from typing import Annotated, Callable, Optional

import typer

from dsq import __version__
from dsq.errors import DsqError

app = typer.Typer(
    name="dsq",
    help="Quantize DeepSeek-family LLMs and run them locally, fast, on any mix of GPU and CPU.\n\n"
         "With no MODEL argument, commands use the built-in Gemma 3 270M (Q4_K_M) model.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dsq {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", "-V", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    pass


def fail(message: str, code: int = 1) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def command(name: str, examples: list[str], **kwargs) -> Callable:
    """Register a subcommand whose user errors print one line and exit 1.

    DSQ_DEBUG=1 lets every exception through with its traceback.
    """
    epilog = "[bold]Examples[/bold]\n\n" + "\n\n".join(f"  [cyan]{e}[/cyan]" for e in examples)

    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kw):
            if os.environ.get("DSQ_DEBUG"):
                return fn(*args, **kw)
            try:
                return fn(*args, **kw)
            except DsqError as e:
                fail(e.one_line(), e.exit_code)
            except KeyboardInterrupt:
                typer.echo("interrupted", err=True)
                raise typer.Exit(130) from None
            except (typer.Exit, typer.Abort):
                raise
            except MemoryError:
                fail("out of memory; try a smaller model, a smaller --ctx, or fewer --gpu-layers")
            except Exception as e:  # a bug: one line, with the way to see more
                fail(f"internal error: {type(e).__name__}: {e} (run with DSQ_DEBUG=1 for the traceback "
                     "and please report it)")

        return app.command(name, epilog=epilog, **kwargs)(wrapper)

    return deco


# -- shared options ------------------------------------------------------------------------
ModelArg = Annotated[Optional[str], typer.Argument(
    help="A .gguf file or an HF model directory. Omit it to use the built-in model.", show_default=False)]
MaxTokens = Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens to generate.")]
Temperature = Annotated[float, typer.Option("--temperature", "-t", help="Sampling temperature; 0 = greedy.")]
TopK = Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens; 0 = off.")]
TopP = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass; 1 = off.")]
MinP = Annotated[float, typer.Option("--min-p", help="Drop tokens below min-p x the top probability; 0 = off.")]
RepeatPenalty = Annotated[float, typer.Option("--repeat-penalty", help="Penalty for recent tokens; 1 = off.")]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Random seed for sampling (reproducible output).")]
Ctx = Annotated[int, typer.Option("--ctx", "-c", help="Context length in tokens (prompt + reply).")]
Threads = Annotated[Optional[int], typer.Option("--threads", help="CPU threads (default: the physical cores this "
                                                                   "process may run on, one per core, not per SMT "
                                                                   "thread).")]
GpuLayersOption = Annotated[str, typer.Option(
    "--gpu-layers", "-g", help="Layers to put on the GPU: a number, 'all', or 'auto' (fit the free VRAM).")]
Force = Annotated[bool, typer.Option("--force", "-f", help="Overwrite an existing output.")]
Backend = Annotated[str, typer.Option("--backend", "-b", help="native (dsq's torch engine) or llama.cpp.")]
Dtype = Annotated[Optional[str], typer.Option(
    "--dtype", help="native: activation dtype bf16|fp16|fp32 (default: bf16 on GPU, fp32 on CPU).")]
KvDtype = Annotated[Optional[str], typer.Option("--kv-dtype", help="KV cache dtype: bf16|fp16|fp32.")]
Compile = Annotated[bool, typer.Option(
    "--compile", help="native: torch.compile the decode step, on CUDA or the CPU (starts slower: ~20 s on a "
    "GPU, ~40 s on 2 CPU cores the first time, ~7 s once cached; decodes faster).")]


def backend_options(backend: str, dtype: str | None, kv_dtype: str | None, compile: bool = False) -> dict:
    """Backend-specific load options from the shared flags."""
    if backend == "native":
        return {"dtype": dtype, "kv_dtype": kv_dtype, "compile": compile}
    if dtype is not None or compile:
        raise DsqError("--dtype and --compile apply to the native backend", "drop them, or pass --backend native")
    return {"kv_dtype": kv_dtype} if kv_dtype else {}


def stdin_text() -> str | None:
    if sys.stdin is not None and not sys.stdin.isatty():
        data = sys.stdin.read()
        return data if data.strip() else None
    return None
