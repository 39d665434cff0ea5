"""GGUF quantization types as data: the ftypes `dsq quantize --type` accepts, and their names.

Values are llama.cpp's `llama_ftype` enum (include/llama.h).
"""

from __future__ import annotations

# llama_ftype values for whole-file types
FTYPES: dict[str, int] = {
    "F32": 0,
    "F16": 1,
    "Q4_0": 2,
    "Q8_0": 7,
    "Q5_0": 8,
    "Q2_K": 10,
    "Q3_K_S": 11,
    "Q3_K_M": 12,
    "Q3_K_L": 13,
    "Q4_K_S": 14,
    "Q4_K_M": 15,
    "Q5_K_S": 16,
    "Q5_K_M": 17,
    "Q6_K": 18,
    "BF16": 32,
}
FTYPE_NAMES = {v: k for k, v in FTYPES.items()}

# What `dsq quantize --method gguf --type` offers (the float types are written directly).
QUANT_TYPES = ["Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q4_K_M", "Q4_K_S", "Q4_0", "Q5_0",
               "Q3_K_M", "Q3_K_S", "Q3_K_L", "Q2_K"]
FLOAT_TYPES = ["F32", "F16", "BF16"]


def parse_gguf_type(name: str) -> str:
    from dsq.errors import DsqError

    up = name.strip().upper()
    if up in FTYPES:
        return up
    raise DsqError(
        f"unknown GGUF type {name!r}",
        f"choose one of: {', '.join(QUANT_TYPES + FLOAT_TYPES)}",
    )
