"""`dsq cache`: what dsq keeps in its cache folder, and --clear to remove it; the models in the
Hugging Face cache (`dsq pull`, repo ids), and --remove to remove one."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dsq.cli.common import command


@command("cache", examples=[
    "dsq cache            # what the cache holds, and its size",
    "dsq cache --clear    # remove it all (each part is remade when next needed)",
    "dsq cache --remove deepseek-ai/DeepSeek-R1-Distill-Qwen-7B   # a model pulled from the Hub",
])
def cache(
    clear: Annotated[bool, typer.Option("--clear", help="Remove what dsq keeps there.")] = False,
    remove: Annotated[Optional[str], typer.Option("--remove", help="Remove this repo (org/name, every revision) "
                                                                   "from the Hugging Face cache.",
                                                  show_default=False)] = None,
) -> None:
    """Show what dsq keeps in its cache folder (DSQ_CACHE, else ~/.cache/dsq) and its size.

    The cache holds the built-in model assembled from its package and its bf16 export, HF models
    converted to GGUF for llama.cpp, and this machine's calibration. Everything there is remade
    when next needed: the built-in model in seconds, a conversion when its model next runs.

    Below it, the models in the Hugging Face cache (HF_HOME, else ~/.cache/huggingface; shared
    with transformers and the rest): each repo, the revisions it was fetched at, its size.
    """
    from dsq.runtime.builtin import cache_dir
    from dsq.runtime.cache import cache_contents, clear_cache
    from dsq.runtime.hub import cached_repos, hub_cache_dir, remove_cached
    from dsq.ui import console, out_console

    if remove:
        freed = remove_cached(remove)
        console().print(f"removed {remove} from {hub_cache_dir()}: {_mib(freed)} freed", highlight=False)
    if clear:
        freed = clear_cache()
        console().print(f"cleared {cache_dir()}: {_mib(freed)} freed")
    if remove or clear:
        return
    out = out_console()
    entries = cache_contents()
    out.print(f"{cache_dir()}: {_mib(sum(e.bytes for e in entries if e.dsq))}", highlight=False)
    for e in entries:
        out.print(f"  {e.path.name:<20} {_mib(e.bytes):>12}  {e.what}", highlight=False, markup=False)
    repos = cached_repos()
    out.print(f"{hub_cache_dir()} (Hugging Face): {_mib(sum(r.bytes for r in repos))}", highlight=False)
    for r in repos:
        out.print(f"  {r.repo:<40} {_mib(r.bytes):>12}  {', '.join(r.revisions)}", highlight=False, markup=False)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
