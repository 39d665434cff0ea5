"""The one-launch GPU norm, rope and activation kernels (kernels/triton_elementwise.py) against
the torch ops they replace, on fresh random inputs in the layouts a decode step hands over
(strided views out of fused projections, the two halves of gate/up), float32 and bf16. Under
TRITON_INTERPRET=1 without a GPU; with one, also a tiny model's logits with and without them."""

from __future__ import annotations

import pytest
import torch
from triton_interp import CUDA, DEV

from dsq.kernels import triton_elementwise as te  # noqa: E402
from dsq.models.base import act_mul, apply_rope, apply_rope_interleaved, gelu_tanh, rms_norm_torch  # noqa: E402


def _act_mul_torch(g, u, gelu):
    """The model's activation times up as torch runs it (base.act_mul on CPU tensors)."""
    return act_mul(gelu_tanh if gelu else torch.nn.functional.silu, g, u)


def _act_mul_exact(g, u, gelu):
    """The same in float64, rounded where torch rounds (the activation to g's dtype, then the
    product). torch's gelu, 0.5 x (1 + tanh(t)), cancels for x below about -3 (in float32 it is
    off by ~1e-3 relative there, in float64 it is 0 below about -7): enough to move many bf16
    roundings, so the kernel is held to this form exactly and to torch's own within a tolerance."""
    x = g.double()
    t = 0.7978845608028654 * (x + 0.044715 * x ** 3) if gelu else x / 2
    a = x / (1 + torch.exp(-2 * t))  # 0.5 x (1 + tanh(t)) without its cancellation (silu: t = x / 2)
    return (a.to(g.dtype).double() * u.double()).to(g.dtype)


def _close(got: torch.Tensor, want: torch.Tensor, atol: float = 1e-6, steps: torch.dtype | None = None) -> None:
    """float32: equal within float32 rounding; bf16: within one bf16 step, and on a GPU only a few
    values apart at all (summation order and exp's last bits can move a rounding). The
    interpreter casts float32 to bf16 by truncation, not to nearest: there about half differ, by
    up to two steps where two casts follow each other. `steps`: a float32 result of a value rounded
    to bf16 on the way (held to bf16's tolerance)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    g, w = got.float().cpu(), want.float().cpu()
    if want.dtype == torch.float32 and steps is None:
        torch.testing.assert_close(g, w, rtol=1e-5, atol=atol)
        return
    torch.testing.assert_close(g, w, rtol=2 ** -7 if CUDA else 2 ** -6, atol=atol)  # two truncations: two steps
    if CUDA:
        assert float((g != w).float().mean()) < 0.02


def _prompt_then_steps(m, ids: torch.Tensor, prompt: int, pad: list[int], dtype: torch.dtype,
                       device: str = "cpu") -> torch.Tensor:
    """A batch's logits (float32) through model m: its first `prompt` tokens as one chunk (the last
    position's logits), then each further token as a decode step, into a fresh cache of 32 slots."""
    cache = m.make_cache(ids.shape[0], 32, dtype)
    pad_t = torch.tensor(pad, device=device)
    with torch.inference_mode():
        out = [m(ids[:, :prompt], torch.arange(prompt, device=device), cache, pad_t, kv_len=prompt, last_only=True)]
        out += [m(ids[:, t:t + 1], torch.tensor([t], device=device), cache, pad_t, kv_len=t + 1)
                for t in range(prompt, ids.shape[1])]
    return torch.cat(out, 1).float()


def _count_calls(monkeypatch, module, name: str) -> list:
    """module.name replaced by a wrapper that runs it and records each call in the returned list."""
    calls, fn = [], getattr(module, name)

    def counted(*a, **kw):
        calls.append(1)
        return fn(*a, **kw)

    monkeypatch.setattr(module, name, counted)
    return calls


def _count_launches(monkeypatch, module, name: str) -> list:
    """The Triton kernel module.name replaced by one that launches it and records each grid."""
    launches, kernel = [], getattr(module, name)

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(module, name, Counted())
    return launches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("shape", [(1, 1, 2048), (2, 3, 96), (3, 40)])
