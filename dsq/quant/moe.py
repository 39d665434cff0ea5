"""Mixture-of-experts models (DeepSeek V2 / V3) in the layer-by-layer methods.

- What stays 16-bit: the routers (`mlp.gate` is no Linear, so no method touches it, and vLLM and
  SGLang build it unquantized), the dense layers before the first MoE layer (DeepSeek-V3's first
  three, V2-Lite's first) unless `QuantSpec.quantize_dense`, and the `skip` patterns. `Kept` names
  those Linears for the artifact's quantization_config.
- Calibration: each routed expert is calibrated on the tokens its layer's own router sends it in
  the calibration forward (hooks on an expert's Linears see only those rows). An expert that got
  fewer than `QuantSpec.min_expert_tokens` is quantized by round-to-nearest instead
  (`calibrates`): a Hessian or a scale search fitted to a handful of tokens can do worse than
  plain rounding on the tokens it never saw.
- The record: a block's file carries its experts' token counts and fallbacks in its safetensors
  metadata (so a resumed run reports what an uninterrupted one does); dsq_quant.json and the
  model card list them per layer.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsq.quant.blocks import Block
    from dsq.quant.spec import QuantSpec

_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.")
METADATA_KEY = "dsq_experts"


def expert_of(name: str) -> int | None:
    """The routed expert a Linear (named inside its block) belongs to, or None."""
    m = _EXPERT.search(name)
    return int(m.group(1)) if m else None


def calibrates(block: "Block", name: str, tokens: int, spec: "QuantSpec") -> bool:
    """Whether Linear `name` is calibrated (True) or falls back to RTN (an expert that saw fewer
    than min_expert_tokens tokens); records an expert's count in the block."""
    e = expert_of(name)
    if e is None:
        return True
    block.routing[e] = tokens
    if tokens < spec.min_expert_tokens:
        block.fallback.add(e)
        return False
    return True


def skipped(full_name: str, spec: "QuantSpec") -> bool:
    """A Linear the `skip` patterns keep 16-bit."""
    return any(fnmatch.fnmatch(full_name, p) for p in spec.skip)


def dense_layers(args, spec: "QuantSpec") -> set[int]:
    """The leading dense layers of an MoE model that stay 16-bit (none unless it has experts,
    none with quantize_dense)."""
    if not getattr(args, "n_routed_experts", 0) or spec.quantize_dense:
        return set()
    return set(range(args.first_k_dense_replace))


@dataclass(frozen=True)
class Kept:
    """The decoder layers' Linears an artifact keeps 16-bit: whole layers, and every such Linear
    by its full name (those of the whole layers included)."""

    layers: tuple[int, ...] = ()
    modules: tuple[str, ...] = ()
    routers: bool = False  # the model has MoE routers (never quantized)

    def outside_layers(self) -> list[str]:
        return [m for m in self.modules if int(m.split(".")[2]) not in self.layers]

    def layer_prefixes(self) -> list[str]:
        return [f"model.layers.{i}." for i in self.layers]


def kept_linears(model, args, spec: "QuantSpec") -> Kept:
    """What `model` (built on the meta device) keeps 16-bit under `spec`."""
    from dsq.quant.blocks import linears

    dense = dense_layers(args, spec)
    names = [f"model.layers.{i}.{n}" for i, layer in enumerate(model.model.layers) for n in linears(layer)]
    modules = tuple(n for n in names if int(n.split(".")[2]) in dense or skipped(n, spec))
    return Kept(tuple(sorted(dense)), modules, bool(getattr(args, "n_routed_experts", 0)))


# -- the record --------------------------------------------------------------------------------
def block_metadata(block: "Block") -> dict[str, str]:
    """The block file's metadata entry: tokens per expert (by expert index) and the fallbacks."""
    if not block.routing:
        return {}
    tokens = [block.routing.get(e, 0) for e in range(max(block.routing) + 1)]
    return {METADATA_KEY: json.dumps({"tokens": tokens, "rtn": sorted(block.fallback)})}


def read_routing(files: list[Path]) -> dict[int, dict]:
    """Layer -> {"tokens": [...], "rtn": [...]} from the block files that carry one."""
    from safetensors import safe_open

    out = {}
    for i, f in enumerate(files):
        with safe_open(str(f), framework="pt") as st:
            meta = (st.metadata() or {}).get(METADATA_KEY)
        if meta:
            out[i] = json.loads(meta)
    return out


def card_lines(routing: dict[int, dict], spec: "QuantSpec") -> list[str]:
    """The model card's section on the experts' calibration."""
    if not routing:
        return []
    lines = ["", "## Routed experts", "",
             "Each expert was calibrated on the calibration tokens its layer's router sent it; an expert "
             f"with fewer than {spec.min_expert_tokens} was quantized by round-to-nearest (RTN).", "",
             "| layer | tokens per expert (expert 0, 1, ...) | RTN fallback |", "|---|---|---|"]
    for i, r in sorted(routing.items()):
        rtn = ", ".join(map(str, r["rtn"])) or "none"
        lines.append(f"| {i} | {' '.join(map(str, r['tokens']))} | {rtn} |")
    return lines
