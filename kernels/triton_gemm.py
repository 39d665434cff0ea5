"""Float x against a packed weight with dequantized tiles fed to `tl.dot` (tensor cores): `_gemm`,
BM rows of x a program, M the fastest grid axis so weight tiles are reused from L2. It takes the
rows and formats no faster kernel does (kernels/dispatch.py). `packed_linear` is float x at any
row count: the GEMV (triton_gemv.py) at one row, this GEMM above.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from dsq.kernels.packed import Packed
from dsq.kernels.triton_common import (FMT_KEYS, INTERPRET, autotune, dequant_tile, float_args, fmt_flags,
                                       grouped_tile, plane_args)
from dsq.kernels.triton_gemv import gemv_linear


@triton.jit
def _gemm(x_ptr, y_ptr, bias_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, M, N, K, s_xm, s_ym,
          s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin,
          CODES: tl.constexpr, HI_BITS: tl.constexpr, SUB: tl.constexpr, SC_ROWS: tl.constexpr,
          TWO_LEVEL: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr, MINS: tl.constexpr,
          HAS_BIAS: tl.constexpr, F32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
          tile_ptr=None, GROUPED: tl.constexpr = False):
    """M > 1: tiles dequantized in registers (dequant_tile) into tl.dot. GROUPED: the weight stacks
    experts of N rows each, and program_id(0) is a row tile of tile_ptr's (expert, first row of x
    and y, rows <= BM): that expert's rows against those rows of x."""
    if GROUPED:
        ex, r0, M = grouped_tile(tile_ptr, tl.program_id(0))
        x_ptr += r0 * s_xm
        y_ptr += r0 * s_ym
        row = ex * N  # the expert's first weight row
        lo_ptr += row * s_lo
        hi_ptr += row * s_hi
        sc_ptr += row // SC_ROWS * s_sc
        d_ptr += row * s_d
        zp_ptr += row * s_zp
        mn_ptr += row * s_mn
        dmin_ptr += row * s_dmin
        rm = tl.arange(0, BM)
    else:
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    kt = tl.arange(0, BK)
    k_end = K
    if GROUPED:
        k_end = K * tl.minimum(M, 1)  # a tile past the last (a table made on the device) reads nothing
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, k_end, BK):
        wf = dequant_tile(lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, rn, k0, N, K, s_lo, s_hi, s_sc, s_d,
                          s_zp, s_mn, s_dmin, CODES, HI_BITS, SUB, SC_ROWS, TWO_LEVEL, ZERO, OFFSET, MINS, BN, BK)
        kk = k0 + kt
        xt = tl.load(x_ptr + rm[:, None] * s_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0)
        if F32:
            acc += tl.dot(xt.to(tl.float32), tl.trans(wf), input_precision="ieee")
        else:
            acc += tl.dot(xt, tl.trans(wf.to(xt.dtype)))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0).to(tl.float32)[None, :]
    ym = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm[:, None] * s_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=ym)


def _m_bucket(m: int) -> int:
    return 16 if m <= 16 else 64 if m <= 64 else 256 if m <= 256 else 1024


@triton.jit
def _gemm_bucketed(x_ptr, y_ptr, bias_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, M, N, K,
                   s_xm, s_ym, s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin, M_BUCKET,
                   CODES: tl.constexpr, HI_BITS: tl.constexpr, SUB: tl.constexpr, SC_ROWS: tl.constexpr,
                   TWO_LEVEL: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr, MINS: tl.constexpr,
                   HAS_BIAS: tl.constexpr, F32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr):
    """_gemm with an extra M_BUCKET argument so the autotuner keeps one choice per size class."""
    _gemm(x_ptr, y_ptr, bias_ptr, lo_ptr, hi_ptr, sc_ptr, d_ptr, zp_ptr, mn_ptr, dmin_ptr, M, N, K, s_xm, s_ym,
          s_lo, s_hi, s_sc, s_d, s_zp, s_mn, s_dmin, CODES, HI_BITS, SUB, SC_ROWS, TWO_LEVEL, ZERO, OFFSET, MINS,
          HAS_BIAS, F32, BM, BN, BK)


def _prune_gemm(configs, named_args, **kw):
    """Small M: only BM=16 tiles; large M: no BM=16 tiles."""
    small = named_args["M_BUCKET"] <= 16
    return [c for c in configs if (c.kwargs["BM"] == 16) == small] or configs


# BM 16 tiles for up to 16 rows of x, larger ones above (_prune_gemm)
_GEMM_CONFIGS = [triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=s)
                 for bm, bn, bk, w, s in [(16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 32, 256, 4, 3),
                                          (64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 64, 128, 8, 3)]]
_gemm_tuned = autotune(_GEMM_CONFIGS, ["N", "K", "M_BUCKET", *FMT_KEYS],
                       prune_configs_by={"early_config_prune": _prune_gemm})(_gemm_bucketed)


