"""`dsq quantize`: a model -> GGUF (llama.cpp's K-quants, optionally with an importance matrix),
or an HF directory in AWQ, GPTQ, RTN (GPTQ format) or FP8 (compressed-tensors / DeepSeek) form."""

from __future__ import annotations

import time
from contextlib import ExitStack
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from dsq.cli.common import Force, ModelArg, Threads, command
from dsq.quant.spec import EVAL_TOKENS


class Method(str, Enum):
    gguf = "gguf"
    rtn = "rtn"
    awq = "awq"
    gptq = "gptq"
    fp8 = "fp8"


@command("quantize", examples=[
    "dsq quantize                                   # built-in model's bf16 export -> Q4_K_M GGUF",
    "dsq quantize ./DeepSeek-R1-Distill-Qwen-1.5B --type Q4_K_M --imatrix --out r1-1.5b-Q4_K_M.gguf",
    "dsq quantize ./DeepSeek-R1-Distill-Qwen-7B --method awq --out r1-7b-awq",
    "dsq quantize ./DeepSeek-R1-Distill-Llama-8B --method gptq --bits 4 --act-order --out r1-8b-gptq",
    "dsq quantize ./DeepSeek-R1-Distill-Qwen-14B --method fp8 --fp8-scheme block --out r1-14b-fp8",
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
    recipe: Annotated[Optional[str], typer.Option("--recipe", help="Apply a recipe from recipes/ (see recipes/).")] = None,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    eval_tokens: Annotated[int, typer.Option("--eval-tokens", help="Held-out tokens for the model card's "
                                                                   "eval (0 skips).")] = EVAL_TOKENS,
    threads: Threads = None,
    force: Force = False,
) -> None:
    """Quantize a model. With no MODEL, the built-in model's bf16 export is the source.

    gguf: dsq converts an HF directory to GGUF, then llama.cpp's quantizer makes the K-quants (a
    float GGUF is accepted too). rtn/awq/gptq/fp8: layer by layer into an HF directory with its
    quantization_config, which vLLM, SGLang and dsq's native runtime load, evaluated against the
    source for its model card before it appears at --out. A killed run resumes when the same
    command runs again (from the last finished block, or the GGUF pipeline's finished steps).
    """
    from dsq import quant
    from dsq.quant.registry import spec_from_options
    from dsq.ui import console, out_console

    con = console()
    opts = dict(method=method.value, qtype=qtype, bits=bits, group_size=group_size, sym=sym, act_order=act_order,
                damp=damp, fp8_scheme=fp8_scheme, fp8_format=fp8_format, imatrix=imatrix, calib=calib,
                calib_samples=calib_samples, calib_seq_len=calib_seq_len)
    if recipe:
        opts = _with_recipe(ctx, recipe, opts)
    spec = spec_from_options(opts).validate()  # refuse bad settings before any work
    src, name = _source(model, con)
    target = Path(out) if out else Path.cwd() / f"{name}-{spec.impl.output_name(spec)}"
    t0 = time.perf_counter()
    with _Bars(con) as bars:
        quant.quantize(src, target, spec, device=device, force=force, threads=threads, progress=bars,
                       eval_tokens=eval_tokens)
    evals = quant.evals_of(target) if spec.impl.writes_card else None
    con.print(f"[green]wrote[/green] {target} ({spec.impl.describe(target)}) in {time.perf_counter() - t0:.1f}s"
              + (f"; held-out perplexity {evals['perplexity']:.3f} (source {evals['source perplexity']:.3f}), "
                 f"KLD {evals['KLD']:.4f}" if evals else ""))
    out_console().print(str(target))


def _with_recipe(ctx: typer.Context, recipe: str, given: dict) -> dict:
    """The recipe's settings; what the user typed wins over them."""
    from dsq.quant.recipes import apply_recipe

    opts = apply_recipe(recipe, given)
    for k, v in given.items():
        source = ctx.get_parameter_source(k)  # (typer vendors click: compare by name)
        if source is not None and source.name != "DEFAULT":
            opts[k] = v
    return opts


def _source(model: str | None, con):
    if model is None:
        from dsq.runtime.builtin import builtin_hf_export

        return builtin_hf_export(con), "gemma-3-270m"
    src = Path(model)
    return src, (src.stem if src.is_file() else src.name)


class _Bars:
    """dsq.quant's progress steps as rich bars: one bar per task, opened by its first step."""

    def __init__(self, con):
        self.con, self.task, self.stack = con, None, ExitStack()

    def __call__(self, step) -> None:
        from dsq.ui import progress_bar

        if step.task != self.task:
            self._close()
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
