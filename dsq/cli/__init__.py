"""dsq's command line: one module per subcommand; heavy imports live inside command bodies so
`dsq --help` stays instant (it must not import torch)."""

from __future__ import annotations

from dsq.cli.common import app
from dsq.cli import bench, cache, chat, convert, eval, offload, pull, quantize, run, serve  # noqa: F401  (registers commands)


def main() -> None:
    app()