def test_rms_norm_equals_torch(dtype, offset, shape):
    x = (torch.randn(shape) * 3).to(dtype)
    w = (torch.randn(shape[-1]) * 0.5).to(dtype)
    want = rms_norm_torch(x, w, 1e-6, offset)
    _close(te.rms_norm(x.to(DEV), w.to(DEV), 1e-6, offset), want)
    a = torch.randn(shape).to(dtype)
    s, y = te.rms_norm(x.to(DEV), w.to(DEV), 1e-6, offset, add=a.to(DEV))
    if CUDA:
        assert torch.equal(s.cpu(), x + a)  # the residual sum rounds as torch's add does
    _close(s, x + a)
    _close(y, rms_norm_torch(s.cpu(), w, 1e-6, offset))  # the norm of the sum it wrote


def test_rms_norm_of_strided_heads_and_a_float32_weight():
    """q/k norms run over (B, T, H, D) views out of a fused q/k/v projection; a float32 weight on
    bf16 x gives a float32 product, as torch's promotion does."""
    qkv = torch.randn(2, 3, 8 * 32 + 2 * 2 * 32).bfloat16()
    q = qkv[..., :256].view(2, 3, 8, 32)
    w = torch.randn(32)
    got = te.rms_norm(q.to(DEV), w.to(DEV), 1e-5)
    assert got.dtype == torch.float32
    _close(got, rms_norm_torch(q, w, 1e-5), steps=torch.bfloat16)


