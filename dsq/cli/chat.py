"""`dsq chat`: an interactive conversation with history, chat template and R1 thinking display."""

from __future__ import annotations

from typing import Annotated, Callable, Optional

import typer

from dsq.cli.common import command
from dsq.cli.options import Loading, ModelArg, Sampling, grouped

HELP = ("commands: /reset clears the history, /exit leaves (so does Ctrl-D); Ctrl-C stops a reply; "
        "the arrow keys edit the line and recall earlier ones")
STOPPED = {"loop": "stopped: the reply repeats itself", "interrupted": "stopped"}


@command("chat", examples=[
    "dsq chat",
    "dsq chat DeepSeek-R1-Distill-Qwen-7B-Q4_K_M.gguf --gpu-layers all --hide-thinking",
    'dsq chat --system "Answer in one sentence." --temperature 0.3',
    "dsq chat model.gguf --chat-template tokenizer_config.json",
])
@grouped(sampling=Sampling(max_tokens=1024, temperature=0.7, repeat_penalty=1.1), loading=Loading())
def chat(
    model: ModelArg = None,
    system: Annotated[Optional[str], typer.Option("--system", help="System message.")] = None,
    hide_thinking: Annotated[bool, typer.Option("--hide-thinking", help="Drop DeepSeek-R1 <think> sections.")] = False,
    chat_template: Annotated[Optional[str], typer.Option(
        "--chat-template", metavar="FILE",
        help="Use this chat template (a .jinja file, or a tokenizer_config.json) instead of the model's.")] = None,
    sampling: Sampling = None,
    loading: Loading = None,
) -> None:
    """Chat with a model. History is kept; /reset clears it, /exit or Ctrl-D leaves.

    A reply ends at the end of its turn, at --max-tokens, or where it starts repeating one cycle of
    tokens (a model stuck in a loop); a stats line follows each reply, one stopped with Ctrl-C too.
    """
    from dsq.runtime.chat_template import read_template_file
    from dsq.runtime.conversation import Conversation
    from dsq.ui import console

    err = console()
    sp = sampling.params()
    template = read_template_file(chat_template) if chat_template is not None else None  # before the slow load
    m = loading.load(model, seed=sp.seed)
    conversation = Conversation(m, system=system, max_tokens=sampling.max_tokens, sampling=sp, template=template)
    err.print(f"[bold]{m.ref.label}[/bold] [dim]({m.backend}; template: {conversation.template.origin}; {HELP})[/dim]")
    if m.ref.builtin:
        err.print("[dim]The built-in model is a base model, not instruction-tuned: its replies are poor. "
                  "Pass an instruction-tuned or R1-Distill GGUF for real chat.[/dim]")
    _loop(conversation, _reader(), _Printer(hide_thinking))


def _reader() -> Callable[[str], str]:
    """input() with line editing and history (prompt_toolkit) on a terminal, plain input() otherwise."""
    import sys

    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        return input
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import InMemoryHistory

    return PromptSession(history=InMemoryHistory()).prompt


class _Printer:
    """Streams a reply: <think> sections dimmed (or dropped), the answer plain."""

    def __init__(self, hide_thinking: bool):
        from dsq.ui import out_console

        self.out, self.hide, self.in_think = out_console(), hide_thinking, False

    def __call__(self, kind: str, text: str) -> None:
        if kind == "think":
            if self.hide:
                return
            if not self.in_think:
                self.out.print("[thinking] ", style="dim italic", end="", markup=False)
                self.in_think = True
            self.out.print(text, style="dim italic", end="", markup=False)
            return
        if self.in_think:
            self.out.print("\n[/thinking]", style="dim italic", markup=False)
            self.in_think = False
            text = text.lstrip("\n")
        self.out.print(text, end="", markup=False)


def _loop(conversation, read: Callable[[str], str], printer: _Printer) -> None:
    from dsq.ui import console

    err = console()
    while True:
        try:
            line = read("> ")
        except EOFError:
            printer.out.print()
            return
        except KeyboardInterrupt:
            printer.out.print("\n(use /exit or Ctrl-D to leave)")
            continue
        cmd = line.strip()
        if cmd in ("/exit", "/quit", "/bye"):
            return
        if cmd:
            _handle(conversation, line, cmd, printer, err)


def _handle(conversation, line: str, cmd: str, printer: _Printer, err) -> None:
    """One line of input: a /command, or a message and its streamed reply with its stats."""
    from dsq.errors import DsqError

    if cmd == "/reset":
        conversation.reset()
        err.print("[dim]history cleared[/dim]")
    elif cmd in ("/help", "/?"):
        err.print(f"[dim]{HELP}[/dim]")
    elif cmd.startswith("/"):
        err.print(f"[dim]unknown command {cmd}; {HELP}[/dim]")
    else:
        printer.in_think = False
        try:
            conversation.send(line, printer)
        except KeyboardInterrupt:
            pass
        except DsqError as e:
            err.print(f"error: {e.one_line()}", markup=False)
            return
        printer.out.print()
        _stats_line(conversation.last_stats, err)


def _stats_line(st, err) -> None:
    if st is None:
        return
    stopped = STOPPED.get(st.finish_reason)
    err.print(f"[dim]{st.generated_tokens} tokens | TTFT {st.ttft_s * 1000:.0f} ms | {st.decode_tok_s:.1f} tok/s"
              + (f" | {stopped}" if stopped else "") + "[/dim]")
