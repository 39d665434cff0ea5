"""`dsq quantize`: a model -> a quantized artifact (GGUF K-quants through llama.cpp's quantizer)."""

from __future__ import annotations

import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from dsq.cli.common import Force, ModelArg, Threads, command


class Method(str, Enum):
    gguf = "gguf"


@command("quantize", examples=[
    "dsq quantize                                   # built-in model's bf16 export -> Q4_K_M GGUF",
    "dsq quantize ./DeepSeek-R1-Distill-Qwen-1.5B --type Q4_K_M --out r1-1.5b-Q4_K_M.gguf",
    "dsq quantize ./my-llama --type Q8_0 --out my-llama-Q8_0.gguf --force",
])
def quantize(
    model: ModelArg = None,
    method: Annotated[Method, typer.Option("--method", "-m", help="Quantization method.")] = Method.gguf,
    qtype: Annotated[str, typer.Option("--type", help="GGUF type: Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q3_K_M, Q2_K, ... "
                                                      "or F16/BF16/F32 for a float GGUF.")] = "Q4_K_M",
    out: Annotated[Optional[str], typer.Option("--out", "-o", help="Output path (default: NAME-TYPE.gguf here).")] = None,
    threads: Threads = None,
    force: Force = False,
) -> None:
    """Quantize a model. With no MODEL, the built-in model's bf16 export is the source.

    MODEL may be an HF directory (converted to GGUF by dsq, then quantized by llama.cpp's quantizer)
    or a float (F32/F16/BF16) GGUF.
    """
    from dsq.errors import DsqError
    from dsq.formats.gguf_types import FLOAT_TYPES, parse_gguf_type
    from dsq.ui import console, out_console, progress_bar

    qtype = parse_gguf_type(qtype)  # refuse a bad type before any work
    con = console()
    if model is None:
        from dsq.runtime.builtin import builtin_hf_export

        src = builtin_hf_export(con)
        name = "gemma-3-270m"
    else:
        src = Path(model)
        name = src.stem if src.is_file() else src.name
    target = Path(out) if out else Path.cwd() / f"{name}-{qtype}.gguf"
    if target.exists() and not force:
        raise DsqError(f"{target} already exists", "pass --force to overwrite it or choose another --out")
    if target.is_dir():
        raise DsqError(f"{target} is a directory", "pass a file path to --out")

    from dsq.runtime.model_ref import resolve_model

    ref = resolve_model(str(src))
    if ref.kind == "hf":  # check the architecture before any work
        from dsq.formats.arch import arch_for_model_type
        from dsq.formats.hf import HFModelDir

        arch_for_model_type(HFModelDir(ref.path).model_type)
    t0 = time.perf_counter()
    import tempfile

    from dsq.formats.hf_to_gguf import hf_to_gguf
    from dsq.quant.gguf import quantize_gguf
    from dsq.ui import convert_with_progress

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
                quantize_gguf(source_gguf, target, qtype, threads=threads, force=force,
                              progress=lambda done, total: p.update(task, completed=done, total=total))
    from dsq.formats.gguf_file import GGUFFile

    g = GGUFFile(target)
    n = sum(t.n_elements for t in g.tensors)
    size = target.stat().st_size
    con.print(f"[green]wrote[/green] {target} ({size / 2**20:.1f} MiB, {8 * size / max(n, 1):.2f} bits/weight, "
              f"{g.describe_quant()}) in {time.perf_counter() - t0:.1f}s")
    out_console().print(str(target))

