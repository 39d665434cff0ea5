"""Triton decode attention (one query token a sequence) over the KV cache, split along the cache
("flash decoding"): the GPU twin of kernels/cpu.py attn_decode, same arguments and result.

One query token reads the whole cache once; SDPA (cuDNN there) runs it as a prefill-shaped
kernel with one program per head and a mask conversion around it. Here each program takes one
KV head and its REP query heads (grouped-query attention: the keys and values are read once for
all of them) over a slice of the cache, keeps a running max and sum (online softmax) and writes
its unnormalized partial result; a second kernel combines the slices. Masked slots (past the
sequence, padding, outside a sliding window) are neither loaded nor counted, so a cache longer
than the sequence costs little.

`paged_attn_decode` is the same over a paged KV cache (dsq serve): keys and values in a pool of
fixed-size blocks (NB, Hk, block, D), each sequence's slots found through its row of a block
table, so no step gathers them into a contiguous copy.

Runs under TRITON_INTERPRET=1 on the CPU (the CI tests); `attn_decode_ref` is the oracle.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from dsq.kernels.triton_common import INTERPRET, sm_count
from dsq.kernels.triton_gemv_q8 import _q8_blocks, offer, q8_room


@triton.jit
def _scores(q, k, F32: tl.constexpr):
    """q (L, D) against k (BS, D): (L, BS) in float32."""
    if F32:
        return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    return tl.dot(q, tl.trans(k.to(q.dtype)))  # fp32 accumulation


@triton.jit
def _online(q, k, v, ok, m_i, l_i, acc, scale, F32: tl.constexpr):
    """One tile of slots into the running softmax: q (L, D) lines against k, v (BS, D), ok (L or
    1, BS) the slots each line may see; returns the new max m (L,), sum l (L,) and acc (L, D)."""
    return _online_s(_scores(q, k, F32), v, ok, m_i, l_i, acc, scale, q.dtype, F32)


@triton.jit
def _online_s(s, v, ok, m_i, l_i, acc, scale, dt: tl.constexpr, F32: tl.constexpr):
    """_online from the tile's scores s (L, BS) (before scaling); dt: the dtype p and v meet in
    on the tensor cores (without F32)."""
    s = tl.where(ok, s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a line with nothing seen yet: no NaN
    p = tl.exp(s - m_use[:, None])
    alpha = tl.exp(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if F32:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(dt), v.to(dt))
    return m_new, l_i, acc


ROWS = os.environ.get("DSQ_PAGED_ROWS", "1") != "0"  # one sequence's rows of a step read its cache together
# query lines (rows x heads of a KV head) an `_attn_rows` program takes: one MMA side (docs/benchmarks.md#dsq-serve)
ROW_LINES = 64


@triton.jit
def _shared_tile(seq_ptr, b0, B, RT: tl.constexpr):
    """Whether rows b0 .. b0 + RT (those below B) all belong to one sequence (seq_ptr: each row's)."""
    rr = b0 + tl.arange(0, RT)
    sq = tl.load(seq_ptr + rr, mask=rr < B, other=0)
    return tl.sum(((sq != tl.load(seq_ptr + b0)) & (rr < B)).to(tl.int32), axis=0) == 0


@triton.jit
def _span(l_ptr, b, sp, SPLIT, S, LENS: tl.constexpr):
    """The cache slots program `sp` of sequence b visits: (the first, how many, the sequence's
    end: S, or with LENS its length l[b])."""
    s0 = sp * SPLIT
    hi = SPLIT
    end = S
    if LENS:
        end = tl.minimum(S, tl.load(l_ptr + b).to(tl.int32))
        hi = tl.minimum(SPLIT, end - s0)
    return s0, hi, end


@triton.jit
def _slots(t_ptr, m_ptr, b, offs, end, s_tb, s_mb, BLK, PAGED: tl.constexpr):
    """Slots offs of sequence b: which may be seen (ok: masked or past the end are not loaded),
    and where each is: (block, row), the block the batch row b itself unless PAGED."""
    ok = tl.load(m_ptr + b * s_mb + offs, mask=offs < end, other=0) != 0
    if PAGED:
        blk = tl.load(t_ptr + b * s_tb + offs // BLK, mask=ok, other=0).to(tl.int64)
        row = offs % BLK
    else:
        blk = b
        row = offs
    return ok, blk, row


@triton.jit
def _store_part(acc_ptr, ml_ptr, out, acc, m_i, l_i, keep, D: tl.constexpr):
    """A program's partial results for its lines `out` where `keep`: acc (L, D), max and sum (L,)."""
    tl.store(acc_ptr + out[:, None] * D + tl.arange(0, D)[None, :], acc, mask=keep[:, None])
    tl.store(ml_ptr + out * 2, m_i, mask=keep)
    tl.store(ml_ptr + out * 2 + 1, l_i, mask=keep)


@triton.jit
def _attn_part(q_ptr, k_ptr, v_ptr, t_ptr, m_ptr, l_ptr, seq_ptr, acc_ptr, ml_ptr, B, S, HK, scale,
               s_qb, s_qh, s_kn, s_kh, s_ks, s_vn, s_vh, s_vs, s_tb, s_mb, BLK,
               SPLIT, REP: tl.constexpr, RP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, F32: tl.constexpr,
               PAGED: tl.constexpr, LENS: tl.constexpr, RT: tl.constexpr = 0):
    """Program (b * HK + hk, split): query heads hk * REP .. + REP of sequence b against cache slots
    split * SPLIT .. + SPLIT, in tiles of BS slots. Writes acc = sum_s p_s v_s (RP, D), and the
    running max m and sum l of p (RP,) per head, with p_s = exp(q k_s scale - m).

    Slot s of sequence b is row s of cache b (s_kn: the batch stride), or with PAGED row s % BLK of
    block t[b, s // BLK] (s_kn: the block stride). With LENS, slots from l[b] on are not visited
    (the mask is False there): a cache sized for the longest context costs a shorter sequence
    nothing past its length. RT > 0: rows whose tile of RT rows is one sequence's (`_attn_rows`
    takes those) are left alone."""
    bh = tl.program_id(0)
    sp = tl.program_id(1)
    b = bh // HK
    hk = bh % HK
    r = tl.arange(0, RP)
    d = tl.arange(0, D)
    rm = r < REP
    q = tl.load(q_ptr + b * s_qb + (hk * REP + r)[:, None] * s_qh + d[None, :], mask=rm[:, None], other=0)
    m_i = tl.full((RP,), float("-inf"), tl.float32)
    l_i = tl.zeros((RP,), tl.float32)
    acc = tl.zeros((RP, D), tl.float32)
    s0, hi, end = _span(l_ptr, b, sp, SPLIT, S, LENS)
    if RT > 0:
        skip = _shared_tile(seq_ptr, (b // RT) * RT, B, RT)
        hi = tl.where(skip, 0, hi)
        rm = tl.where(skip, 0, rm.to(tl.int32)) != 0  # (through int32: a bool where fails the interpreter's store)
    for t in range(0, hi, BS):
        ok, blk, row = _slots(t_ptr, m_ptr, b, s0 + t + tl.arange(0, BS), end, s_tb, s_mb, BLK, PAGED)
        k = tl.load(k_ptr + (blk * s_kn + hk * s_kh + row * s_ks)[:, None] + d[None, :], mask=ok[:, None], other=0)
        v = tl.load(v_ptr + (blk * s_vn + hk * s_vh + row * s_vs)[:, None] + d[None, :], mask=ok[:, None], other=0)
        m_i, l_i, acc = _online(q, k, v, ok[None, :], m_i, l_i, acc, scale, F32)
    out = (bh * tl.num_programs(1) + sp) * REP + r  # the real heads only (RP pads REP up to a dot's 16)
    _store_part(acc_ptr, ml_ptr, out, acc, m_i, l_i, rm, D)


@triton.jit
def _attn_rows(q_ptr, k_ptr, v_ptr, t_ptr, m_ptr, l_ptr, seq_ptr, acc_ptr, ml_ptr, B, S, HK, scale,
               s_qb, s_qh, s_kn, s_kh, s_ks, s_vn, s_vh, s_vs, s_tb, s_mb, BLK,
               SPLIT, REP: tl.constexpr, RPW: tl.constexpr, RT: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
               F32: tl.constexpr):
    """Program (tile * HK + hk, split): rows tile * RT .. + RT when they are all one sequence's
    (a prompt's tokens riding in a decode step), its query heads hk * REP .. + REP, over the paged
    cache slots split * SPLIT .. + SPLIT up to the longest row's length. The tile's RT * RPW query
    lines share each slot tile's keys and values, read once through the first row's block table,
    where `_attn_part` reads them once a row; each line's own mask and length leave out what it
    must not see (each row sees itself and the rows before it). Writes the same partial results
    as `_attn_part` (`_attn_combine` adds them up); a tile of several sequences writes nothing."""
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    tile = pid // HK
    hk = pid % HK
    M: tl.constexpr = RT * RPW
    i = tl.arange(0, M)
    r = tile * RT + i // RPW  # each line's row and head
    h = i % RPW
    lm = (r < B) & (h < REP)
    rc = tl.where(r < B, r, 0)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + rc[:, None] * s_qb + (hk * REP + h)[:, None] * s_qh + d[None, :], mask=lm[:, None], other=0)
    ln = tl.minimum(tl.load(l_ptr + rc, mask=lm, other=0).to(tl.int32), S)
    end = tl.max(ln, axis=0)
    s0 = sp * SPLIT
    shared = _shared_tile(seq_ptr, tile * RT, B, RT)
    hi = tl.where(shared, tl.minimum(SPLIT, end - s0), 0)
    lm = tl.where(shared, lm.to(tl.int32), 0) != 0
    tb = t_ptr + (tile * RT) * s_tb
    m_i = tl.full((M,), float("-inf"), tl.float32)
    l_i = tl.zeros((M,), tl.float32)
    acc = tl.zeros((M, D), tl.float32)
    for t in range(0, hi, BS):
        offs = s0 + t + tl.arange(0, BS)
        inb = offs < end
        blk = tl.load(tb + offs // BLK, mask=inb, other=0).to(tl.int64)
        row = offs % BLK
        ok = tl.load(m_ptr + rc[:, None] * s_mb + offs[None, :], mask=lm[:, None] & (offs[None, :] < ln[:, None]),
                     other=0) != 0  # (M, BS)
        k = tl.load(k_ptr + (blk * s_kn + hk * s_kh + row * s_ks)[:, None] + d[None, :], mask=inb[:, None], other=0)
        v = tl.load(v_ptr + (blk * s_vn + hk * s_vh + row * s_vs)[:, None] + d[None, :], mask=inb[:, None], other=0)
        m_i, l_i, acc = _online(q, k, v, ok, m_i, l_i, acc, scale, F32)
    out = ((rc * HK + hk) * tl.num_programs(1) + sp) * REP + h
    _store_part(acc_ptr, ml_ptr, out, acc, m_i, l_i, lm, D)


@triton.jit
def _attn_combine(acc_ptr, ml_ptr, o_ptr, xw_ptr, sx_ptr, xs_ptr, xb_ptr, H, s_ob, s_oh, NSPLIT, REP: tl.constexpr,
                  D: tl.constexpr, NSP: tl.constexpr, Q8: tl.constexpr = False):
    """Program b * H + h (one query head): its NSPLIT partial results into o = sum acc / sum l,
    each slice scaled by exp(m_slice - m_max). Q8 (D a multiple of 32): the head's D / 32 blocks of
    o, as stored, also rounded to int8 (words in nibble and in byte order) into row b of the output
    projection's x (triton_gemv_q8.offer), as the norm and the activation do."""
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    sp = tl.arange(0, NSP)
    d = tl.arange(0, D)
    spm = sp < NSPLIT
    row = ((b * (H // REP) + h // REP) * NSPLIT + sp) * REP + h % REP  # (NSP,)
    m = tl.load(ml_ptr + row * 2, mask=spm, other=float("-inf"))
    lsum = tl.load(ml_ptr + row * 2 + 1, mask=spm, other=0)
    mx = tl.max(m, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp(m - mx)  # an empty slice: exp(-inf) = 0
    den = tl.sum(w * lsum, axis=0)
    a = tl.load(acc_ptr + row[:, None] * D + d[None, :], mask=spm[:, None], other=0)  # (NSP, D)
    o = (tl.sum(a * w[:, None], axis=0) / tl.where(den > 0, den, 1.0)).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + b * s_ob + h * s_oh + d, o)
    if Q8:
        blk = h * (D // 32) + tl.arange(0, D // 32)
        _q8_blocks(tl.reshape(o.to(tl.float32), (D // 32, 4, 8)), blk, blk >= 0, xw_ptr + b * (H * D // 4),
                   sx_ptr + b * (H * D // 32), xs_ptr + b * (H * D // 32), True, xb_ptr + b * (H * D // 4), True)


def _partials(S: int, block: int, nsplit: int | None, programs: int, lines: int, D: int, device):
    """Slices of S cache slots for `programs` programs a slice (default: about two programs per
    SM in all), whole tiles of `block` each, and the partial results' buffers of `lines` lines a
    program: (slots a slice, slices, acc (.., D), ml (.., 2)) in float32."""
    tiles = triton.cdiv(S, block)
    if nsplit is None:
        nsplit = max(1, min(tiles, triton.cdiv(2 * sm_count(device), programs)))
    split = triton.cdiv(tiles, nsplit) * block
    nsplit = triton.cdiv(S, split)
    acc = torch.empty(programs * nsplit * lines, D, dtype=torch.float32, device=device)
    ml = torch.empty(programs * nsplit * lines, 2, dtype=torch.float32, device=device)
    return split, nsplit, acc, ml


def _decode(q, k, v, table, mask, scale, nsplit, block, paged: bool, lens=None, seq=None,
            q8: bool = False) -> torch.Tensor:
    """Both public entries: the partial results over `nsplit` slices of the cache (default: about
    two programs per SM), then their combination. With `seq` (paged, with lens), tiles of rows
    of one sequence go through `_attn_rows` and the other rows through `_attn_part`. With `q8`
    (and D a multiple of 32) the combination also rounds o to int8 for the output projection's
    q8 GEMV and offers it (triton_gemv_q8.offer)."""
    B, H, _, D = q.shape
    HK = k.shape[1]
    S = mask.shape[-1]
    rep = H // HK
    rp = max(16, triton.next_power_of_2(rep))  # tl.dot's smallest M
    split, nsplit, acc, ml = _partials(S, block, nsplit, B * HK, rep, D, q.device)
    f32 = q.dtype == torch.float32 or INTERPRET
    t, s_tb, blk = (table, table.stride(0), k.shape[2]) if paged else (mask, 0, 1)
    ln = mask if lens is None else lens  # (a pointer the kernel does not read without LENS)
    rows = ROWS and seq is not None and paged and lens is not None
    rpw = triton.next_power_of_2(rep)
    rt = max(1, ROW_LINES // rpw) if rows else 0
    args = (q, k, v, t, mask, ln, seq if rows else ln, acc, ml, B, S, HK, scale, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), s_tb, mask.stride(0), blk,
            split)
    warps = 4 if D <= 128 else 8  # D 256 on 4 warps: 255 registers
    _attn_part[(B * HK, nsplit)](*args, REP=rep, RP=rp, D=D, BS=block, F32=f32, PAGED=paged, LENS=lens is not None,
                                 RT=rt, num_warps=warps)
    if rows:
        _attn_rows[(triton.cdiv(B, rt) * HK, nsplit)](*args, REP=rep, RPW=rpw, RT=rt, D=D, BS=block, F32=f32,
                                                     num_warps=warps)
    o = torch.empty(B, 1, H, D, dtype=q.dtype, device=q.device)
    xq = q8_room(B, H * D, q.device, both=True) if q8 and D % 32 == 0 else None
    _attn_combine[(B * H,)](acc, ml, o, *(xq or (o, o, o, o)), H, o.stride(0), o.stride(2), nsplit, REP=rep, D=D,
                            NSP=triton.next_power_of_2(nsplit), Q8=xq is not None, num_warps=1)
    o = o.reshape(B, 1, H * D)
    if xq is not None:
        offer(o, xq)
    return o


def paged_attn_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                      mask: torch.Tensor, scale: float, nsplit: int | None = None, block: int = 64,
                      lens: torch.Tensor | None = None, seq: torch.Tensor | None = None) -> torch.Tensor:
    """attn_decode over a paged cache: q (B, H, 1, D); k_pool / v_pool (NB, Hk, BLK, D), the last
    dimension contiguous; table (B, n) block ids (int32 or int64), row b's slot s in block
    table[b, s // BLK]; mask (B, 1, 1, S) bool with S <= n * BLK -> (B, 1, H * D) in q's dtype.
    lens (B,) integers, optional: row b's mask is False from lens[b] on, and those slots are
    skipped (a captured step's S is the longest context). seq (B,) integers, optional, with lens:
    which sequence each row is (rows of one sequence share their table row): consecutive rows of
    one sequence, a prompt's tokens in one step, then read each key and value once a tile of
    them rather than once a row (`_attn_rows`)."""
    B, H = q.shape[:2]
    assert table.shape[0] == B and mask.shape[-1] <= table.shape[1] * k_pool.shape[2] and mask.stride(-1) == 1
    assert k_pool.stride(-1) == 1 and v_pool.stride(-1) == 1 and H % k_pool.shape[1] == 0
    assert lens is None or (lens.shape == (B,) and lens.is_contiguous())
    assert seq is None or (lens is not None and seq.shape == (B,) and seq.is_contiguous())
    return _decode(q, k_pool, v_pool, table, mask, scale, nsplit, block, paged=True, lens=lens, seq=seq)


@triton.jit
def _mla_part(ql_ptr, qr_ptr, c_ptr, t_ptr, m_ptr, l_ptr, acc_ptr, ml_ptr, S, G, scale,
              s_lb, s_lh, s_rb, s_rh, s_cn, s_cs, s_tb, s_mb, BLK, SPLIT,
              HG: tl.constexpr, HP: tl.constexpr, R: tl.constexpr, P: tl.constexpr, BS: tl.constexpr,
              F32: tl.constexpr, PAGED: tl.constexpr, LENS: tl.constexpr):
    """MLA's absorbed decode attention, program (b * G + g, split): query heads g * HG .. + HG of
    sequence b, their latent part ql (HG, R) and rope part qr (HG, P), against latent rows
    [c (R) | k_rope (P)] of cache slots split * SPLIT .. + SPLIT: scores ql c + qr k_rope, values
    c. Writes _attn_part's partial results (acc (HG, R), m, l), heads grouped by G as its KV heads.
    Slots, PAGED and LENS as in _attn_part."""
    bg = tl.program_id(0)
    sp = tl.program_id(1)
    b = bg // G
    g = bg % G
    h = tl.arange(0, HP)
    hm = h < HG
    r = tl.arange(0, R)
    pr = tl.arange(0, P)
    ql = tl.load(ql_ptr + b * s_lb + (g * HG + h)[:, None] * s_lh + r[None, :], mask=hm[:, None], other=0)
    qr = tl.load(qr_ptr + b * s_rb + (g * HG + h)[:, None] * s_rh + pr[None, :], mask=hm[:, None], other=0)
    m_i = tl.full((HP,), float("-inf"), tl.float32)
    l_i = tl.zeros((HP,), tl.float32)
    acc = tl.zeros((HP, R), tl.float32)
    s0, hi, end = _span(l_ptr, b, sp, SPLIT, S, LENS)
    for t in range(0, hi, BS):
        ok, blk, slot = _slots(t_ptr, m_ptr, b, s0 + t + tl.arange(0, BS), end, s_tb, s_mb, BLK, PAGED)
        row = blk * s_cn + slot * s_cs
        c = tl.load(c_ptr + row[:, None] + r[None, :], mask=ok[:, None], other=0)  # (BS, R): keys and values
        kr = tl.load(c_ptr + row[:, None] + R + pr[None, :], mask=ok[:, None], other=0)  # (BS, P)
        sc = _scores(ql, c, F32) + _scores(qr, kr, F32)
        m_i, l_i, acc = _online_s(sc, c, ok[None, :], m_i, l_i, acc, scale, ql.dtype, F32)
    _store_part(acc_ptr, ml_ptr, (bg * tl.num_programs(1) + sp) * HG + h, acc, m_i, l_i, hm, R)


# MLA query heads a program takes (tl.dot's smallest M): V3's 128 heads are 8 programs a sequence,
# each reading the latent rows (from L2 after the first) and holding a (16, 512) float32 result
MLA_HEADS = 16


def mla_supported(q_lat: torch.Tensor, q_rope: torch.Tensor, c: torch.Tensor, mask: torch.Tensor) -> bool:
    """q_lat (B, 1, H, R) and q_rope (B, 1, H, P), R and P powers of two from 16, unit last
    strides; c (B or blocks, 1, S or block, R + P) with a unit last stride; mask (B, 1, 1, S) bool."""
    B, T, H, R = q_lat.shape
    P = q_rope.shape[-1]
    return (T == 1 and q_rope.shape[:3] == (B, 1, H) and c.dim() == 4 and c.shape[1] == 1 and c.shape[-1] == R + P
            and all(16 <= n <= 1024 and n & (n - 1) == 0 for n in (R, P)) and q_lat.stride(-1) == 1
            and q_rope.stride(-1) == 1 and c.stride(-1) == 1 and mask.dtype == torch.bool and mask.dim() == 4
            and mask.shape[:3] == (B, 1, 1) and mask.stride(-1) == 1 and q_lat.dtype == q_rope.dtype
            and q_lat.dtype in (torch.float16, torch.bfloat16, torch.float32))


def mla_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, c: torch.Tensor, mask: torch.Tensor, scale: float,
               table: torch.Tensor | None = None, lens: torch.Tensor | None = None, nsplit: int | None = None,
               block: int = 32) -> torch.Tensor:
    """DeepSeek MLA's absorbed decode attention over its latent cache, for one query token a
    sequence: softmax((q_lat c^T + q_rope k_rope^T) scale, masked) c, where each cached row is
    [c (R) | k_rope (P)]. q_lat (B, 1, H, R), q_rope (B, 1, H, P); c (B, 1, S, R + P), or with
    `table` (B, n) a paged pool (NB, 1, BLK, R + P) read through it (as paged_attn_decode, `lens`
    optional); mask (B, 1, 1, S) bool. Returns o_lat (B, 1, H, R) in q_lat's dtype (rows with
    nothing to attend 0). The latent rows are read once for all heads of a program."""
    B, _, H, R = q_lat.shape
    P = q_rope.shape[-1]
    S = mask.shape[-1]
    assert block >= 16 and block & (block - 1) == 0, "block: a power of two of at least 16 (tl.dot's least tile)"
    hg = min(MLA_HEADS, triton.next_power_of_2(H))
    if H % hg:
        hg = H  # (a head count that is no multiple of 16: one group, padded)
    G = H // hg
    split, nsplit, acc, ml = _partials(S, block, nsplit, B * G, hg, R, q_lat.device)
    f32 = q_lat.dtype == torch.float32 or INTERPRET
    paged = table is not None
    t, s_tb, blk = (table, table.stride(0), c.shape[2]) if paged else (mask, 0, 1)
    _mla_part[(B * G, nsplit)](q_lat, q_rope, c, t, mask, lens if lens is not None else mask, acc, ml, S, G, scale,
                               q_lat.stride(0), q_lat.stride(2), q_rope.stride(0), q_rope.stride(2), c.stride(0),
                               c.stride(2), s_tb, mask.stride(0), blk, split, HG=hg,
                               HP=max(16, triton.next_power_of_2(hg)), R=R, P=P, BS=block, F32=f32, PAGED=paged,
                               LENS=lens is not None, num_warps=8)
    o = torch.empty(B, 1, H, R, dtype=q_lat.dtype, device=q_lat.device)
    _attn_combine[(B * H,)](acc, ml, o, o, o, o, o, H, o.stride(0), o.stride(2), nsplit, REP=hg, D=R,
                            NSP=triton.next_power_of_2(nsplit), num_warps=4)
    return o


def mla_decode_ref(q_lat: torch.Tensor, q_rope: torch.Tensor, c: torch.Tensor, mask: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """mla_decode's oracle over a contiguous cache c (B, 1, S, R + P), in float64: (B, 1, H, R)."""
    R = q_lat.shape[-1]
    k = c[:, 0].double()  # (B, S, R + P)
    q = torch.cat((q_lat, q_rope), -1)[:, 0].double()  # (B, H, R + P)
    s = (q @ k.transpose(-1, -2)) * scale  # (B, H, S)
    s = s.masked_fill(~mask[:, 0], float("-inf"))
    p = torch.nan_to_num(s.softmax(-1), nan=0.0)
    return (p @ k[..., :R])[:, None]


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> bool:
    """One query token, heads a multiple of the KV heads, a power-of-two head size 16..256, keys
    and values contiguous along the head dimension, a bool mask (B, 1, 1, S)."""
    B, H, T, D = q.shape
    return (T == 1 and k.dim() == 4 and k.shape[0] == B and H % k.shape[1] == 0 and k.shape == v.shape
            and k.shape[-1] == D and 16 <= D <= 256 and D & (D - 1) == 0 and q.stride(-1) == 1
            and k.stride(-1) == 1 and v.stride(-1) == 1 and mask.dtype == torch.bool
            and mask.shape == (B, 1, 1, k.shape[2]) and mask.stride(-1) == 1
            and q.dtype in (torch.float16, torch.bfloat16, torch.float32))


def attn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                nsplit: int | None = None, block: int = 64, q8: bool = False) -> torch.Tensor:
    """softmax(q k^T scale, masked) v for one query token: q (B, H, 1, D), k/v (B, Hk, S, D),
    mask (B, 1, 1, S) bool (True: attend) -> (B, 1, H * D) in q's dtype (rows with nothing to
    attend are 0). `nsplit` slices of the cache (default: about two programs per SM). `q8`: the
    result also rounded to int8 for the q8 GEMV that reads it next, in the same launch (_decode)."""
    return _decode(q, k, v, None, mask, scale, nsplit, block, paged=False, q8=q8)


def attn_decode_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """The oracle, in float64: (B, 1, H * D), rows with nothing to attend 0."""
    B, H, _, D = q.shape
    rep = H // k.shape[1]
    kr = k.double().repeat_interleave(rep, 1)
    vr = v.double().repeat_interleave(rep, 1)
    s = (q.double() @ kr.transpose(-1, -2)) * scale  # (B, H, 1, S)
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.nan_to_num(s.softmax(-1), nan=0.0)
    return (p @ vr).transpose(1, 2).reshape(B, 1, H * D)
