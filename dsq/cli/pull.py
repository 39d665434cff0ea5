"""`dsq pull`: fetch a model from the Hugging Face Hub into its cache, without running it."""

from __future__ import annotations

from typing import Annotated

import typer

from dsq.cli.common import command
from dsq.cli.options import Revision


@command("pull", examples=[
    "dsq pull deepseek-ai/DeepSeek-R1-Distill-Qwen-7B            # the HF model (safetensors)",
    "dsq pull unsloth/DeepSeek-R1-Distill-Qwen-7B-GGUF:Q4_K_M    # one quant of a GGUF repo",
    "dsq pull org/name/model-Q8_0.gguf --revision v1.1",
])
def pull(
    model: Annotated[str, typer.Argument(help="A Hugging Face repo id: org/name (an HF model), org/name:QUANT or "
                                              "org/name/file.gguf (a GGUF repo).", show_default=False)],
    revision: Revision = None,
) -> None:
    """Download a model from the Hugging Face Hub and print where it is, without running it.

    It goes into the Hugging Face cache (HF_HOME, else ~/.cache/huggingface; shared with
    transformers and the rest), where every command finds it by the same repo id. Only what dsq loads is fetched: safetensors, config and tokenizer files, or the GGUF file(s)
    of one quant (every part of a split GGUF); never pickled weights or code. The token comes from
    HF_TOKEN or `hf auth login`; HF_ENDPOINT picks the Hub; HF_HUB_OFFLINE=1 uses the cache only.
    An interrupted download resumes when run again. `dsq cache` lists what was pulled.
    """
    from dsq.errors import DsqError
    from dsq.runtime.hub import fetch, parse_repo_id
    from dsq.ui import console, out_console

    rid = parse_repo_id(model)
    if rid is None:
        raise DsqError(f"{model!r} is not a Hugging Face repo id",
                       "pass org/name, org/name:Q4_K_M or org/name/file.gguf")
    con = console()
    path = fetch(rid, revision, con)
    con.print(f"[green]pulled[/green] {rid}" + (f" at {revision}" if revision else ""), highlight=False)
    out_console().print(str(path), highlight=False, markup=False)