def test_rms_norm_refuses_what_one_launch_cannot_hold():
    assert te.rms_norm(torch.randn(1, te.MAX_ROW + 1), torch.ones(te.MAX_ROW + 1), 1e-6) is None
    assert te.rms_norm(torch.randn(2, 8), torch.ones(4), 1e-6) is None
    x = torch.randn(2, 3, 4, 8).transpose(0, 1)  # leading dims that do not flatten to one stride
    assert te.rms_norm(x, torch.ones(8), 1e-6) is None
    x = torch.randn(4, 6, 8).transpose(0, 1)  # two levels of rows, each strided: one launch
    _close(te.rms_norm(x.to(DEV), torch.ones(8, device=DEV), 1e-6), rms_norm_torch(x, torch.ones(8), 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gelu", [False, True])
def test_act_mul_equals_torch(dtype, gelu):
    gu = (torch.randn(2, 1, 2 * 1500) * 4).to(dtype)  # F = 1500: two column blocks, the second partial
    g, u = gu.chunk(2, dim=-1)
    # atol: where torch's tanh rounds to -1, its gelu is 0 and ours the tiny x / (1 + e^-2t)
    g2, u2 = torch.randn(5, 64).to(dtype), torch.randn(5, 64).to(dtype)
    for a, b in ((g, u), (g2, u2)):
        got = te.act_mul(a.to(DEV), b.to(DEV), gelu)
        _close(got, _act_mul_exact(a, b, gelu), atol=1e-5)
        torch.testing.assert_close(got.cpu().float(), _act_mul_torch(a, b, gelu).float(), rtol=2 ** -6, atol=1e-4)


def _offered(y: torch.Tensor):
    """What the last producer offered the q8 GEMVs, checked to be y's: (words, scales, sums)."""
    from dsq.kernels import triton_gemv_q8

    ref, ptr, n, xq = triton_gemv_q8._MADE[-1]
    assert ref() is y and ptr == y.data_ptr() and n == y.numel()
    return xq


def _check_rounding(y: torch.Tensor, xq) -> None:
    """xq is exactly packed.quantize_x_q8 of each row of y, its words in nibble order, then in
    byte order (the producers offer both)."""
    from dsq.kernels import packed

    rows = y.reshape(-1, y.shape[-1]).cpu()
    assert len(xq) == 4 and xq[3].shape == xq[0].shape
    assert xq[0].shape == (rows.shape[0], rows.shape[1] // 4) and xq[1].shape == (rows.shape[0], rows.shape[1] // 32)
    for r in range(rows.shape[0]):
        want = packed.quantize_x_q8(rows[r].float(), packed.NIB)
        assert torch.equal(xq[0][r].cpu(), want[0])
        assert torch.equal(xq[3][r].cpu(), packed.quantize_x_q8(rows[r].float(), packed.U8)[0])
        torch.testing.assert_close(xq[1][r].cpu(), want[1], rtol=1e-6, atol=0)
        torch.testing.assert_close(xq[2][r].cpu(), want[2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 2048), (2, 3, 96)])
def test_the_norm_rounds_its_output_for_the_q8_gemvs(dtype, shape):
    """With q8 the norm also writes its output (as stored, in its dtype) rounded to int8 per 32
    elements in nibble order, and offers it to the q8 GEMVs: exactly packed.quantize_x_q8 of each
    row; the norm itself is unchanged. 96: three blocks of a program's four (a masked block)."""
    x = (torch.randn(shape) * 3).to(dtype)
    x[..., 32:64] = 0  # a block of zeros: scale 0
    w = (torch.randn(shape[-1]) * 0.5).to(dtype)
    for offset in (0.0, 1.0):
        y = te.rms_norm(x.to(DEV), w.to(DEV), 1e-6, offset, q8=True)
        assert torch.equal(y.cpu(), te.rms_norm(x.to(DEV), w.to(DEV), 1e-6, offset).cpu())
        _check_rounding(y, _offered(y))
    s, y = te.rms_norm(x.to(DEV), w.to(DEV), 1e-6, add=torch.randn(shape).to(dtype).to(DEV), q8=True)
    _check_rounding(y, _offered(y))
    from dsq.kernels import triton_gemv_q8

    y40 = te.rms_norm(torch.randn(2, 40).to(DEV), torch.ones(40, device=DEV), 1e-6, q8=True)  # not whole blocks
    assert all(e[0]() is not y40 for e in triton_gemv_q8._MADE)  # nothing offered


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_activation_rounds_its_output_for_the_q8_gemvs(dtype):
    """act_mul with q8: its output rounded as the norm's is, each program rounding its own blocks
    (1408 = V2-Lite's expert width: two programs of 1024 columns, the second partial), for six
    (token, expert) pairs, and for one row of 96."""
    gu = (torch.randn(6, 2 * 1408) * 4).to(dtype)
    g, u = gu.chunk(2, dim=-1)
    g2, u2 = torch.randn(1, 1, 96).to(dtype), torch.randn(1, 1, 96).to(dtype)
    for a, b in ((g, u), (g2, u2)):
        for gelu in (False, True):
            y = te.act_mul(a.to(DEV), b.to(DEV), gelu, q8=True)
            assert torch.equal(y.cpu(), te.act_mul(a.to(DEV), b.to(DEV), gelu).cpu())
            _check_rounding(y, _offered(y))


def test_a_q8_gemv_reads_what_the_producer_offered(monkeypatch):
    """A q8 GEMV of the norm's output (or of a view of all of it) launches no _quant_x of its own and
    computes exactly what it computes from its own rounding (the same x in a fresh tensor), in nibble
    order (Q4_K) or byte order (Q8_0, Q6_K); part of the rows, or act-order (a permutation), rounds
    x itself."""
    import numpy as np
    from test_kernels_ref import random_blocks

    from dsq.kernels import packed, triton_gemv_q8

    launches = _count_launches(monkeypatch, triton_gemv_q8, "_quant_x")
    rng = np.random.default_rng(0)
    K = 512
    q4k = packed.from_gguf(torch.from_numpy(random_blocks("Q4_K", 12, K, rng)), "Q4_K", K).to(DEV)
    q80 = packed.from_gguf(torch.from_numpy(random_blocks("Q8_0", 12, K, rng)), "Q8_0", K).to(DEV)
    q6k = packed.from_gguf(torch.from_numpy(random_blocks("Q6_K", 12, K, rng)), "Q6_K", K).to(DEV)
    x = torch.randn(1, 2, K, device=DEV)
    y = te.rms_norm(x, torch.ones(K, device=DEV), 1e-6, q8=True)
    y1 = te.rms_norm(x[:, :1], torch.ones(K, device=DEV), 1e-6, q8=True)  # Q6_K: the q8 GEMV at one row
    del launches[:]
    cases = [(y, q4k, 0), (y.view(2, K), q4k, 0), (y, q80, 0), (y1, q6k, 0), (y1, q4k, 0), (y[:, :1], q4k, 1)]
    for xin, p, n in cases:
        got = triton_gemv_q8.q8_linear(xin, p)
        assert len(launches) == n, (p.fmt, xin.shape)
        want = triton_gemv_q8.q8_linear(xin.clone(), p)  # a fresh tensor: its own rounding
        assert torch.equal(got, want)
        del launches[:]
    stack = packed.Packed.cat([q4k, q4k])  # two experts of 12 rows
    ids = torch.tensor([1, 0, 0, 1], device=DEV)
    got = triton_gemv_q8.q8_experts(y.view(2, K), stack, ids, 2)
    assert not launches and torch.equal(got, triton_gemv_q8.q8_experts(y.view(2, K).clone(), stack, ids, 2))
    perm = torch.randperm(K, device=DEV)
    act = packed.Packed(q4k.fmt, q4k.N, q4k.K, perm=perm, **q4k.tensors())
    del launches[:]
    triton_gemv_q8.q8_linear(y, act)
    assert len(launches) == 1


def test_an_offer_dies_with_its_tensor():
    """An offered rounding answers only while the tensor it was made from lives: memory freed and
    taken by another tensor at the same address is not mistaken for it."""
    import gc

    import numpy as np
    from test_kernels_ref import random_blocks

    from dsq.kernels import packed, triton_gemv_q8

    p = packed.from_gguf(torch.from_numpy(random_blocks("Q4_K", 4, 256, np.random.default_rng(1))), "Q4_K", 256)
    y = te.rms_norm(torch.randn(1, 256).to(DEV), torch.ones(256, device=DEV), 1e-6, q8=True)
    made = triton_gemv_q8._made(y, p.to(DEV))
    assert made is not None and all(a is b for a, b in zip(made, _offered(y)[:3], strict=True))
    other = torch.randn(1, 256).to(DEV)
    del y
    gc.collect()
    ref, _, n, xq = triton_gemv_q8._MADE[-1]
    assert ref() is None
    triton_gemv_q8._MADE[-1] = (ref, other.data_ptr(), n, xq)  # as if `other` had taken y's memory
    assert triton_gemv_q8._made(other, p.to(DEV)) is None


@pytest.mark.skipif(not CUDA, reason="the model sends only CUDA tensors to these kernels (run on the device)")
@pytest.mark.parametrize("kind", ["llama", "deepseek_v2", "deepseek_v3"])
def test_a_gpu_gguf_models_steps_with_x_rounded_by_its_producers(kind, tiny_gguf, monkeypatch):
    """A Q4_K_M GGUF all on the GPU (DeepSeek's experts stacked there) in bf16: a prompt, then decode
    steps whose q8 GEMVs read x as the norms and activations rounded it, against each GEMV rounding x
    in a launch of its own: the same rounding, so the same logits (within float32 summation order),
    with fewer _quant_x launches."""
    from dsq.kernels import dispatch, triton_gemv_q8
    from dsq.runtime.native import NativeModel

    extra = {"experts": "gpu"} if kind.startswith("deepseek") else {}
    m = NativeModel(tiny_gguf(kind, "Q4_K_M"), "gguf", n_ctx=64, gpu_layers="all", cuda_graph=False, **extra).model
    ids = torch.randint(0, m.args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3)).cuda()
    launches = _count_launches(monkeypatch, triton_gemv_q8, "_quant_x")
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(dispatch, "PRODUCER_Q8", on)
        del launches[:]
        runs[on] = (_prompt_then_steps(m, ids, 8, [0], m.dtype, "cuda"), len(launches))
    assert not dispatch.FAILED
    (on, n_on), (off, n_off) = runs[True], runs[False]
    assert n_on < n_off, (n_on, n_off)
    assert float((on - off).abs().max()) <= 1e-3 * float(off.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [False, True])
def test_moe_combine_equals_torch(dtype, shared):
    """A MoE layer's (token, choice) outputs weighed by the router's float32 weights and summed per
    token, cast, plus the shared experts' output: as torch computes it."""
    T, k, H = 3, 6, 1500  # H: two column blocks, the second partial
    y = torch.randn(T * k, H).to(dtype)
    w = torch.rand(T, k)
    add = torch.randn(T, H).to(dtype) if shared else None
    want = (y.view(T, k, H) * w[..., None]).sum(dim=1).to(dtype)
    if shared:
        want = want + add
    got = te.moe_combine(y.to(DEV), w.to(DEV), dtype, add.to(DEV) if shared else None)
    # with the shared add, two roundings: a step of the operands' size, where the sum may cancel
    _close(got, want, atol=1e-5 if dtype == torch.float32 or not shared else 2 ** -6 * float(want.abs().max()))
    assert te.moe_combine(y[:-1], w, dtype) is None  # pairs that are not T * k rows


def _tables(B, T, D, interleaved):
    pos = torch.randint(0, 500, (B, T))
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    f = pos[..., None].float() * inv
    emb = torch.cat((f, f), -1)
    return emb.cos()[:, :, None] * 1.1, emb.sin()[:, :, None] * 1.1  # an attention factor, as YaRN's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_equals_torch(dtype, interleaved):
    B, T, H, Hk, D = 2, 3, 6, 2, 64
    ref = apply_rope_interleaved if interleaved else apply_rope
    cos, sin = _tables(B, T, D, interleaved)
    qkv = torch.randn(B, T, (H + 2 * Hk) * D).to(dtype)
    q = qkv[..., :H * D].view(B, T, H, D)  # strided per token, as split out of the fused projection
    k = qkv[..., H * D:(H + Hk) * D].view(B, T, Hk, D)
    for x in (q, k):
        _close(te.rope(x.to(DEV), cos.to(DEV), sin.to(DEV), interleaved), ref(x, cos, sin))
    # DeepSeek's shared rope key: (B, T) rows of one wide projection, one head
    kv = torch.randn(B, T, 512 + 32).to(dtype)
    kr = kv[..., 512:][:, :, None]
    c2, s2 = _tables(B, T, 32, interleaved)
    _close(te.rope(kr.to(DEV), c2.to(DEV), s2.to(DEV), interleaved), ref(kr, c2, s2))


def test_rope_refuses_what_it_cannot_run():
    cos, sin = _tables(1, 1, 24, False)
    assert te.rope(torch.randn(1, 1, 2, 24), cos, sin) is None  # half a head (12) not a power of two
    cos, sin = _tables(1, 2, 32, False)
    assert te.rope(torch.randn(1, 1, 2, 32), cos, sin) is None  # tables for another shape
    assert te.rope(torch.randn(1, 2, 2, 32), cos.double(), sin.double()) is None


@pytest.mark.skipif(not CUDA, reason="the model sends only CUDA tensors to these kernels (run on the device)")
@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3", "deepseek_v3"])
def test_a_gpu_models_logits_with_and_without_them(kind, tiny_dir, monkeypatch):
    """fp32 on the GPU, so that only float32 rounding separates the two: a prompt, then decode
    steps (DeepSeek's through mla_write and the MLA kernel, the others' through rope_write); none of
    the kernels may have fallen back to torch."""
    from dsq.kernels import dispatch
    from dsq.runtime.native import NativeModel

    m = NativeModel(tiny_dir(kind), "hf", n_ctx=64, gpu_layers=-1, dtype="fp32", cuda_graph=False).model
    ids = torch.randint(0, m.args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)).cuda()

    def run():
        return _prompt_then_steps(m, ids, 8, [0, 2], torch.float32, "cuda")

    monkeypatch.setattr(dispatch, "TRITON_ROUTER", True)
    monkeypatch.setattr(dispatch, "MLA_WRITE", True)
    on = run()
    assert not dispatch.FAILED
    monkeypatch.setattr(dispatch, "TRITON_ROUTER", False)
    monkeypatch.setattr(dispatch, "MLA_WRITE", False)
    monkeypatch.setattr(dispatch, "GPU_ELEMENTWISE", False)
    monkeypatch.setattr(dispatch, "TRITON_ATTN", False)
    off = run()
    assert float((on - off).abs().max()) < 1e-4 * float(off.abs().max())


