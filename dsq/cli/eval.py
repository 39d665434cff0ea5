"""`dsq eval`: perplexity on held-out text; KLD and top-1 agreement against a reference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from dsq.cli.common import command
from dsq.cli.options import JsonFlag, ModelArg, Revision, Threads, Tokens, Window


@command("eval", renamed={"--max-tokens": "--tokens", "--ctx": "--window"}, examples=[
    "dsq eval gemma-3-270m-awq-w4                 # against the model it was made from",
    "dsq eval r1-7b-Q4_K_M.gguf --ref ./DeepSeek-R1-Distill-Qwen-7B",
    "dsq eval model.gguf --text wiki.test.raw --window 512 --tokens 65536 --json",
])
def eval_(
    model: ModelArg = None,
    ref: Annotated[Optional[str], typer.Option("--ref", help="Reference model (default: the source the artifact "
                                                              "was made from, when known).")] = None,
    text: Annotated[Optional[Path], typer.Option("--text", help="Evaluation text file (default: dsq's held-out "
                                                                "built-in text).")] = None,
    window: Window = 512,
    tokens: Tokens = 4096,
    backend: Annotated[Optional[str], typer.Option("--backend", "-b", help="native or llama.cpp (default: llama.cpp "
                                                                            "for GGUF, native otherwise).")] = None,
    threads: Threads = None,
    as_json: JsonFlag = False,
    revision: Revision = None,
) -> None:
    """Score a model on held-out text: perplexity, and against a reference KLD and top-1 agreement."""
    from dsq.eval.quality import check_window, evaluate, source_of
    from dsq.errors import DsqError
    from dsq.runtime.model_ref import resolve_model
    from dsq.ui import console, out_console, status

    check_window(window, tokens)
    con = console()
    m = resolve_model(model, con, revision)
    reference = ref or source_of(str(m.path))
    if text is not None and not text.is_file():
        raise DsqError(f"{text} does not exist", "pass a text file to --text")
    body = text.read_text(encoding="utf-8", errors="replace") if text else None
    if body is not None and not body.strip():
        raise DsqError(f"{text} is empty", "pass a file with text")
    with status("evaluating", con) as st:
        r = evaluate(str(m.path), reference, body, ctx=window, max_tokens=tokens, backend=backend, threads=threads,
                     on_window=lambda i, n: st.update(f"evaluating: window {i}/{n}"))
    if as_json:
        typer.echo(json.dumps(r))
        return
    out = out_console()
    out.print(f"{m.label}: perplexity [bold]{r['perplexity']:.4f}[/bold] over {r['tokens']} tokens "
              f"({r['windows']} windows of {window}, {r['backend']})")
    if reference:
        out.print(f"reference {reference}: perplexity {r['reference_perplexity']:.4f} "
                  f"(delta {r['delta_perplexity']:+.4f}); KLD {r['kld']:.5f}; top-1 agreement {r['top1_agreement']:.2%}")
    else:
        out.print("no reference (pass --ref to measure KLD and top-1 agreement)")
