"""llama3 rope scaling as GGUF stores it: a `rope_freqs.weight` tensor of per-frequency divisors
(llama.cpp's convert_hf_to_gguf), and the settings recovered from one."""

from __future__ import annotations


def llama3_rope_factors(rope: dict, head_dim: int):
    """Per-frequency divisors for llama3 rope scaling, written as `rope_freqs.weight`."""
    import math

    import torch

    base = rope.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor = rope.get("factor", 8.0)
    lo, hi = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    lo_wl, hi_wl = old_ctx / lo, old_ctx / hi
    out = []
    for f in freqs.tolist():
        wl = 2 * math.pi / f
        if wl < hi_wl:
            out.append(1.0)
        elif wl > lo_wl:
            out.append(factor)
        else:
            smooth = (old_ctx / wl - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def llama3_rope_from_factors(factors, rope_theta: float, head_dim: int) -> dict | None:
    """Recover llama3 rope-scaling settings from a GGUF `rope_freqs` tensor (the inverse of
    `llama3_rope_factors`), assuming the usual low/high frequency factors 1 and 4. None when no
    setting reproduces the tensor."""
    import math

    import numpy as np

    f = np.asarray(factors, dtype=np.float64)
    big = float(f.max())
    lo, hi = 1.0, 4.0
    freqs = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2) / head_dim))
    wl = 2 * math.pi / freqs
    mid = (f > 1 + 1e-6) & (f < big - 1e-6)
    cands = []
    if mid.any():
        s = (1 / f[mid] - 1 / big) / (1 - 1 / big)
        cands.append(int(round(float(np.median((s * (hi - lo) + lo) * wl[mid])))))
    cands += [8192, 4096, 16384, 32768, 2048, 131072]
    for old in cands:
        rope = {"rope_type": "llama3", "rope_theta": rope_theta, "factor": big, "low_freq_factor": lo,
                "high_freq_factor": hi, "original_max_position_embeddings": old}
        if np.allclose(llama3_rope_factors(rope, head_dim).numpy(), f, rtol=1e-4, atol=1e-4):
            return rope
    return None
