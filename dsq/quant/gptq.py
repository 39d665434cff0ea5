"""GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"): quantize the columns of W one at a time and spread each column's
rounding error over the columns not yet quantized, weighted by the inverse Hessian of the layer's
reconstruction loss, H = 2 X^T X. Lazy block updates of 128 columns; optional act-order
(columns by decreasing H diagonal) with groups formed in that order and recorded in g_idx.

Shapes: W (N, K) torch layout; groups run along K; scales/zeros (G, N).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from dsq.quant.blocks import Capture, input_stages, phase
from dsq.quant.moe import calibrates
from dsq.quant.rtn import IntMethod, IntQuant, group_params, quantize_codes, rtn

if TYPE_CHECKING:
    from dsq.quant.blocks import Block
    from dsq.quant.spec import QuantSpec


class Hessian:
    """Running H = 2/n * sum x x^T over the rows fed to `add` (x: (..., K))."""

    def __init__(self, k: int, device):
        self.H = torch.zeros(k, k, dtype=torch.float32, device=device)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1])
        # bf16/fp16 values are exact in TF32, so on a GPU their products can use it (4x faster)
        tf32 = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
        x = x.float()
        m = x.shape[0]
        self.H *= self.n / (self.n + m)
        self.n += m
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32 or prev
        try:
            self.H.addmm_(x.t(), x, alpha=2.0 / self.n)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev


def gptq(w: torch.Tensor, H: torch.Tensor, bits: int, group: int, sym: bool, act_order: bool = False,
         damp: float = 0.01, block: int = 128) -> IntQuant:
    """GPTQ on one weight (N, K) with Hessian H (K, K). Returns codes in the original column order."""
    W = w.float().clone()
    N, K = W.shape
    H = H.clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(K, device=W.device)
    W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.mean(torch.diag(H)) * torch.eye(K, device=W.device)
    L = torch.linalg.cholesky(H)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)

    g = K if group == -1 else group
    G = K // g
    Q = torch.zeros_like(W)
    scales = torch.zeros(G, N, device=W.device)
    zeros = torch.zeros(G, N, device=W.device)
    sc = torch.zeros(N, device=W.device)
    zr = torch.zeros(N, device=W.device)
    for i1 in range(0, K, block):
        i2 = min(i1 + block, K)
        B = i2 - i1
        inner = g if (g <= B and B % g == 0 and i1 % g == 0) else 0  # groups start inside this block
        if not inner and i1 % g == 0:  # a group spanning blocks starts here: its parameters from
            s_, z_ = group_params(W[:, i1:i1 + g], bits, sym)  # the weights as they are now
            sc.copy_(s_)
            zr.copy_(z_)
            scales[i1 // g], zeros[i1 // g] = s_, z_
        run = _block_runner(N, B, inner, bits, sym, W.device)
        W1, Q1, Err1, sc_blk, zr_blk = run(W[:, i1:i2], Hinv[i1:i2, i1:i2], sc, zr)
        if inner:
            scales[i1 // g:i2 // g], zeros[i1 // g:i2 // g] = sc_blk, zr_blk
            sc.copy_(sc_blk[-1])
            zr.copy_(zr_blk[-1])
        Q[:, i1:i2] = Q1
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    inv = torch.argsort(perm)
    g_idx = (torch.arange(K, device=W.device) // g)[inv]  # group of each original column
    return IntQuant(Q[:, inv].to(torch.int32).cpu(), scales.cpu(), zeros.to(torch.int32).cpu(), g_idx.cpu(), bits)


def _block_body(W1, Hinv1, sc, zr, Q1, Err1, sc_blk, zr_blk, inner: int, bits: int, sym: bool) -> None:
    """GPTQ over the B columns of one block, in place: quantize a column, push its error onto the
    columns to its right. `inner` > 0: groups of that width start inside the block."""
    for i in range(W1.shape[1]):
        if inner and i % inner == 0:
            s_, z_ = group_params(W1[:, i:i + inner], bits, sym)
            sc.copy_(s_)
            zr.copy_(z_)
            sc_blk[i // inner].copy_(s_)
            zr_blk[i // inner].copy_(z_)
        w = W1[:, i]
        q = quantize_codes(w, sc, zr, bits)
        Q1[:, i] = q
        err = (w - sc * (q - zr)) / Hinv1[i, i]
        W1[:, i:].sub_(err[:, None] * Hinv1[i, i:][None, :])
        Err1[:, i] = err


GPTQ_CUDA_GRAPHS = True  # False: the eager loop everywhere (set when a graph differs from it)
_GRAPHS: dict[tuple, "_BlockGraph"] = {}


class _BlockGraph:
    """The per-column loop of one block as a CUDA graph: hundreds of tiny kernels per column
    are launch-bound in eager mode (~9 s per Llama-8B layer on an H200)."""

    def __init__(self, N: int, B: int, inner: int, bits: int, sym: bool, device):
        f = dict(device=device)
        self.W1, self.Hinv1 = torch.zeros(N, B, **f), torch.eye(B, **f)
        self.sc, self.zr = torch.ones(N, **f), torch.zeros(N, **f)
        self.Q1, self.Err1 = torch.zeros(N, B, **f), torch.zeros(N, B, **f)
        nblk = max(1, B // inner) if inner else 1
        self.sc_blk, self.zr_blk = torch.zeros(nblk, N, **f), torch.zeros(nblk, N, **f)
        args = (self.W1, self.Hinv1, self.sc, self.zr, self.Q1, self.Err1, self.sc_blk, self.zr_blk, inner, bits, sym)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _block_body(*args)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            _block_body(*args)

    def __call__(self, W1, Hinv1, sc, zr):
        self.W1.copy_(W1)
        self.Hinv1.copy_(Hinv1)
        self.sc.copy_(sc)
        self.zr.copy_(zr)
        self.graph.replay()
        return self.W1, self.Q1, self.Err1, self.sc_blk, self.zr_blk


def _block_runner(N: int, B: int, inner: int, bits: int, sym: bool, device):
    """A function (W1, Hinv1, sc, zr) -> (W1, Q1, Err1, group scales, group zeros) for one block."""
    if torch.device(device).type == "cuda" and GPTQ_CUDA_GRAPHS:
        key = (N, B, inner, bits, sym, str(device))
        if key in _GRAPHS:
            return _GRAPHS[key]
        # a model has a handful of shapes (qkv, o, gate/up, down); each new graph is checked once
        # against the eager loop on its first real block, and graphs are given up if they differ
        if len(_GRAPHS) >= 8:
            _GRAPHS.pop(next(iter(_GRAPHS)))
        graph = _BlockGraph(N, B, inner, bits, sym, device)

        def checked(W1, Hinv1, sc, zr):
            want = _eager_block(W1, Hinv1, sc, zr, N, B, inner, bits, sym)
            got = [t.clone() for t in graph(W1, Hinv1, sc, zr)]
            if all(torch.equal(a, b) for a, b in zip(got, want)):
                _GRAPHS[key] = graph
                return got
            global GPTQ_CUDA_GRAPHS
            GPTQ_CUDA_GRAPHS = False
            warnings.warn("GPTQ: the CUDA-graph block differs from the eager loop; using the eager loop",
                          RuntimeWarning, stacklevel=2)
            return want

        return checked

    def eager(W1, Hinv1, sc, zr):
        W1 = W1.clone()
        Q1, Err1 = torch.zeros_like(W1), torch.zeros_like(W1)
        nblk = max(1, B // inner) if inner else 1
        sc_blk = torch.zeros(nblk, N, device=W1.device)
        zr_blk = torch.zeros(nblk, N, device=W1.device)
        sc, zr = sc.clone(), zr.clone()
        _block_body(W1, Hinv1, sc, zr, Q1, Err1, sc_blk, zr_blk, inner, bits, sym)
        return W1, Q1, Err1, sc_blk, zr_blk

    return eager


def _eager_block(W1, Hinv1, sc, zr, N: int, B: int, inner: int, bits: int, sym: bool):
    return _block_runner(N, B, inner, bits, sym, "cpu")(W1, Hinv1, sc, zr)


class GPTQ(IntMethod):
    name = "gptq"
    needs_calibration = True
    takes_act_order = True

    def settings(self, spec: "QuantSpec") -> dict:
        return {**super().settings(spec), "act_order": spec.act_order, "damp": spec.damp}

    def quantize_block(self, block: "Block", spec: "QuantSpec") -> dict:
        """Stage by stage (dsq.quant.blocks.input_stages), each group of Linears reading one input
        solved over one Hessian of that input; a stage's Hessians are gathered in one calibration
        forward of the block as quantized so far (an MoE layer's in as few forwards as
        HESSIAN_BYTES allows), so each expert's Hessian holds the tokens its router sent it."""
        out: dict[str, torch.Tensor] = {}
        for stage in input_stages(block.linears):
            for chunk in _chunks(stage, block):
                hessians = self._hessians(block, chunk)
                for names in chunk:
                    self._solve(out, block, names, hessians[names[0]], spec)
        return out

    @staticmethod
    def _hessians(block: "Block", groups: list[list[str]]) -> dict[str, Hessian]:
        firsts = {g[0]: block.linears[g[0]] for g in groups}
        with Capture(firsts, lambda m: Hessian(m.in_features, m.weight.device)) as cap:
            with phase("gptq: calibration forwards"):
                block.run()
        return cap.data

    def _solve(self, out: dict, block: "Block", names: list[str], h: Hessian, spec: "QuantSpec") -> None:
        """Linears reading the same input share one Hessian, and GPTQ treats rows independently:
        one solve over their stacked rows equals separate solves, with fewer steps. An expert
        with too few tokens is rounded (RTN) instead."""
        lins = block.linears
        if not calibrates(block, names[0], h.n, spec):
            for n in names:
                self.emit(out, n, lins[n], rtn(lins[n].weight.data.cpu(), spec.bits, spec.group_size, bool(spec.sym)),
                          spec)
            return
        with phase("gptq: solve"):
            w = torch.cat([lins[n].weight.data.float() for n in names])
            iq = gptq(w, h.H, spec.bits, spec.group_size, bool(spec.sym), spec.act_order, spec.damp)
        for n, part in zip(names, iq.split([lins[n].out_features for n in names])):
            self.emit(out, n, lins[n], part, spec)


HESSIAN_BYTES = 8 << 30  # Hessians gathered in one forward at most (DeepSeek-V3: 257 of 7168^2 floats)


def _chunks(stage: list[list[str]], block: "Block") -> list[list[list[str]]]:
    """A stage's groups in runs whose Hessians fit HESSIAN_BYTES together (one forward each)."""
    chunks: list[list[list[str]]] = [[]]
    used = 0
    for g in stage:
        size = 4 * block.linears[g[0]].in_features ** 2
        if chunks[-1] and used + size > HESSIAN_BYTES:
            chunks.append([])
            used = 0
        chunks[-1].append(g)
        used += size
    return chunks
