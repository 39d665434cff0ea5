"""`dsq quantize`: a model -> GGUF (llama.cpp's K-quants, optionally with an importance matrix),
or an HF directory in AWQ, GPTQ, RTN (GPTQ format) or FP8 (compressed-tensors / DeepSeek) form."""

from __future__ import annotations

import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from dsq.cli.common import Force, ModelArg, Threads, command


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
                                                                   "eval (0 skips).")] = 2048,
    threads: Threads = None,
    force: Force = False,
) -> None:
    """Quantize a model. With no MODEL, the built-in model's bf16 export is the source.

    gguf: dsq converts an HF directory to GGUF, then llama.cpp's quantizer makes the K-quants (a
    float GGUF is accepted too). rtn/awq/gptq/fp8: layer by layer into an HF directory with its
    quantization_config, which vLLM, SGLang and dsq's native runtime load. Interrupted runs of
    the calibrated methods resume from the last finished block.
    """
    from dsq.errors import DsqError
    from dsq.ui import console

    con = console()
    if recipe:
        from dsq.quant.recipes import apply_recipe

        given = dict(method=method.value, qtype=qtype, bits=bits, group_size=group_size, sym=sym,
                     act_order=act_order, damp=damp, fp8_scheme=fp8_scheme, fp8_format=fp8_format, imatrix=imatrix,
                     calib=calib, calib_samples=calib_samples, calib_seq_len=calib_seq_len)
        opts = apply_recipe(recipe, given)
        for k, v in given.items():  # what the user typed wins over the recipe
            source = ctx.get_parameter_source(k)  # (typer vendors click: compare by name)
            if source is not None and source.name != "DEFAULT":
                opts[k] = v
        method, qtype, bits, group_size, sym = Method(opts["method"]), opts["qtype"], opts["bits"], opts["group_size"], opts["sym"]
        act_order, damp, fp8_scheme, fp8_format = opts["act_order"], opts["damp"], opts["fp8_scheme"], opts["fp8_format"]
        imatrix, calib, calib_samples, calib_seq_len = opts["imatrix"], opts["calib"], opts["calib_samples"], opts["calib_seq_len"]
        skip = opts.get("skip", [])
    else:
        skip = []
    if method is Method.gguf:
        from dsq.formats.gguf_types import parse_gguf_type

        qtype = parse_gguf_type(qtype)  # refuse a bad type before any work
        return _gguf(model, qtype, out, threads, force, imatrix, calib, calib_samples, calib_seq_len, device, con)
    from dsq.quant.driver import QuantSpec

    spec = QuantSpec(method.value, bits=bits, group_size=group_size, sym=sym, act_order=act_order, damp=damp,
                     fp8_scheme=fp8_scheme, fp8_format=fp8_format, calib=calib, calib_samples=calib_samples,
                     calib_seq_len=calib_seq_len, skip=skip).validate()
    src, name = _source(model, con)
    from dsq.runtime.model_ref import resolve_model

    ref = resolve_model(str(src))
    if ref.kind != "hf":
        raise DsqError(f"{method.value} quantizes HF safetensors models", "convert the GGUF first: dsq convert IN OUT")
    label = f"{method.value}-w{8 if method is Method.fp8 else bits}" + (f"-{fp8_scheme}" if method is Method.fp8 else "")
    target = Path(out) if out else Path.cwd() / f"{name}-{label}"
    if target.exists() and not force:
        raise DsqError(f"{target} already exists", "pass --force to overwrite it or choose another --out")
    from dsq.formats.hf import HFModelDir
    from dsq.quant.driver import calibration_for, check_model, quantize_model

    hf = HFModelDir(ref.path)
    check_model(hf, spec)  # every layer fits the format: refuse before any work
    calib_ids = calibration_for(hf, spec) if spec.needs_calibration else None
    from dsq.ui import progress_bar

    t0 = time.perf_counter()
    with progress_bar(con) as p:
        task = p.add_task(f"{method.value} {label}: blocks", total=None)
        quantize_model(ref.path, target, spec, device=device, force=force, calib_ids=calib_ids,
                                 on_block=lambda i, n, dt: p.update(task, completed=i, total=n))
    evals = None
    if eval_tokens:
        evals = _card_eval(target, ref.path, eval_tokens, hf, spec, con)
    con.print(f"[green]wrote[/green] {target} ({_dir_size(target) / 2**20:.1f} MiB) in {time.perf_counter() - t0:.1f}s"
              + (f"; held-out perplexity {evals['perplexity']:.3f} (source {evals['source perplexity']:.3f}), "
                 f"KLD {evals['KLD']:.4f}" if evals else ""))
    from dsq.ui import out_console

    out_console().print(str(target))


