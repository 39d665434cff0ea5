"""The Triton decode attention (kernels/triton_attn.py) against its float64 oracle: grouped-query
heads, caches longer than the sequence, padding and sliding-window holes in the mask, a row
with nothing to attend, several cache slices combined. Under TRITON_INTERPRET=1 without a GPU;
with one, also against SDPA on a real shape and through the model's compiled decode."""

from __future__ import annotations

import pytest
import torch
from triton_interp import CUDA, DEV

from dsq.kernels import triton_attn as ta  # noqa: E402


def _case(B, H, HK, S, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, 1, D, generator=g).to(dtype)
    k = torch.randn(B, HK, S, D, generator=g).to(dtype)
    v = torch.randn(B, HK, S, D, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("B,H,HK,S,D,nsplit", [(1, 8, 2, 70, 32, 3), (2, 4, 4, 130, 64, None), (2, 12, 4, 33, 16, 1),
                                               (1, 6, 1, 200, 32, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attn_decode_equals_its_reference(B, H, HK, S, D, nsplit, dtype):
    q, k, v = _case(B, H, HK, S, D, dtype)
    mask = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    mask[0, ..., : S - 5] = True  # a sequence shorter than the cache
    if B > 1:
        mask[1, ..., 3 : S // 2] = True  # left padding and a window that ends early
        mask[1, ..., 7:11] = False  # a hole
    want = ta.attn_decode_ref(q, k, v, mask, D ** -0.5)
    # the layout the model hands over: a slice of a longer cache (strided), q from a transpose
    kc = torch.randn(B, HK, S + 9, D).to(dtype)
    vc = torch.randn(B, HK, S + 9, D).to(dtype)
    kc[:, :, :S], vc[:, :, :S] = k, v
    args = (q.to(DEV), kc[:, :, :S].to(DEV), vc[:, :, :S].to(DEV), mask.to(DEV))
    assert ta.supported(*args)
    got = ta.attn_decode(*args, D ** -0.5, nsplit=nsplit, block=16)
    assert got.shape == (B, 1, H * D) and got.dtype == dtype
    err = float((got.double().cpu() - want).norm() / want.norm())
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), err


@pytest.mark.parametrize("B,H,HK,D", [(1, 8, 2, 32), (2, 4, 1, 64), (1, 2, 2, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attn_decode_rounds_its_output_for_the_q8_gemv(B, H, HK, D, dtype):
    """With q8 the combination also writes o (as stored, in its dtype) rounded to int8 per 32
    elements in nibble order, each head its own D / 32 blocks of its row, and offers it to the
    output projection's q8 GEMV: exactly packed.quantize_x_q8 of each row; o itself is unchanged.
    A head of 16 (not a whole block) offers nothing."""
    from test_elementwise_triton import _check_rounding, _offered

    from dsq.kernels import triton_gemv_q8

    q, k, v = _case(B, H, HK, 50, D, dtype, seed=1)
    q = q * 4  # scores away from uniform: heads' outputs of different sizes
    mask = torch.ones(B, 1, 1, 50, dtype=torch.bool)
    mask[-1, ..., 40:] = False
    args = (q.to(DEV), k.to(DEV), v.to(DEV), mask.to(DEV), D ** -0.5)
    got = ta.attn_decode(*args, nsplit=3, block=16, q8=True)
    assert torch.equal(got.cpu(), ta.attn_decode(*args, nsplit=3, block=16).cpu())
    _check_rounding(got, _offered(got))
    q16, k16, v16 = _case(1, 4, 2, 20, 16, dtype)
    o16 = ta.attn_decode(q16.to(DEV), k16.to(DEV), v16.to(DEV), torch.ones(1, 1, 1, 20, dtype=torch.bool, device=DEV),
                         0.25, q8=True)
    assert all(e[0]() is not o16 for e in triton_gemv_q8._MADE)


def test_attn_decode_row_with_nothing_to_attend_is_zero():
    q, k, v = _case(2, 4, 2, 40, 16, torch.float32)
    mask = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    mask[1] = False
    got = ta.attn_decode(q.to(DEV), k.to(DEV), v.to(DEV), mask.to(DEV), 0.25, nsplit=3, block=16).cpu()
    assert torch.isfinite(got).all() and float(got[1].abs().max()) == 0.0
    want = ta.attn_decode_ref(q, k, v, mask, 0.25)
    assert float((got[0].double() - want[0]).norm() / want[0].norm()) < 1e-5


def test_attn_decode_refuses_what_it_cannot_run():
    q, k, v = _case(1, 4, 2, 16, 24, torch.float32)  # head size not a power of two
    assert not ta.supported(q, k, v, torch.ones(1, 1, 1, 16, dtype=torch.bool))
    q, k, v = _case(1, 4, 2, 16, 32, torch.float32)
    assert not ta.supported(q, k, v, torch.ones(1, 1, 1, 16))  # a float mask
    assert not ta.supported(torch.randn(1, 4, 2, 32), k, v, torch.ones(1, 1, 2, 16, dtype=torch.bool))  # 2 queries


@pytest.mark.skipif(not CUDA, reason="SDPA on a real decode shape needs a GPU")
def test_attn_decode_matches_sdpa_on_a_real_shape():
    q, k, v = (t.cuda() for t in _case(1, 32, 8, 1100, 128, torch.bfloat16))
    mask = torch.zeros(1, 1, 1, 1100, dtype=torch.bool, device="cuda")
    mask[..., :777] = True
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    got = ta.attn_decode(q, k, v, mask, 128 ** -0.5)
    err = float((got.float() - want.transpose(1, 2).reshape(1, 1, -1).float()).norm() / want.float().norm())
    assert err < 1e-2, err


def test_attn_decode_operator_compiles():
    """dsq::attn_decode, the operator a compiled GPU decode step keeps in its graph: its shape-only
    implementation traces, and the compiled call computes what the oracle does (its CPU body)."""
    from dsq.kernels import ops

    q, k, v = _case(2, 8, 2, 24, 16, torch.float32)
    mask = torch.ones(2, 1, 1, 24, dtype=torch.bool)
    mask[1, ..., 20:] = False
    f = torch.compile(lambda q, k, v, m: ops.attn_decode(q, k, v, m, 0.25) * 2, fullgraph=True)
    got = f(q, k, v, mask)
    want = ta.attn_decode_ref(q, k, v, mask, 0.25) * 2
    assert got.shape == (2, 1, 128) and float((got.double() - want).norm() / want.norm()) < 1e-6


@pytest.mark.skipif(not CUDA, reason="the model sends only CUDA decode steps to the Triton attention")
def test_model_decode_steps_use_it_and_match_sdpa(monkeypatch):
    """A two-layer model (a sliding-window layer and a full one, grouped KV heads) decoding on the
    GPU: every decode step's attention goes through the Triton kernel, and the logits equal the
    same steps through SDPA (DSQ_TRITON_ATTN's switch off)."""
    from dsq.kernels import dispatch
    from test_native_cpu_decode import _prefill_then_decode, _tiny_transformer

    model = _tiny_transformer().cuda()  # its cache follows its layers onto the GPU
    calls = []
    real = ta.attn_decode
    monkeypatch.setattr(ta, "attn_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    fast = _prefill_then_decode(model)[0]
    assert len(calls) == 7 * 2  # 7 decode steps, 2 layers
    monkeypatch.setattr(dispatch, "TRITON_ATTN", False)
    torch.testing.assert_close(fast, _prefill_then_decode(model)[0], atol=1e-4, rtol=1e-4)
    assert len(calls) == 7 * 2



@pytest.mark.parametrize("B,H,HK,BLK,D,lens", [(2, 8, 2, 16, 32, (70, 5)), (3, 4, 4, 8, 64, (33, 1, 17)),
                                               (1, 6, 1, 32, 16, (200,))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_lens", [False, True])
def test_paged_attn_decode_equals_the_gathered_reference(B, H, HK, BLK, D, lens, dtype, with_lens):
    """dsq serve's paged cache: each sequence's blocks scattered over a pool in no order, sequences
    of different lengths (the mask ends each), a sliding-window hole in one. with_lens: each row's
    length given too, and the mask left True past it (as no caller passes it), so only skipping
    those slots gives the reference."""
    g = torch.Generator().manual_seed(1)
    n = max(-(-s // BLK) for s in lens)
    NB = B * n + 3
    k_pool = torch.randn(NB, HK, BLK, D, generator=g).to(dtype)
    v_pool = torch.randn(NB, HK, BLK, D, generator=g).to(dtype)
    table = torch.randperm(NB, generator=g)[:B * n].view(B, n)
    q = torch.randn(B, H, 1, D, generator=g).to(dtype)
    S = max(lens)
    mask = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    for b, s in enumerate(lens):
        mask[b, ..., :s] = True
    mask[0, ..., : min(10, lens[0] - 1)] = False  # outside a window
    # the reference over the gathered, contiguous copy
    k = k_pool[table].permute(0, 2, 1, 3, 4).reshape(B, HK, n * BLK, D)[:, :, :S]
    v = v_pool[table].permute(0, 2, 1, 3, 4).reshape(B, HK, n * BLK, D)[:, :, :S]
    want = ta.attn_decode_ref(q, k, v, mask, D ** -0.5)
    kw = {}
    if with_lens:
        kw["lens"] = torch.tensor(lens, device=DEV)
        mask = mask.clone()
        for b, n_b in enumerate(lens):
            mask[b, ..., n_b:] = True
    got = ta.paged_attn_decode(q.to(DEV), k_pool.to(DEV), v_pool.to(DEV), table.to(DEV).int(), mask.to(DEV),
                               D ** -0.5, nsplit=2, block=16, **kw)
    assert got.shape == (B, 1, H * D) and got.dtype == dtype
    err = float((got.double().cpu() - want).norm() / want.norm())
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), err


def test_serve_decode_step_through_the_paged_kernel(tmp_path, monkeypatch):
    """dsq serve's paged step with the Triton kernel (as on a GPU) against the gathered path, on a
    tiny random Gemma 3 (sliding and global layers), three sequences at their own positions."""
    from tiny import build_tiny_model

    from dsq.runtime.native import NativeModel
    from dsq.serve.paged import PagedKV

    # on a GPU the model goes there (the kernel reads device memory), in float32 as on the CPU
    nm = NativeModel(build_tiny_model("gemma3", tmp_path / "g"), "hf", n_ctx=128, cuda_graph=False,
                     gpu_layers="all" if CUDA else 0, dtype="float32")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, nm.model.args.vocab_size, (n,), generator=g).tolist() for n in (40, 9, 23)]
    calls = []
    real = ta.paged_attn_decode
    monkeypatch.setattr(ta, "paged_attn_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = {}
    for kernel in (False, True):
        kv = PagedKV(nm.model, 40, 4, 128)
        kv.paged_kernel = kernel
        tables = [list(range(i * 12, i * 12 + 12)) for i in range(3)]
        for s, t in zip(seqs, tables):
            kv.forward([s[:-2]], [0], [t])
        steps = [kv.forward([[s[-2 + j]] for s in seqs], [len(s) - 2 + j for s in seqs], tables) for j in range(2)]
        out[kernel] = torch.stack(steps)
    assert len(calls) == 2 * nm.model.args.num_hidden_layers  # every layer of both decode steps
    assert torch.allclose(out[True], out[False], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("H,HK,D,lines", [(8, 2, 32, 8), (6, 2, 16, 16), (4, 4, 16, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_rows_of_one_sequence_read_the_cache_together(H, HK, D, lines, dtype, monkeypatch):
    """A mixed step's rows (dsq serve): single decode rows of three sequences, then a prompt's 19
    tokens of a fourth (consecutive positions, each row seeing itself and the rows before it), 5
    of a fifth under a sliding-window hole, and padding rows on a scratch sequence. With `seq`,
    tiles of one sequence's rows go through `_attn_rows` (tiles of `lines` query lines, so some
    tiles straddle two sequences and fall back to `_attn_part`); every row must equal the
    reference over its own gathered cache, as without `seq`."""
    monkeypatch.setattr(ta, "ROW_LINES", lines)
    g = torch.Generator().manual_seed(3)
    BLK = 8
    rows = [(0, 30), (1, 5), (2, 41)] + [(3, 17 + j) for j in range(19)] + [(4, 60 + j) for j in range(5)]
    rows += [(5, 1)] * 3  # padding: the scratch sequence, one slot each
    lens_seq = {s: max(n for t, n in rows if t == s) for s, _ in rows}
    n = max(-(-v // BLK) for v in lens_seq.values())
    NB = len(lens_seq) * n + 2
    k_pool = torch.randn(NB, HK, BLK, D, generator=g).to(dtype)
    v_pool = torch.randn(NB, HK, BLK, D, generator=g).to(dtype)
    seq_tables = torch.randperm(NB, generator=g)[:len(lens_seq) * n].view(len(lens_seq), n)
    seq = torch.tensor([s for s, _ in rows])
    lens = torch.tensor([v for _, v in rows])
    B, S = len(rows), n * BLK
    table = seq_tables[seq]
    q = torch.randn(B, H, 1, D, generator=g).to(dtype)
    mask = torch.arange(S)[None, :] < lens[:, None]
    mask[seq == 4, :50] = False  # a sliding window
    mask = mask.view(B, 1, 1, S)
    k = k_pool[table].permute(0, 2, 1, 3, 4).reshape(B, HK, S, D)
    v = v_pool[table].permute(0, 2, 1, 3, 4).reshape(B, HK, S, D)
    want = ta.attn_decode_ref(q, k, v, mask, D ** -0.5)
    args = (q.to(DEV), k_pool.to(DEV), v_pool.to(DEV), table.to(DEV).int(), mask.to(DEV), D ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for kw in ({}, {"seq": seq.to(DEV)}):
        got = ta.paged_attn_decode(*args, nsplit=2, block=16, lens=lens.to(DEV), **kw)
        assert got.shape == (B, 1, H * D) and got.dtype == dtype
        err = (got.double().cpu() - want).norm(dim=-1) / want.norm(dim=-1)
        assert float(err.max()) < tol, (kw.keys(), err)


def _mla_case(B, H, S, R, P, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(B, 1, H, R + P + 8, generator=g).to(dtype)  # q_lat and q_rope as views of one tensor
    c = torch.randn(B, 1, S, R + P, generator=g).to(dtype)
    mask = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    mask[0, ..., : S - 3] = True
    if B > 1:
        mask[1, ..., 2: S // 2] = True
        mask[1, ..., 9:12] = False
    return wide[..., :R], wide[..., R:R + P], c, mask


@pytest.mark.parametrize("H", [4, 16, 32, 20])  # one padded group, one group, two groups, a count no multiple of 16
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_equals_its_reference(H, dtype):
    B, S, R, P = 2, 70, 64, 32
    ql, qr, c, mask = _mla_case(B, H, S, R, P, dtype, seed=H)
    assert ta.mla_supported(ql, qr, c, mask)
    want = ta.mla_decode_ref(ql, qr, c, mask, 0.1)
    got = ta.mla_decode(ql.to(DEV), qr.to(DEV), c.to(DEV), mask.to(DEV), 0.1, nsplit=3, block=16)
    assert got.shape == (B, 1, H, R) and got.dtype == dtype
    err = float((got.double().cpu() - want).norm() / want.norm())
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), err


def test_mla_decode_over_paged_blocks():
    """The latent rows in a pool of blocks, each sequence's through its row of a block table (in
    no particular order), lens cutting the walk short; a row with nothing to attend is 0."""
    B, H, S, R, P, BLK = 3, 16, 40, 32, 16, 8
    ql, qr, c, _ = _mla_case(B, H, S, R, P, torch.float32, seed=7)
    nb = S // BLK
    perm = torch.randperm(B * nb + 2)[:B * nb]
    pool = torch.randn(B * nb + 2, 1, BLK, R + P)
    table = perm.view(B, nb)
    for b in range(B):
        for j in range(nb):
            pool[table[b, j], 0] = c[b, 0, j * BLK:(j + 1) * BLK]
    lens = torch.tensor([S, 23, 5])
    mask = torch.arange(S)[None, :] < lens[:, None]
    mask[2] = False
    mask = mask[:, None, None]
    want = ta.mla_decode_ref(ql, qr, c, mask, 0.2)
    got = ta.mla_decode(ql.to(DEV), qr.to(DEV), pool.to(DEV), mask.to(DEV), 0.2, table=table.to(DEV),
                        lens=lens.to(DEV), nsplit=2, block=16).cpu()  # 16: a tile's least size on a GPU
    assert float(got[2].abs().max()) == 0.0
    assert float((got.double() - want).norm() / want.norm()) < 1e-5


def test_mla_decode_refuses_what_it_cannot_run():
    ql, qr, c, mask = _mla_case(1, 4, 16, 48, 16, torch.float32, seed=0)  # R = 48: no power of two
    assert not ta.mla_supported(ql, qr, c, mask)
    ql, qr, c, mask = _mla_case(1, 4, 16, 32, 16, torch.float32, seed=0)
    assert not ta.mla_supported(ql, qr, c[..., :-1], mask)  # rows of another width
    assert not ta.mla_supported(ql, qr, c, mask.float())
