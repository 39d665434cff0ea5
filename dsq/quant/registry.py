"""The quantization methods dsq knows, by the name `dsq quantize --method` takes."""

from __future__ import annotations

from dsq.errors import DsqError
from dsq.quant.awq import AWQ
from dsq.quant.fp8 import FP8
from dsq.quant.gguf import GGUF
from dsq.quant.gptq import GPTQ
from dsq.quant.method import Method
from dsq.quant.rtn import RTN

METHODS: dict[str, Method] = {m.name: m for m in (GGUF(), RTN(), AWQ(), GPTQ(), FP8())}


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise DsqError(f"unknown method {name!r}", f"choose one of: {', '.join(METHODS)}")
    return METHODS[name]


def spec_from_options(options: dict):
    """The spec of `options["method"]` from flat options: the CLI's flag names (qtype, bits,
    calib_samples, skip, ...), as `dsq quantize` and recipes give them."""
    return get_method(options["method"]).spec(options)
