"""`dsq chat`: an interactive conversation with history, chat template and R1 thinking display."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dsq.cli.common import (Backend, Compile, Ctx, Dtype, GpuLayersOption, KvDtype, MaxTokens, MinP, ModelArg,
                            RepeatPenalty, Seed, Temperature, Threads, TopK, TopP, backend_options, command)

HELP = "commands: /reset clears the history, /exit leaves (so does Ctrl-D); Ctrl-C stops a reply"


@command("chat", examples=[
    "dsq chat",
    "dsq chat DeepSeek-R1-Distill-Qwen-7B-Q4_K_M.gguf --gpu-layers all --hide-thinking",
    'dsq chat --system "Answer in one sentence." --temperature 0.3',
])
def chat(
    model: ModelArg = None,
    system: Annotated[Optional[str], typer.Option("--system", help="System message.")] = None,
    hide_thinking: Annotated[bool, typer.Option("--hide-thinking", help="Drop DeepSeek-R1 <think> sections.")] = False,
    max_tokens: MaxTokens = 1024,
    temperature: Temperature = 0.7,
    top_k: TopK = 40,
    top_p: TopP = 0.95,
    min_p: MinP = 0.0,
    repeat_penalty: RepeatPenalty = 1.0,
    seed: Seed = None,
    ctx: Ctx = 4096,
    threads: Threads = None,
    gpu_layers: GpuLayersOption = "0",
    backend: Backend = "llama.cpp",
    dtype: Dtype = None,
    kv_dtype: KvDtype = None,
    compile: Compile = False,
) -> None:
    """Chat with a model. History is kept; /reset clears it, /exit or Ctrl-D leaves."""
    from dsq.errors import DsqError
    from dsq.runtime.conversation import Conversation
    from dsq.runtime.engine import load
    from dsq.runtime.sampling import SamplingParams
    from dsq.ui import console, out_console

    err, out = console(), out_console()
    m = load(model, backend=backend, ctx=ctx, threads=threads, gpu_layers=gpu_layers, seed=seed, console=err,
             **backend_options(backend, dtype, kv_dtype, compile))
    conversation = Conversation(m, system=system, max_tokens=max_tokens,
                          sampling=SamplingParams(temperature, top_k, top_p, min_p, repeat_penalty, seed))
    err.print(f"[bold]{m.ref.label}[/bold] [dim]({m.backend}; template: {conversation.template.origin}; {HELP})[/dim]")
    state = {"in_think": False}

    def on_part(kind: str, text: str) -> None:
        if kind == "think":
            if hide_thinking:
                return
            if not state["in_think"]:
                out.print("[thinking] ", style="dim italic", end="", markup=False)
                state["in_think"] = True
            out.print(text, style="dim italic", end="", markup=False)
        else:
            if state["in_think"]:
                out.print("\n[/thinking]", style="dim italic", markup=False)
                state["in_think"] = False
                text = text.lstrip("\n")
            out.print(text, end="", markup=False)

    while True:
        try:
            line = input("> ")
        except EOFError:
            out.print()
            break
        except KeyboardInterrupt:
            out.print("\n(use /exit or Ctrl-D to leave)")
            continue
        cmd = line.strip()
        if not cmd:
            continue
        if cmd in ("/exit", "/quit", "/bye"):
            break
        if cmd == "/reset":
            conversation.reset()
            err.print("[dim]history cleared[/dim]")
            continue
        if cmd in ("/help", "/?"):
            err.print(f"[dim]{HELP}[/dim]")
            continue
        if cmd.startswith("/"):
            err.print(f"[dim]unknown command {cmd}; {HELP}[/dim]")
            continue
        state["in_think"] = False
        try:
            conversation.send(line, on_part)
        except KeyboardInterrupt:
            out.print()
            err.print("[dim](reply stopped)[/dim]")
            continue
        except DsqError as e:
            err.print(f"error: {e.one_line()}", markup=False)
            continue
        out.print()
        st = conversation.last_stats
        if st is not None:
            err.print(f"[dim]{st.generated_tokens} tokens | TTFT {st.ttft_s * 1000:.0f} ms | "
                      f"{st.decode_tok_s:.1f} tok/s[/dim]")
