"""`dsq run`: generate a continuation (or one chat reply) and stream it."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer

from dsq.cli.common import command
from dsq.cli.options import JsonFlag, Loading, ModelArg, Sampling, grouped, stdin_text


@command("run", examples=[
    'dsq run -p "The history of the Roman Empire" --max-tokens 32 --temperature 0',
    'dsq run model.gguf -p "Why is the sky blue?" --chat --gpu-layers all',
    'echo "Once upon a time" | dsq run --json',
    'dsq run ./DeepSeek-R1-Distill-Qwen-1.5B --backend native -p "2+2=" --max-tokens 8',
])
@grouped(sampling=Sampling(), loading=Loading())
def run(
    model: ModelArg = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="Prompt text (or pipe it on stdin).")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the model's chat template.")] = False,
    system: Annotated[Optional[str], typer.Option("--system", help="System message (with --chat).")] = None,
    sampling: Sampling = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop at this text (repeatable).")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Keep generating past end-of-text tokens.")] = False,
    loading: Loading = None,
    as_json: JsonFlag = False,
) -> None:
    """Generate text from a prompt, streamed to stdout.

    Timing (TTFT, tokens/s) goes to stderr, so stdout holds only the generated text.
    """
    from dsq.errors import DsqError
    from dsq.runtime.engine import generate
    from dsq.ui import console

    if prompt is None:
        prompt = stdin_text()
    if prompt is None:
        raise DsqError("no prompt given", 'pass one with -p "..." or pipe it on stdin')
    sp = sampling.params()
    m = loading.load(model, seed=sp.seed)

    def echo(s: str) -> None:
        sys.stdout.write(s)
        sys.stdout.flush()

    result = generate(m, prompt, max_tokens=sampling.max_tokens, temperature=sp.temperature, top_k=sp.top_k,
                      top_p=sp.top_p, min_p=sp.min_p, repeat_penalty=sp.repeat_penalty, seed=sp.seed, stop=stop or (),
                      chat=chat, system=system, ignore_eos=ignore_eos, on_text=None if as_json else echo)
    st = result.stats
    if as_json:
        from dsq.runtime.gpu_layers import gpu_usable

        on_gpu = m.gpu_layers.n_gpu_layers if gpu_usable(m.backend) else 0  # what sits on a GPU, none without one
        out = {"model": str(m.ref.path), "backend": m.backend, "gpu_layers": on_gpu,
               "threads": m.n_threads, **result.as_dict()}
        typer.echo(json.dumps(out, ensure_ascii=False))
        return
    sys.stdout.write("\n")
    console().print(
        f"[dim]{st.prompt_tokens} prompt tokens, {st.generated_tokens} generated | TTFT {st.ttft_s * 1000:.0f} ms | "
        f"prefill {st.prefill_tok_s:.1f} tok/s | decode {st.decode_tok_s:.1f} tok/s | {st.finish_reason}[/dim]")
