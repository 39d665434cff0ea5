"""`dsq quantize`: a model -> GGUF (llama.cpp's K-quants, optionally with an importance matrix),
or an HF directory in AWQ, GPTQ, RTN (GPTQ format) or FP8 (compressed-tensors / DeepSeek) form."""

from __future__ import annotations

import io
import sys
import time
from contextlib import ExitStack
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from dsq.cli.common import command, sigterm_stops
from dsq.cli.options import Force, ModelArg, Revision, Threads
from dsq.quant.spec import EVAL_MODES, EVAL_TOKENS, QUICK_EVAL_TOKENS


class Method(str, Enum):
    gguf = "gguf"
    rtn = "rtn"
    awq = "awq"
    gptq = "gptq"
    fp8 = "fp8"


@command("quantize", examples=[
    "dsq quantize                                   # built-in model's bf16 export -> Q4_K_M GGUF",
    "dsq quantize deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B --type Q4_K_M --imatrix   # fetched from the Hub",
    "dsq quantize ./DeepSeek-R1-Distill-Qwen-1.5B --type Q4_K_M --imatrix --out r1-1.5b-Q4_K_M.gguf",
    "dsq quantize ./DeepSeek-R1-Distill-Qwen-7B --method awq --out r1-7b-awq",
    "dsq quantize ./DeepSeek-R1-Distill-Llama-8B --method gptq --bits 4 --act-order --out r1-8b-gptq",
    "dsq quantize ./DeepSeek-R1-Distill-Qwen-14B --method fp8 --fp8-scheme block --out r1-14b-fp8",
    "dsq quantize --recipe r1-distill-qwen-7b      # fetches the recipe's model from the Hub",
    "dsq quantize --recipe r1-distill-qwen-7b ./DeepSeek-R1-Distill-Qwen-7B",
])
def quantize(
    ctx: typer.Context,
    model: ModelArg = None,
    method: Annotated[Method, typer.Option("--method", "-m", help="Quantization method.")] = Method.gguf,
    qtype: Annotated[str, typer.Option("--type", help="gguf: Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q3_K_M, Q2_K, ... "
                                                      "or F16/BF16/F32 for a float GGUF.")] = "Q4_K_M",
    out: Annotated[Optional[str], typer.Option("--out", "-o", help="Output path (default: NAME-TYPE here).")] = None,
    bits: Annotated[int, typer.Option("--bits", help="rtn/gptq: 4 or 8 (awq: 4).")] = 4,
    group_size: Annotated[int, typer.Option("--group-size", help="Columns per scale group; -1 = per channel.")] = 128,
    sym: Annotated[Optional[bool], typer.Option("--sym/--asym", help="Symmetric codes (GPTQ v1) or asymmetric "
                                                                     "(v2); default: sym for gptq/rtn.")] = None,
    act_order: Annotated[bool, typer.Option("--act-order", help="gptq: columns by decreasing Hessian diagonal.")] = False,
    damp: Annotated[float, typer.Option("--damp", help="gptq: Hessian damping, fraction of its mean diagonal.")] = 0.01,
    fp8_scheme: Annotated[str, typer.Option("--fp8-scheme", help="fp8: channel or block (128x128).")] = "channel",
    fp8_format: Annotated[str, typer.Option("--fp8-format", help="fp8: compressed-tensors or deepseek "
                                                                 "(weight_scale_inv).")] = "compressed-tensors",
    imatrix: Annotated[bool, typer.Option("--imatrix", help="gguf: importance matrix from the calibration text.")] = False,
    calib: Annotated[str, typer.Option("--calib", help="builtin, builtin-chat, or a .txt/.jsonl file.")] = "builtin",
    calib_samples: Annotated[int, typer.Option("--calib-samples", help="Calibration sequences.")] = 128,
    calib_seq_len: Annotated[int, typer.Option("--calib-seq-len", help="Tokens per calibration sequence.")] = 512,
    recipe: Annotated[Optional[str], typer.Option("--recipe", help="Apply a recipe from recipes/; MODEL is then the model "
                                                                   "it names (default: its Hugging Face repo, fetched).")] = None,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    evaluation: Annotated[str, typer.Option(
        "--eval", help=f"rtn/awq/gptq/fp8: the model card's evaluation against the source: quick ({QUICK_EVAL_TOKENS} "
        f"held-out tokens, batched), full ({EVAL_TOKENS}) or none.")] = "quick",
    eval_tokens: Annotated[Optional[int], typer.Option("--eval-tokens", min=0, help="Held-out tokens for the model "
                                                       "card's evaluation instead (0 skips).")] = None,
    threads: Threads = None,
    force: Force = False,
    revision: Revision = None,
) -> None:
    """Quantize a model. With no MODEL, the built-in model's bf16 export is the source.

    gguf: dsq converts an HF directory to GGUF, then llama.cpp's quantizer makes the K-quants (a
    float GGUF is accepted too). rtn/awq/gptq/fp8: layer by layer into an HF directory with its
    quantization_config, which vLLM, SGLang and dsq's native runtime load, evaluated against the
    source for its model card before it appears at --out; they quantize the layers' Linears, and
    the embeddings and output head stay 16-bit (most of a small model's size). A killed or
    interrupted run resumes when the same command runs again (from the last finished block, or the
    GGUF pipeline's finished steps). Progress shows as bars on a terminal, as lines in a pipe or a
    log (held back for the first 10 s: input refused by then prints only its error line); the last line gives
    the whole run's time and each stage's.
    """
    from dsq.cli.options import check_output_path
    from dsq.quant.registry import spec_from_options
    from dsq.ui import console

    con = console()
    held = None
    if not con.is_terminal:
        from rich.console import Console

        held = HeldLines(sys.stderr)
        con = Console(file=held, highlight=False, soft_wrap=True)
    opts = dict(method=method.value, qtype=qtype, bits=bits, group_size=group_size, sym=sym, act_order=act_order,
                damp=damp, fp8_scheme=fp8_scheme, fp8_format=fp8_format, imatrix=imatrix, calib=calib,
                calib_samples=calib_samples, calib_seq_len=calib_seq_len)
    if recipe:
        model = model or _recipe_model(recipe)
        opts = _with_recipe(ctx, recipe, opts)
    spec = spec_from_options(opts).validate()  # refuse bad settings before any work
    if evaluation not in EVAL_MODES:
        from dsq.errors import DsqError

        raise DsqError(f"--eval {evaluation!r} is not an evaluation", f"choose one of: {', '.join(EVAL_MODES)}")
    if eval_tokens is None:
        eval_tokens = EVAL_MODES[evaluation]
    if out:
        check_output_path(Path(out), "--out")
    clock = _Clock()
    try:
        src, name = clock.time("export of the built-in model" if model is None else "download",
                               lambda: _source(model, con, revision))
        target = Path(out) if out else Path.cwd() / f"{name}-{spec.impl.output_name(spec)}"
        with sigterm_stops():
            _quantize(src, target, spec, clock, con, device=device, force=force, threads=threads,
                      eval_tokens=eval_tokens)
    except BaseException:
        if held:
            held.discard()
        raise
    if held:
        held.release()