def _source(model: str | None, con):
    if model is None:
        from dsq.runtime.builtin import builtin_hf_export

        return builtin_hf_export(con), "gemma-3-270m"
    src = Path(model)
    return src, (src.stem if src.is_file() else src.name)


def _dir_size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _card_eval(target: Path, source: Path, tokens: int, hf, spec, con) -> dict | None:
    """Evaluate the artifact against its source and put the numbers in its model card."""
    from dsq.eval.quality import evaluate
    from dsq.quant.driver import model_card

    with con.status("evaluating on held-out text"):
        r = evaluate(str(target), str(source), ctx=min(512, tokens), max_tokens=tokens)
    evals = {"perplexity": r["perplexity"], "source perplexity": r["reference_perplexity"], "KLD": r["kld"],
             "top-1 agreement": r["top1_agreement"], "tokens": r["tokens"]}
    (target / "README.md").write_text(model_card(hf, spec, _dir_size(target), {
        k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in evals.items()}))
    return evals


def _gguf(model, qtype, out, threads, force, use_imatrix, calib, calib_samples, calib_seq_len, device, con) -> None:
    import tempfile

    from dsq.errors import DsqError
    from dsq.formats.gguf_types import FLOAT_TYPES
    from dsq.convert.hf_to_gguf import hf_to_gguf
    from dsq.quant.gguf import quantize_gguf
    from dsq.runtime.model_ref import resolve_model
    from dsq.ui import convert_with_progress, out_console, progress_bar

    src, name = _source(model, con)
    target = Path(out) if out else Path.cwd() / f"{name}-{qtype}{'-imat' if use_imatrix else ''}.gguf"
    if target.exists() and not force:
        raise DsqError(f"{target} already exists", "pass --force to overwrite it or choose another --out")
    if target.is_dir():
        raise DsqError(f"{target} is a directory", "pass a file path to --out")
    ref = resolve_model(str(src))
    if ref.kind == "hf":  # check the architecture before any work
        from dsq.formats.arch import arch_for_model_type
        from dsq.formats.hf import HFModelDir

        arch_for_model_type(HFModelDir(ref.path).model_type)
    if use_imatrix and (ref.kind != "hf" or qtype in FLOAT_TYPES):
        raise DsqError("--imatrix needs an HF source and a quantized --type", "pass the HF model directory")
    imat = None
    if use_imatrix:
        from dsq.quant.driver import QuantSpec
        from dsq.quant.imatrix import compute_imatrix

        spec = QuantSpec("gptq", calib=calib, calib_samples=calib_samples, calib_seq_len=calib_seq_len)
        with progress_bar(con) as p:
            task = p.add_task("importance matrix: blocks", total=None)
            imat = compute_imatrix(ref.path, spec, device=device,
                                   on_block=lambda i, n, dt: p.update(task, completed=i, total=n))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=".dsq-", dir=target.parent if target.parent.exists() else None) as td:
        if ref.kind == "hf":
            float_type = qtype if qtype in FLOAT_TYPES else "auto"
            dst = target if qtype in FLOAT_TYPES else Path(td) / "float.gguf"
            convert_with_progress(lambda cb: hf_to_gguf(ref.path, dst, float_type, force=force, progress=cb),
                                  f"{ref.path.name} -> GGUF", con)
            source_gguf = dst
        else:
            if qtype in FLOAT_TYPES:
                raise DsqError(f"{ref.path.name} is already a GGUF", "use `dsq convert` for float conversions")
            source_gguf = ref.path
        if qtype not in FLOAT_TYPES:
            with progress_bar(con, in_bytes=True) as p:
                task = p.add_task(f"quantizing to {qtype} (llama.cpp)", total=None)
                quantize_gguf(source_gguf, target, qtype, threads=threads, force=force, imatrix=imat,
                              progress=lambda done, total: p.update(task, completed=done, total=total))
    from dsq.formats.gguf_file import GGUFFile

    g = GGUFFile(target)
    n = sum(t.n_elements for t in g.tensors)
    size = target.stat().st_size
    con.print(f"[green]wrote[/green] {target} ({size / 2**20:.1f} MiB, {8 * size / max(n, 1):.2f} bits/weight, "
              f"{g.describe_quant()}) in {time.perf_counter() - t0:.1f}s")
    out_console().print(str(target))
