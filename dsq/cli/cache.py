"""`dsq cache`: what dsq keeps in its cache folder, and --clear to remove it."""

from __future__ import annotations

from typing import Annotated

import typer

from dsq.cli.common import command


@command("cache", examples=[
    "dsq cache            # what the cache holds, and its size",
    "dsq cache --clear    # remove it all (each part is remade when next needed)",
])
def cache(
    clear: Annotated[bool, typer.Option("--clear", help="Remove what dsq keeps there.")] = False,
) -> None:
    """Show what dsq keeps in its cache folder (DSQ_CACHE, else ~/.cache/dsq) and its size.

    The cache holds the built-in model assembled from its package and its bf16 export, HF models
    converted to GGUF for llama.cpp, and this machine's calibration. Everything there is remade
    when next needed: the built-in model in seconds, a conversion when its model next runs.
    """
    from dsq.runtime.builtin import cache_dir
    from dsq.runtime.cache import cache_contents, clear_cache
    from dsq.ui import console, out_console

    if clear:
        freed = clear_cache()
        console().print(f"cleared {cache_dir()}: {_mib(freed)} freed")
        return
    out = out_console()
    entries = cache_contents()
    out.print(f"{cache_dir()}: {_mib(sum(e.bytes for e in entries if e.dsq))}", highlight=False)
    for e in entries:
        out.print(f"  {e.path.name:<20} {_mib(e.bytes):>12}  {e.what}", highlight=False, markup=False)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