def test_a_kernel_family_that_fails_falls_back_with_a_warning(monkeypatch):
    """A Triton build that fails (some GPU, some Triton version) turns its family off: a warning,
    then None (torch's ops) from then on, without calling it again."""
    from dsq.kernels import dispatch

    monkeypatch.setattr(dispatch, "FAILED", {})
    calls = []

    def broken(*a):
        calls.append(a)
        raise RuntimeError("PTX assembly failed\nmore lines")

    with pytest.warns(RuntimeWarning, match="elementwise GPU kernels failed here .RuntimeError: PTX assembly failed"):
        assert dispatch._guarded("elementwise", broken, 1) is None
    assert dispatch._guarded("elementwise", broken, 2) is None and len(calls) == 1
    assert dispatch._guarded("MLA attention", lambda x: x + 1, 1) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rank,R", [(512, 64), (96, 16)])
def test_mla_write_equals_the_norm_ropes_and_cache_write(dtype, interleaved, rank, R):
    """mla_write: the queries' rope part rotated, and the latent row (c normed, k_rope rotated) written
    at the step's slot of every batch row, as MLAttention's torch ops and KVCache.update give them,
    out of views of the projections' outputs; the cache's other rows untouched. rank 96: a masked
    norm block."""
    B, H, S, slot = 2, 3, 7, 4
    q = (torch.randn(B, 1, H, 32 + R) * 2).to(dtype)  # (nope + rope) per head
    kv = (torch.randn(B, 1, rank + R) * 2).to(dtype)
    q_rope, (c, k_rope) = q[..., 32:], kv.split((rank, R), dim=-1)
    w = (torch.randn(rank) * 0.5).to(dtype)
    ang = torch.rand(B, 1, 1, R // 2) * 6
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
    rotate = apply_rope_interleaved if interleaved else apply_rope
    kc = torch.full((B, 1, S, rank + R), 7.0).to(dtype)
    slots = torch.tensor([slot])
    want_q = rotate(q_rope, cos, sin)
    want_row = torch.cat((rms_norm_torch(c, w, 1e-6), rotate(k_rope[:, :, None], cos, sin)[:, :, 0]), -1)
    got_kc = kc.to(DEV)
    got_q = te.mla_write(q_rope.to(DEV), c.to(DEV), k_rope.to(DEV), w.to(DEV), 1e-6, cos.to(DEV), sin.to(DEV), got_kc,
                         slots.to(DEV), interleaved)
    _close(got_q, want_q)
    _close(got_kc[:, 0, slot], want_row[:, 0])
    others = torch.ones(S, dtype=torch.bool)
    others[slot] = False
    assert bool((got_kc[:, :, others].cpu() == 7.0).all())
    assert te.mla_write(q_rope.to(DEV), c.to(DEV), k_rope.to(DEV), w.to(DEV), 1e-6, cos.to(DEV), sin.to(DEV),
                        got_kc.float() if dtype != torch.float32 else got_kc.bfloat16(), slots.to(DEV),
                        interleaved) is None  # a cache of another dtype: the torch ops


@pytest.mark.skipif(CUDA, reason="the CPU stands in for a GPU here; on one, the GPU model test runs the real path")
@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_deepseek_model_through_the_mla_write_on_the_cpu(kind, dtype, tiny_dir, monkeypatch):
    """A tiny DeepSeek model's prompt and decode steps with the one-launch elementwise kernels (under
    the interpreter, standing in for a GPU), with and without mla_write taking each step's rope, norm
    and latent cache write: the same logits (float32: within its rounding; bf16: the same kernels'
    math in another launch), mla_write run for every layer of every step."""
    from dsq.kernels import dispatch
    from dsq.runtime.native import NativeModel

    m = NativeModel(tiny_dir(kind), "hf", n_ctx=32, dtype=dtype, cuda_graph=False).model
    ids = torch.randint(0, m.args.vocab_size, (2, 10), generator=torch.Generator().manual_seed(4))

    def run():
        return _prompt_then_steps(m, ids, 7, [0, 3], m.dtype)

    calls = _count_calls(monkeypatch, te, "mla_write")
    monkeypatch.setattr(dispatch, "_elementwise_gpu", lambda *ts: True)
    monkeypatch.setattr(dispatch, "MLA_WRITE", False)
    want = run()
    assert not calls
    monkeypatch.setattr(dispatch, "MLA_WRITE", True)
    got = run()
    assert len(calls) == 3 * m.args.num_hidden_layers  # three steps, every layer
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_equals_rope_then_the_cache_write(dtype):
    """q and k rotated, k and v written at the step's slot of every row's cache, the rest of the
    cache untouched: as apply_rope and KVCache.update do it, from views of one fused projection."""
    B, H, Hk, D, S, slot = 2, 6, 2, 32, 12, 7
    qkv = torch.randn(B, 1, (H + 2 * Hk) * D).to(dtype)
    q, k, v = qkv.split((H * D, Hk * D, Hk * D), -1)
    q, k, v = q.view(B, 1, H, D), k.view(B, 1, Hk, D), v.view(B, 1, Hk, D)
    cos, sin = _tables(B, 1, D, False)
    kc, vc = torch.randn(B, Hk, S, D).to(dtype), torch.randn(B, Hk, S, D).to(dtype)
    want_k, want_v = kc.clone(), vc.clone()
    want_k[:, :, slot] = apply_rope(k, cos, sin)[:, 0]
    want_v[:, :, slot] = v[:, 0]
    kd, vd = kc.to(DEV), vc.to(DEV)
    got = te.rope_write(q.to(DEV), k.to(DEV), v.to(DEV), cos.to(DEV), sin.to(DEV), kd, vd,
                        torch.tensor([slot], device=DEV))
    _close(got, apply_rope(q, cos, sin))
    _close(kd, want_k)
    assert torch.equal(vd.cpu(), want_v)
    assert te.rope_write(q[:, :, :, :24], k[..., :24], v[..., :24], cos[..., :24], sin[..., :24], kc[..., :24],
                         vc[..., :24], torch.tensor([slot])) is None  # half a head (12) no power of two


@pytest.mark.skipif(CUDA, reason="the CPU stands in for a GPU here; on one, the GPU test below runs the real path")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_decode_steps_through_the_gpu_step_on_the_cpu(kind, tiny_dir, monkeypatch):
    """The GPU's decode step (one-launch norms, activations, rope with the cache write, the Triton
    attention), run here under the interpreter in place of the torch ops: the same logits."""
    from dsq.kernels import dispatch
    from dsq.kernels import triton_attn as ta
    from dsq.runtime.native import NativeModel

    m = NativeModel(tiny_dir(kind), "hf", n_ctx=32, dtype="bf16", cuda_graph=False).model
    ids = torch.randint(0, m.args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))

    def run():
        return _prompt_then_steps(m, ids, 8, [0, 3], torch.bfloat16)

    want = run()
    steps = []
    attention = dispatch.attention

    def step(q, k, v, norms, cos, sin, kc, vc, slots, kv_len, mask, scale, softcap):
        o = dispatch._attention_step_gpu(q, k, v, norms, cos, sin, kc, vc, slots, kv_len, mask, scale)
        steps.append(o is not None)  # the prefill's 8 tokens are not its to take
        return o

    def attend(q, k, v, mask, scale, softcap=None):
        if q.shape[1] == 1 and mask is not None and ta.supported(q.transpose(1, 2), k, v, mask):
            return ta.attn_decode(q.transpose(1, 2), k, v, mask, scale)
        return attention(q, k, v, mask, scale, softcap)

    monkeypatch.setattr(dispatch, "_elementwise_gpu", lambda *ts: True)
    monkeypatch.setattr(dispatch, "attention_step", step)
    monkeypatch.setattr(dispatch, "attention", attend)
    got = run()
    assert sum(steps) == 4 * m.args.num_hidden_layers
    assert float((got - want).abs().max()) <= 3e-2 * float(want.abs().max())  # bf16, and the interpreter's truncation


