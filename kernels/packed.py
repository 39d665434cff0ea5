"""One GPU weight layout for every quantized format: `Packed`, what the Triton kernels read.

Every format becomes row-major planes, rows = output features, contiguous along K, so a tile of
rows x K streams with wide coalesced loads and the same kernel serves GEMV (decode) and tl.dot
(prefill):
- codes: 4-bit formats keep pairs in a byte, `lo` uint8 (N, K/2): byte j = c[2j] | c[2j+1] << 4;
  Q5 formats add a 1-bit plane `hi` (N, K/8) (bit i of byte b = element 8b+i), Q6_K a 2-bit plane
  (N, K/4) (bits 2i..2i+1 of byte b = element 4b+i). 8-bit formats keep one byte per element,
  `lo` (N, K) (int8 for Q8_0, uint8 for int8, e4m3 bits for FP8).
- scales: `sc` (N/sc_rows, K/sub) in the format's own type (fp16 d for Q4_0/Q5_0/Q8_0 and the
  integer formats, int8/uint8 sub-block scales for K-quants, float32 for FP8), times a per-256
  fp16 super-scale `d` (N, K/256) for K-quants.
- zero: a constant offset (Q4_0 8, Q5_0 16, Q6_K 32), integer zero points `zp` like `sc`
  (AWQ/GPTQ/int8), or K-quant mins: w -= dmin (N, K/256) * mn (N, K/32).
W[n, k] = s * (c - zero) - min, in float32. The repacking keeps every number of the source, so
the kernels are held to the same references as the source formats (gguf_ref, intq_ref, fp8_ref).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from dsq.kernels import gguf_ref

# Q4_K / Q6_K blocks converted on a GPU by one Triton launch a chunk (kernels/triton_gguf.py), not
# ~25 torch ops a chunk: a streamed 8B layer 3.6 ms instead of 11.4, prefill at 24 GPU layers 1.5x
# (docs/benchmarks.md#does-a-split-beat-llamacpp-and-at-what-vram); DSQ_TRITON_GGUF=0: the torch ops
TRITON_GGUF = os.environ.get("DSQ_TRITON_GGUF", "1") != "0"
# raw bytes a Triton conversion copies over and converts at once: it keeps no codes in between, so
# the chunk is the only transient (docs/benchmarks.md#split-between-gpu-and-cpu)
TRITON_GGUF_CHUNK_BYTES = 32 << 20

# code kinds
NIB, U8, I8, FP8 = 0, 1, 2, 3
# zero kinds
Z_NONE, Z_CONST, Z_ARRAY = 0, 1, 2


@dataclass(frozen=True)
class Fmt:
    """The kernel's compile-time description of a packed format."""
    codes: int = NIB
    hi_bits: int = 0  # 0, 1 (Q5) or 2 (Q6_K)
    sub: int = 32  # elements along K per `sc` entry
    sc_rows: int = 1  # rows per `sc` entry (128 for FP8 block scales)
    two_level: bool = False  # sc times d per 256 (K-quants)
    zero: int = Z_NONE
    offset: int = 0
    mins: bool = False  # K-quant mins (Q4_K, Q5_K)


