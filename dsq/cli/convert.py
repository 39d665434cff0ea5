"""`dsq convert`: GGUF -> HF safetensors (dequantized) and HF -> GGUF (float)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from dsq.cli.common import command
from dsq.cli.options import Force, Revision


@command("convert", examples=[
    "dsq convert                               # export the built-in model to bf16 HF (cached)",
    "dsq convert model-Q4_K_M.gguf model-hf/    # GGUF -> HF, dequantized to bf16",
    "dsq convert model-hf/ model-f16.gguf --outtype f16",
    "dsq convert deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B r1-1.5b-f16.gguf --outtype f16",
])
def convert(
    src: Annotated[Optional[str], typer.Argument(help="A .gguf file, an HF model directory or a Hugging Face repo id "
                                                      "(org/name, org/name:Q8_0); omit for the built-in model.",
                                                 show_default=False)] = None,
    out: Annotated[Optional[str], typer.Argument(help="Output: an HF directory (from GGUF) or a .gguf file (from HF).",
                                                 show_default=False)] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="HF output dtype: bfloat16, float16 or float32.")] = "bfloat16",
    outtype: Annotated[str, typer.Option("--outtype", help="GGUF output type: auto, f16, bf16 or f32.")] = "auto",
    force: Force = False,
    revision: Revision = None,
) -> None:
    """Convert between GGUF and HF safetensors.

    With no SRC, the built-in model is exported once to dsq's cache as a bf16 HF directory: the
    float source `dsq quantize` uses when given no model.
    """
    from dsq.errors import DsqError
    from dsq.ui import console, out_console

    dtype = {"bf16": "bfloat16", "f16": "float16", "fp16": "float16", "f32": "float32", "fp32": "float32"}.get(
        dtype.lower(), dtype.lower())
    if dtype not in ("bfloat16", "float16", "float32"):
        raise DsqError(f"unknown --dtype {dtype!r}", "use bfloat16, float16 or float32")
    if src is None:
        if out is not None:
            raise DsqError("OUT given without SRC", "pass both, or neither to export the built-in model")
        from dsq.runtime.builtin import builtin_hf_export

        path = builtin_hf_export(console())
        out_console().print(str(path))
        return
    from dsq.cli.options import check_output_path
    from dsq.runtime.model_ref import resolve_model

    ref = resolve_model(src, console(), revision)
    if out is not None:
        check_output_path(Path(out), "OUT")
    here = Path.cwd() if ref.repo else ref.path.parent  # a repo's output goes here, not into the HF cache
    if ref.kind == "gguf":
        from dsq.convert.gguf_to_hf import gguf_to_hf
        from dsq.formats.gguf_file import GGUFFile
        from dsq.models.registry import arch_for_gguf
        from dsq.runtime.chat_template import fallback_for

        target = Path(out) if out else here / (ref.path.stem + "-hf")
        if target.exists() and not force:
            raise DsqError(f"{target} already exists", "pass --force to overwrite it or choose another OUT")
        arch = GGUFFile(ref.path).arch
        arch_for_gguf(arch)  # refuse early, before any work
        gguf_to_hf(ref.path, target, dtype=dtype, force=force, console=console(),
                   fallback_template=fallback_for(arch))
    else:
        from dsq.convert.hf_to_gguf import hf_to_gguf
        from dsq.ui import convert_with_progress

        name = ref.repo.split("/")[-1] if ref.repo else ref.path.name
        target = Path(out) if out else here / (name + ".gguf")
        if target.exists() and not force:
            raise DsqError(f"{target} already exists", "pass --force to overwrite it or choose another OUT")
        convert_with_progress(lambda cb: hf_to_gguf(ref.path, target, outtype, force=force, progress=cb),
                              f"converting {name} to GGUF", console())
    console().print(f"[green]wrote[/green] {target} ({_size(target) / 2**20:.1f} MiB)", highlight=False)
    out_console().print(str(target))


def _size(path: Path) -> int:
    """A file's bytes, or a folder's files' together."""
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