@pytest.mark.parametrize("cfg", [
    # (experts, k, scoring, topk_method, n_group, topk_group, norm, scaling): V2-Lite, V2, V3, small mixes
    (64, 6, "softmax", "greedy", 1, 1, False, 1.0),
    (160, 6, "softmax", "group_limited_greedy", 8, 3, False, 16.0),
    (256, 8, "sigmoid", "noaux_tc", 8, 4, True, 2.5),
    (16, 3, "sigmoid", "noaux_tc", 4, 2, True, 1.0),
    (16, 1, "softmax", "greedy", 1, 1, True, 1.0),
    (12, 2, "softmax", "group_limited_greedy", 3, 1, True, 1.0),
])
@pytest.mark.parametrize("T", [1, 9])
def test_moe_route_equals_the_router(cfg, T):
    """The router's work after its GEMV as one launch against deepseek_model.Router's torch ops, on
    fresh random logits: the same experts for every token, and their weights within float32 rounding
    (the kernel lists a token's experts best first; torch's top-k leaves them unsorted)."""
    from types import SimpleNamespace

    from dsq.models.deepseek_model import Router

    E, k, scoring, method, n_group, topk_group, norm, scaling = cfg
    args = SimpleNamespace(num_experts_per_tok=k, n_routed_experts=E, scoring_func=scoring, topk_method=method,
                           n_group=n_group, topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scaling,
                           hidden_size=32)
    r = Router(args)
    torch.nn.init.normal_(r.weight)
    if r.sigmoid:
        r.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randn(T, 32)
    with torch.no_grad():
        want_w, want_ids = r(x)  # on the CPU: torch's ops
        logits = torch.nn.functional.linear(x, r.weight)
        params = r.route_params()
        if params["bias"] is not None:
            params["bias"] = params["bias"].to(DEV)
        got = te.moe_route(logits.to(DEV), **params)
    assert got is not None
    w, ids = (t.cpu() for t in got)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == (T, k)
    order_w, order_g = want_ids.sort(dim=1), ids.sort(dim=1)
    assert torch.equal(order_w.values, order_g.values), (want_ids, ids)
    torch.testing.assert_close(w.gather(1, order_g.indices), want_w.gather(1, order_w.indices), rtol=1e-5, atol=1e-7)
    # best first: the choice (scores, plus the bias with sigmoid) does not rise along a token's list
    choice = logits.softmax(-1) if not r.sigmoid else logits.sigmoid() + r.e_score_correction_bias
    ranked = choice.gather(1, ids)
    assert bool((ranked[:, :-1] >= ranked[:, 1:]).all())