def gemm_linear(x: torch.Tensor, p: Packed, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                config: dict | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for rows of float x through _gemm, y in x's dtype. `out` (M, N) may be
    given (the tests poison it); `config` (BM, BN, BK) fixes the tiles (no autotuning)."""
    x2, y, planes, strides, flags, b = float_args(x, p, bias, out)
    M = x2.shape[0]
    flags["F32"] = x.dtype == torch.float32 or INTERPRET  # float32 dots: float32 x, and the interpreter's bf16 dot is wrong
    if config is None and not INTERPRET:
        grid = lambda meta: (triton.cdiv(M, meta["BM"]), triton.cdiv(p.N, meta["BN"]))  # noqa: E731
        _gemm_tuned[grid](x2, y, b, *planes, M, p.N, p.K, x2.stride(0), y.stride(0), *strides, _m_bucket(M), **flags)
    else:
        cfg = config or {"BM": 16, "BN": 16, "BK": 64}
        grid = (triton.cdiv(M, cfg["BM"]), triton.cdiv(p.N, cfg["BN"]))
        _gemm[grid](x2, y, b, *planes, M, p.N, p.K, x2.stride(0), y.stride(0), *strides, **flags, **cfg)
    return y.reshape(*x.shape[:-1], p.N)


def packed_linear(x: torch.Tensor, p: Packed, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for float x and a Packed weight on x's device, y in x's dtype: one row
    through the GEMV (triton_gemv.gemv_linear), more through _gemm. `out` (M, N) may be given
    (the tests poison it); `config` fixes the tile sizes (no autotuning)."""
    if x.numel() // p.K == 1:
        return gemv_linear(x, p, bias, out, config)
    return gemm_linear(x, p, bias, out, config)


# rows a tile of the grouped GEMM: an expert's rows in a prompt chunk are tens (V2-Lite: 512 tokens x 6 of 64
# experts = 48 an expert), and the tile table is made for one BM, so the autotuner picks the rest among
# _GEMM_CONFIGS' larger tiles; benchmarks.moe_prefill times the path and prints the autotuner's picks
# (docs/benchmarks.md#part-3-again-serve-ahead-of-llama-server-h100-machine-2026-12-07-night)
_GROUPED_CONFIGS = [triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=s)
                    for bn, bk, w, s in [(64, 64, 4, 4), (128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3)]]
_gemm_grouped = autotune(_GROUPED_CONFIGS, ["N", "K", "BM", *FMT_KEYS])(_gemm)


def grouped_linear(x: torch.Tensor, p: Packed, counts, n_expert: int, config: dict | None = None) -> torch.Tensor:
    """y (P, N) = each row of float x (P, K) through its expert's weight, the rows grouped by expert
    in order (counts[e] rows of expert e: a list, or an int tensor on x's device, read there without
    a host sync); `p` stacks n_expert weights of N = p.N / n_expert rows (any format the float-x
    kernels take). One launch for every expert and tile of up to BM of its rows, each dequantizing
    its expert's tiles in registers into tl.dot: no weight written out. `config` (BN, BK[, BM]) fixes
    the tiles (no autotuning); y in x's dtype."""
    from dsq.kernels.triton_mma import grouped_tile_table, tile_rows

    N, K = p.N // n_expert, p.K
    if (p.N % n_expert or len(counts) != n_expert or p.perm is not None
            or (not isinstance(counts, torch.Tensor) and sum(counts) != x.shape[0])):
        raise ValueError("grouped_linear takes a stack of n_expert weights without act-order and counts per expert")
    if p.fmt.sc_rows > 1 and N % p.fmt.sc_rows:
        raise ValueError("grouped_linear: an expert's rows are whole blocks of scale rows")
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    P = x2.shape[0]
    y = torch.empty(P, N, dtype=x.dtype, device=x.device)
    bm = (config or {}).get("BM") or (16 if tile_rows(counts, P, n_expert) <= 16 else 64)
    tile, n = grouped_tile_table(counts, bm, P, x.device)
    if not n or not P:
        return y
    planes, strides = plane_args(p)
    flags = {**fmt_flags(p), "HAS_BIAS": False, "F32": x.dtype == torch.float32 or INTERPRET, "BM": bm,
             "tile_ptr": tile, "GROUPED": True}
    args = (x2, y, y, *planes, 0, N, K, x2.stride(0), y.stride(0), *strides)
    if config is None and not INTERPRET:
        _gemm_grouped[lambda meta: (n, triton.cdiv(N, meta["BN"]))](*args, **flags)
    else:
        cfg = {"BN": 16, "BK": 64, **{k: v for k, v in (config or {}).items() if k != "BM"}}
        _gemm[(n, triton.cdiv(N, cfg["BN"]))](*args, **flags, **cfg)
    return y