@dataclass
class Packed:
    fmt: Fmt
    N: int
    K: int
    lo: torch.Tensor
    sc: torch.Tensor
    hi: torch.Tensor | None = None
    d: torch.Tensor | None = None
    zp: torch.Tensor | None = None
    mn: torch.Tensor | None = None
    dmin: torch.Tensor | None = None
    perm: torch.Tensor | None = None  # act-order: y = x[..., perm] @ W^T

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in ("lo", "sc", "hi", "d", "zp", "mn", "dmin", "perm")
                if getattr(self, k) is not None}

    def to(self, device) -> Packed:
        kw = {k: v.to(device) for k, v in self.tensors().items()}
        return Packed(self.fmt, self.N, self.K, **kw)

    def rows(self, a: int, b: int) -> Packed:
        """Output rows a..b-1 as views of the planes; a and b multiples of fmt.sc_rows (or b = N)."""
        r = self.fmt.sc_rows
        kw = {k: t[a // r:-(-b // r)] if k in ("sc", "zp") else t[a:b]
              for k, t in self.tensors().items() if k != "perm"}
        return Packed(self.fmt, b - a, self.K, perm=self.perm, **kw)

    def nbytes(self) -> int:
        """Bytes a matmul must read (everything but the permutation)."""
        return sum(t.numel() * t.element_size() for k, t in self.tensors().items() if k != "perm")

    @staticmethod
    def cat(parts: list[Packed]) -> Packed:
        """Stack packed weights of the same format and K along N (fused q/k/v, gate/up). Act-order
        weights stack when they share one permutation of x, as GPTQ gives linears that read the
        same input (one Hessian, so one order: dsq's GPTQ solves them together)."""
        p0 = parts[0]
        same_perm = all(p.perm is None for p in parts) or (
            p0.perm is not None and all(p.perm is not None and torch.equal(p.perm, p0.perm) for p in parts))
        ok = same_perm and all(p.fmt == p0.fmt and p.K == p0.K for p in parts)
        if not ok or (p0.fmt.sc_rows > 1 and any(p.N % p0.fmt.sc_rows for p in parts[:-1])):
            raise ValueError("cannot fuse packed weights of different formats or input orders")
        kw = {k: torch.cat([getattr(p, k) for p in parts]) for k in p0.tensors() if k != "perm"}
        return Packed(p0.fmt, sum(p.N for p in parts), p0.K, perm=p0.perm, **kw)


# -- generic reference over the packed layout (tests; any device) -------------------------------
def codes(p: Packed) -> torch.Tensor:
    """-> int32 or float32 (FP8) codes (N, K)."""
    f = p.fmt
    if f.codes == NIB:
        b = p.lo.to(torch.int32)
        c = torch.stack([b & 15, b >> 4], dim=-1).reshape(p.N, p.K)
        if f.hi_bits == 1:
            h = p.hi.to(torch.int32)
            c = c | (((h[:, :, None] >> torch.arange(8, device=h.device)) & 1).reshape(p.N, p.K) << 4)
        elif f.hi_bits == 2:
            h = p.hi.to(torch.int32)
            c = c | (((h[:, :, None] >> (2 * torch.arange(4, device=h.device))) & 3).reshape(p.N, p.K) << 4)
        return c
    if f.codes == FP8:
        return p.lo.view(torch.float8_e4m3fn).float()
    return p.lo.view(torch.int8 if f.codes == I8 else torch.uint8).to(torch.int32)


def dequantize(p: Packed) -> torch.Tensor:
    """-> float32 (N, K), stored column order."""
    f = p.fmt

    def expand(t, sub, rows=1):
        t = t.float().repeat_interleave(sub, dim=1)[:, :p.K]
        return t.repeat_interleave(rows, dim=0)[:p.N] if rows > 1 else t

    c = codes(p).float()
    s = expand(p.sc, f.sub, f.sc_rows)
    if f.two_level:
        s = s * expand(p.d, 256)
    if f.zero == Z_CONST:
        c = c - f.offset
    elif f.zero == Z_ARRAY:
        c = c - expand(p.zp, f.sub)
    w = s * c
    if f.mins:
        w = w - expand(p.dmin, 256) * expand(p.mn, 32)
    return w


def linear_ref(x: torch.Tensor, p: Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    xf = x.float()
    if p.perm is not None:
        xf = xf[..., p.perm]
    y = xf @ dequantize(p).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def experts_ref(x: torch.Tensor, p: Packed, ids: torch.Tensor, n_expert: int) -> torch.Tensor:
    """What triton_gemv.gemv_experts computes, in torch: `p` stacks n_expert weights of N = p.N /
    n_expert rows; y[i] = x[i // (P / T)] W_ids[i]^T for the P = ids.numel() pairs and x's T rows,
    in x's dtype. Only device ops (the chosen experts' rows gathered, then dequantized)."""
    N, P = p.N // n_expert, ids.numel()
    xf = x.reshape(-1, p.K).float()
    if p.perm is not None:
        xf = xf[:, p.perm]
    xf = xf.repeat_interleave(P // xf.shape[0], dim=0)
    rows = (ids.reshape(P, 1).long() * N + torch.arange(N, device=ids.device)).reshape(-1)
    if p.fmt.sc_rows == 1:
        kw = {k: t.index_select(0, rows) for k, t in p.tensors().items() if k != "perm"}
        w = dequantize(Packed(p.fmt, P * N, p.K, **kw))
    else:
        w = dequantize(p).index_select(0, rows)
    return torch.bmm(w.view(P, N, p.K), xf[:, :, None])[:, :, 0].to(x.dtype)


def q8_ok(p: Packed, rows: int = 1) -> bool:
    """Formats the int8-activation kernels take for `rows` rows of x: integer codes (int4 AWQ/GPTQ,
    int8, Q4_0, Q8_0, Q4_K, and with one high bit per code Q5_0, Q5_K) with scale groups of whole
    32-element blocks; at one row also Q6_K (6-bit codes offset by 32, 16-element groups); K a
    multiple of 32."""
    f = p.fmt
    if p.K % 32 or f.codes not in (NIB, U8, I8) or f.sc_rows != 1:
        return False
    if f.hi_bits == 2 and rows == 1:  # Q6_K
        return f.sub == 16 and f.two_level and f.zero == Z_CONST and f.offset == 32 and not f.mins
    if f.hi_bits == 1 and f.codes != NIB:
        return False
    return f.hi_bits < 2 and (f.sub >= p.K or f.sub % 32 == 0)


def quantize_x_q8(x: torch.Tensor, codes: int):
    """x (K,) -> the int8-activation GEMV's inputs (what triton_gemv_q8._quant_x writes; its test
    oracle): per 32 elements a scale sx and xq = round(x / sx) in [-127, 127] (gguf_ref.round_x_q8),
    packed four to an int32 word in the order the codes are (nibble formats, per block: four
    words of the even elements of each 8, which `c & 0x0F0F0F0F` lines up with, then four of the
    odd ones for `(c >> 4) & 0x0F0F0F0F`; byte formats: in order); and sx * sum(xq) per block
    (for zero points and mins, so that the kernel computes exactly W x_q8 with x_q8 = xq * sx)."""
    K = x.shape[-1]
    qf, sx = gguf_ref.round_x_q8(x)
    q = qf.to(torch.int64) & 0xFF
    if codes == NIB:  # per block: the even elements of its 4 words of 8, then the odd ones
        q = q.reshape(K // 32, 4, 8)
        q = torch.stack([q[:, :, 0::2], q[:, :, 1::2]], 1)  # (K/32, 2, 4 words, 4 bytes)
    q = q.reshape(K // 4, 4)
    w = q[:, 0] | (q[:, 1] << 8) | (q[:, 2] << 16) | (q[:, 3] << 24)
    w = torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32)
    return w, sx.reshape(K // 32).contiguous(), (sx * qf.sum(-1, keepdim=True)).reshape(K // 32).contiguous()


def dequantize_x_q8(x: torch.Tensor) -> torch.Tensor:
    """x as the int8-activation GEMV sees it: xq * sx per 32-element block (float32)."""
    qf, sx = gguf_ref.round_x_q8(x)
    return (qf * sx).reshape(x.shape)


def linear_ref_q8(x: torch.Tensor, p: Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the int8-activation GEMV computes: W times x rounded to int8 per 32-element block."""
    xf = x.float()
    if p.perm is not None:
        xf = xf[..., p.perm]
    y = dequantize_x_q8(xf) @ dequantize(p).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# -- packing from each source format ---------------------------------------------------------------
def _pairs(c: torch.Tensor) -> torch.Tensor:
    """Codes (N, K), below 16 in their low nibble, -> (N, K/2) bytes: even elements low, odd high.
    In place on uint8 temporaries: the conversion's intermediates stay ~3 bytes a weight."""
    c = c.to(torch.uint8)
    out = (c[:, 1::2] & 15).bitwise_left_shift_(4)
    return out.bitwise_or_(c[:, 0::2] & 15)


def _plane(c: torch.Tensor, bits: int) -> torch.Tensor:
    """High bits (above the low 4) of codes (N, K) -> plane of `bits`-bit fields, 8/bits per byte."""
    per = 8 // bits
    h = (c.to(torch.uint8) >> 4).reshape(c.shape[0], -1, per)
    out = h[..., 0].clone()
    for j in range(1, per):
        out.bitwise_or_(h[..., j] << (j * bits))
    return out


def from_int(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
             perm: torch.Tensor | None = None) -> Packed:
    """dsq's internal int layout (kernels/intq_ref.py) -> Packed (shares the tensors)."""
    N, G = scales.shape
    K = qweight.shape[1] * (2 if bits == 4 else 1)
    fmt = Fmt(codes=NIB if bits == 4 else U8, sub=K // G, zero=Z_ARRAY)
    return Packed(fmt, N, K, lo=qweight, sc=scales, zp=zeros, perm=perm)


def from_fp8(weight: torch.Tensor, scale: torch.Tensor) -> Packed:
    from dsq.kernels.fp8_ref import BLOCK, scale_kind

    N, K = weight.shape
    kind = scale_kind(scale, N)
    s = scale.float()
    if kind == "tensor":
        s, fmt = s.reshape(1, 1).expand(N, 1).contiguous(), Fmt(codes=FP8, sub=K)
    elif kind == "channel":
        s, fmt = s.reshape(N, 1).contiguous(), Fmt(codes=FP8, sub=K)
    else:
        s, fmt = s.contiguous(), Fmt(codes=FP8, sub=BLOCK, sc_rows=BLOCK)
    return Packed(fmt, N, K, lo=weight.view(torch.uint8), sc=s)


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16)


def _k_scales(s: torch.Tensor):
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _nib(qs: torch.Tensor) -> torch.Tensor:
    """Bytes (..., n) -> (..., 2, n): the low nibbles, then the high ones."""
    out = torch.empty((*qs.shape[:-1], 2, qs.shape[-1]), dtype=torch.uint8, device=qs.device)
    torch.bitwise_and(qs, 0x0F, out=out[..., 0, :])
    torch.bitwise_right_shift(qs, 4, out=out[..., 1, :])
    return out


def _triton_gguf(dev: torch.device) -> bool:
    """Whether from_gguf converts on `dev` by the Triton kernels (TRITON_GGUF, on a GPU)."""
    return TRITON_GGUF and dev.type == "cuda"


def _from_gguf_triton(raw: torch.Tensor, qtype: str, K: int, dev: torch.device) -> Packed:
    """from_gguf by kernels/triton_gguf.py on `dev`: one launch per TRITON_GGUF_CHUNK_BYTES of rows."""
    from dsq.kernels import triton_gguf

    out = triton_gguf.empty(qtype, raw.shape[0], K, dev)
    step = max(1, TRITON_GGUF_CHUNK_BYTES // max(1, raw.shape[1]))
    for i in range(0, raw.shape[0], step):  # pinned rows (a streamed layer's) copy without a host sync
        part = raw[i:i + step]
        triton_gguf.convert_into(part.to(dev, non_blocking=part.is_pinned()).contiguous(), qtype, out, i)
    return out


def from_gguf(raw: torch.Tensor, qtype: str, K: int, chunk: int = 1 << 24,
              device: torch.device | str | None = None) -> Packed:
    """GGUF blocks (N, row_bytes) uint8 -> Packed, on raw's device. Codes are unsigned (with the
    format's offset) except Q8_0 (int8). Converted about `chunk` weights at a time into outputs
    allocated once: the intermediate codes take up to ~3 bytes a weight (uint8, in place), so a
    chunk's transient is ~48 MB beside the output (on the GPU, where the runtime converts a layer's
    weights at load and each streamed layer's at prefill; all at once, a Q6_K output head of
    128256 x 4096 would take 1.6 GB beside its 0.43 GB). With `device`, the output is made there
    and each chunk of raw's rows is copied over just before it is converted: the blocks as a whole
    never sit on that device beside the output."""
    N = raw.shape[0]
    rows = max(1, chunk // K)
    dev = raw.device if device is None else torch.device(device)
    if _triton_gguf(dev):
        from dsq.kernels import dispatch, triton_gguf

        if qtype in triton_gguf.TYPES and K % 256 == 0:
            # a Triton build that fails on this GPU turns the family off with a warning: the torch ops convert
            out = dispatch._guarded("GGUF conversion", _from_gguf_triton, raw, qtype, K, dev)
            if out is not None:
                return out
    on = (lambda r: r) if dev == raw.device else (lambda r: r.to(dev))  # noqa: E731
    if N <= rows:
        return _from_gguf(on(raw), qtype, K)
    first = _from_gguf(on(raw[:rows]), qtype, K)
    out = {k: torch.empty((N, *v.shape[1:]), dtype=v.dtype, device=v.device) for k, v in first.tensors().items()}
    for k, v in first.tensors().items():
        out[k][:rows] = v
    fmt = first.fmt
    del first
    for i in range(rows, N, rows):
        for k, v in _from_gguf(on(raw[i:i + rows]), qtype, K).tensors().items():
            out[k][i:i + rows] = v
    return Packed(fmt, N, K, **out)


def kquant_fmt(qtype: str) -> Fmt:
    """The packed format of GGUF's Q4_K, Q5_K or Q6_K blocks (from_gguf's, and kernels/triton_gguf.py's)."""
    if qtype == "Q6_K":
        return Fmt(hi_bits=2, sub=16, two_level=True, zero=Z_CONST, offset=32)
    return Fmt(hi_bits=0 if qtype == "Q4_K" else 1, sub=32, two_level=True, mins=True)


def _from_gguf(raw: torch.Tensor, qtype: str, K: int) -> Packed:
    N = raw.shape[0]
    per, nbytes = gguf_ref.BLOCKS[qtype]
    b = raw.reshape(N * (K // per), nbytes)
    nb = b.shape[0]
    if qtype == "Q4_0":
        c = _nib(b[:, 2:18]).reshape(N, K)
        return Packed(Fmt(sub=32, zero=Z_CONST, offset=8), N, K, lo=_pairs(c), sc=_f16(b[:, 0:2]).reshape(N, -1))
    if qtype == "Q5_0":
        hi = (b[:, 2:6, None] >> torch.arange(8, dtype=torch.uint8, device=b.device)).reshape(nb, 32)
        c = _nib(b[:, 6:22]).reshape(nb, 32).bitwise_or_(hi.bitwise_and_(1).bitwise_left_shift_(4)).reshape(N, K)
        del hi
        return Packed(Fmt(hi_bits=1, sub=32, zero=Z_CONST, offset=16), N, K, lo=_pairs(c), hi=_plane(c, 1),
                      sc=_f16(b[:, 0:2]).reshape(N, -1))
    if qtype == "Q8_0":
        return Packed(Fmt(codes=I8, sub=32), N, K, lo=b[:, 2:34].contiguous().reshape(N, K),
                      sc=_f16(b[:, 0:2]).reshape(N, -1))
    if qtype in ("Q4_K", "Q5_K"):
        sc, mn = _k_scales(b[:, 4:16])
        if qtype == "Q4_K":
            c = _nib(b[:, 16:144].reshape(nb, 4, 32)).reshape(N, K)
        else:
            qh = b[:, 16:48]
            lo = _nib(b[:, 48:176].reshape(nb, 4, 32)).reshape(nb, 8, 32)
            hi = (qh[:, None, :] >> torch.arange(8, device=b.device, dtype=torch.uint8)[None, :, None])
            c = lo.bitwise_or_(hi.bitwise_and_(1).bitwise_left_shift_(4)).reshape(N, K)
            del hi
        return Packed(kquant_fmt(qtype), N, K, lo=_pairs(c), hi=None if qtype == "Q4_K" else _plane(c, 1),
                      sc=sc.reshape(N, -1).contiguous(), d=_f16(b[:, 0:2]).reshape(N, -1),
                      mn=mn.reshape(N, -1).contiguous(), dmin=_f16(b[:, 2:4]).reshape(N, -1))
    if qtype == "Q6_K":
        ql = _nib(b[:, 0:128].reshape(nb, 2, 64)).reshape(nb, 8, 32)
        qh = b[:, 128:192].reshape(nb, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8,
                                                                 device=b.device).reshape(1, 1, 4, 1)
        c = ql.bitwise_or_(qh.bitwise_and_(3).bitwise_left_shift_(4).reshape(nb, 8, 32)).reshape(N, K)
        del qh
        return Packed(kquant_fmt(qtype), N, K, lo=_pairs(c), hi=_plane(c, 2),
                      sc=b[:, 192:208].contiguous().view(torch.int8).reshape(N, -1), d=_f16(b[:, 208:210]).reshape(N, -1))
    raise ValueError(f"no packed layout for {qtype}")