@pytest.mark.skipif(CUDA, reason="the CPU stands in for a GPU here; on one, the GPU test above runs the real path")
@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
def test_a_moe_model_through_the_router_kernel_on_the_cpu(kind, tiny_dir, monkeypatch):
    """A tiny DeepSeek model's prompt and decode steps with every router's choice made by the one-launch
    kernel (under the interpreter, standing in for a GPU), against the same model with torch's router:
    the same logits in float32."""
    from dsq.kernels import dispatch
    from dsq.runtime.native import NativeModel

    m = NativeModel(tiny_dir(kind), "hf", n_ctx=32, dtype="fp32", cuda_graph=False).model
    ids = torch.randint(0, m.args.vocab_size, (2, 10), generator=torch.Generator().manual_seed(2))

    def run():
        return _prompt_then_steps(m, ids, 7, [0, 3], torch.float32)

    want = run()
    calls = _count_calls(monkeypatch, te, "moe_route")
    monkeypatch.setattr(dispatch, "TRITON_ROUTER", True)
    monkeypatch.setattr(dispatch, "_elementwise_gpu", lambda *ts: ts[0].dtype == torch.float32 and ts[0].dim() == 2
                        and ts[0].shape[-1] == m.args.n_routed_experts)  # the router's logits alone
    got = run()
    moe_layers = sum(m.args.is_moe(i) for i in range(m.args.num_hidden_layers))
    assert len(calls) == 4 * moe_layers  # the prompt and three steps, each MoE layer
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())