# a run's lines into a pipe or a log are held back this long: input that a quantize refuses fails
# within it with its one error line, and a longer run's log still gets its steps as they come
HOLD_S = 10.0


class HeldLines(io.TextIOBase):
    """A text stream that keeps what is written for its first `hold_s` seconds, then writes it
    and everything after through; `discard` drops what it kept (the run failed early), `release`
    writes it (the run succeeded early)."""

    def __init__(self, out, hold_s: float = HOLD_S):
        self.out, self.until, self.kept = out, time.monotonic() + hold_s, []

    def write(self, text: str) -> int:
        if self.kept is not None and time.monotonic() < self.until:
            self.kept.append(text)
        else:
            self.release()
            self.out.write(text)
        return len(text)

    def release(self) -> None:
        if self.kept:
            self.out.write("".join(self.kept))
            self.out.flush()
        self.kept = None

    def discard(self) -> None:
        self.kept = None

    def flush(self) -> None:
        self.out.flush()

    def isatty(self) -> bool:
        return False


def _quantize(src: Path, target: Path, spec, clock: "_Clock", con, **kw) -> None:
    """Run the quantization with progress bars, then say what was written, in how long, each
    stage's time, and the evaluation."""
    from dsq import quant
    from dsq.ui import out_console

    with _Bars(con, clock) as bars:
        quant.quantize(src, target, spec, progress=bars, **kw)
    evals = quant.evals_of(target) if spec.impl.writes_card else None
    con.print(f"[green]wrote[/green] {target} ({spec.impl.describe(target)}) in {clock.summary()}"
              + (f"; held-out perplexity {evals['perplexity']:.3f} (source {evals['source perplexity']:.3f}), "
                 f"KLD {evals['KLD']:.4f} ({evals.get('evaluation', 'full')} evaluation, {evals['tokens']} tokens)"
                 if evals else ""), markup=True, highlight=False)
    out_console().print(str(target))


