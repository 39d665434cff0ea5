"""Group-wise integer quantization: round-to-nearest (the baseline) and GPTQ.

GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"): quantize the columns of W one at a time and spread each column's
rounding error over the columns not yet quantized, weighted by the inverse Hessian of the layer's
reconstruction loss, H = 2 X^T X. Lazy block updates of 128 columns; optional act-order
(columns by decreasing H diagonal) with groups formed in that order and recorded in g_idx.

Shapes: W (N, K) torch layout; groups run along K; scales/zeros (G, N).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class IntQuant:
    """Codes and parameters of one quantized weight."""

    q: torch.Tensor  # (N, K) integer codes, original column order
    scales: torch.Tensor  # (G, N) float32
    zeros: torch.Tensor  # (G, N) integer zero points
    g_idx: torch.Tensor  # (K,) group of every input column
    bits: int

    def dequantize(self) -> torch.Tensor:
        gi = self.g_idx.long()
        return (self.q.float() - self.zeros.float().t()[:, gi]) * self.scales.t()[:, gi]


def group_params(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and integer zero for the rows of w (R, g): asymmetric min/max, or symmetric |max|."""
    maxq = 2**bits - 1
    wmin = w.min(dim=1).values.clamp(max=0)
    wmax = w.max(dim=1).values.clamp(min=0)
    if sym:
        wmax = torch.maximum(wmin.abs(), wmax)
        scale = 2 * wmax / maxq
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        scale = (wmax - wmin) / maxq
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        zero = torch.round(-wmin / scale).clamp(0, maxq)
    # the checkpoint stores scales in fp16: quantize against exactly what will be stored
    scale = scale.clamp(6e-8, 65504).half().float()
    return scale, zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    return torch.clamp(torch.round(w / scale) + zero, 0, 2**bits - 1)


def rtn(w: torch.Tensor, bits: int, group: int, sym: bool) -> IntQuant:
    """Round-to-nearest, group-wise along the input dimension."""
    N, K = w.shape
    g = K if group == -1 else group
    wg = w.float().reshape(N, K // g, g).transpose(0, 1).reshape(-1, g)  # (G*N, g)
    scale, zero = group_params(wg, bits, sym)
    q = quantize_codes(wg, scale[:, None], zero[:, None], bits)
    q = q.reshape(K // g, N, g).transpose(0, 1).reshape(N, K)
    return IntQuant(q.to(torch.int32), scale.reshape(K // g, N), zero.reshape(K // g, N).to(torch.int32),
                    torch.arange(K) // g, bits)


class Hessian:
    """Running H = 2/n * sum x x^T over the rows fed to `add` (x: (..., K))."""

    def __init__(self, k: int, device):
        self.H = torch.zeros(k, k, dtype=torch.float32, device=device)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        m = x.shape[0]
        self.H *= self.n / (self.n + m)
        self.n += m
        x = x * (2.0 / self.n) ** 0.5
        self.H += x.t() @ x


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
    scale = zero = None
    for i1 in range(0, K, block):
        i2 = min(i1 + block, K)
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % g == 0:  # new group: parameters from the (error-updated) weights as they are now
                cur = torch.cat([W1[:, i:], W[:, i2:]], dim=1)[:, :g]
                scale, zero = group_params(cur, bits, sym)
                scales[col // g], zeros[col // g] = scale, zero
            wcol = W1[:, i]
            qcol = quantize_codes(wcol, scale, zero, bits)
            Q1[:, i] = qcol
            err = (wcol - scale * (qcol - zero)) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] @ Hinv1[i, i:][None, :]
            Err1[:, i] = err
        Q[:, i1:i2] = Q1
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    inv = torch.argsort(perm)
    g_idx = (torch.arange(K, device=W.device) // g)[inv]  # group of each original column
    return IntQuant(Q[:, inv].to(torch.int32).cpu(), scales.cpu(), zeros.to(torch.int32).cpu(), g_idx.cpu(), bits)