def _recipe_model(recipe: str) -> str:
    """The Hugging Face repo a recipe is for (never the built-in model: the recipe is not for it)."""
    from dsq.quant.recipes import load_recipe

    return load_recipe(recipe)["model"]


class _Clock:
    """The whole command's time, and each stage's (a stage: a progress task, or a step timed here)."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.stages: dict[str, float] = {}
        self.current: tuple[str, float] | None = None

    def time(self, name: str, fn):
        t = time.perf_counter()
        result = fn()
        if time.perf_counter() - t >= 0.5:  # only what did work (a cached export is instant)
            self.stages[name] = time.perf_counter() - t
        return result

    def start(self, name: str | None) -> None:
        """`name` begins now (None: the last one ended)."""
        now = time.perf_counter()
        if self.current is not None:
            task, t = self.current
            self.stages[task] = self.stages.get(task, 0.0) + now - t
        self.current = None if name is None else (name, now)

    def summary(self) -> str:
        self.start(None)
        seconds = time.perf_counter() - self.t0
        if len(self.stages) < 2:
            return f"{seconds:.1f}s"
        parts = [f"{k} {v:.1f}s" for k, v in self.stages.items()]
        rest = seconds - sum(self.stages.values())
        if rest >= 0.5:  # loading, calibration text, writing: the parts add up to the total
            parts.append(f"other steps {rest:.1f}s")
        return f"{seconds:.1f}s (" + ", ".join(parts) + ")"


def _with_recipe(ctx: typer.Context, recipe: str, given: dict) -> dict:
    """The recipe's settings; what the user typed wins over them."""
    from dsq.quant.recipes import apply_recipe

    opts = apply_recipe(recipe, given)
    for k, v in given.items():
        source = ctx.get_parameter_source(k)  # (typer vendors click: compare by name)
        if source is not None and source.name != "DEFAULT":
            opts[k] = v
    return opts


def _source(model: str | None, con, revision: str | None = None):
    """(the source's local path, the name its output is called by): a repo id is fetched first."""
    if model is None:
        from dsq.runtime.builtin import builtin_hf_export

        return builtin_hf_export(con), "gemma-3-270m"
    from dsq.runtime.model_ref import resolve_model

    ref = resolve_model(model, con, revision)
    if ref.kind == "gguf":
        return ref.path, ref.path.stem
    return ref.path, (ref.repo.split("/")[-1] if ref.repo else ref.path.name)


class _Bars:
    """dsq.quant's progress steps as rich bars: one bar per task, opened by its first step (lines
    instead of bars into a pipe or a log); a step's note printed as a line; each task timed."""

    def __init__(self, con, clock: _Clock):
        self.con, self.clock, self.task, self.stack = con, clock, None, ExitStack()

    def __call__(self, step) -> None:
        from dsq.ui import progress_bar

        if step.note:
            self.con.print(f"[dim]{step.note}[/dim]", highlight=False)
            return
        if step.task != self.task:
            self._close()
            self.clock.start(step.task)
            self.bar = self.stack.enter_context(progress_bar(self.con, in_bytes=step.unit == "bytes"))
            self.id, self.task = self.bar.add_task(step.task, total=None), step.task
        self.bar.update(self.id, completed=step.done, total=step.total,
                        description=f"{step.task}: {step.item}" if step.item else step.task)

    def _close(self) -> None:
        if self.task is not None:
            self.bar.update(self.id, description=self.task)
        self.stack.close()

    def __enter__(self) -> "_Bars":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self._close()
        else:
            self.stack.__exit__(*exc)
