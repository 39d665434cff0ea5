"""`dsq eval`: perplexity on held-out text, and KL divergence and top-1 agreement against a
reference model, window by window (no logits are kept: two windows of logits is the peak).

Windows: `ctx` tokens each, non-overlapping, BOS first when the model wants one; every position
but the first is scored (the token it predicts is the next one in the window).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from dsq.errors import DsqError


def load_for_eval(path: str, backend: str | None, ctx: int, threads: int | None):
    from dsq.runtime.engine import load
    from dsq.runtime.model_ref import resolve_model

    ref = resolve_model(path)
    if backend is None:
        backend = "llama.cpp" if ref.kind == "gguf" else "native"
    kw = {"logits_all": True} if backend == "llama.cpp" else {}
    return load(path, backend=backend, ctx=ctx, threads=threads, **kw)


def source_of(path: str | None) -> str | None:
    """The model an artifact was made from, when dsq recorded it."""
    if path is None:
        return None
    p = Path(path)
    if p.is_dir() and (p / "dsq_quant.json").is_file():
        src = json.loads((p / "dsq_quant.json").read_text()).get("source")
        return src if src and Path(src).exists() else None
    if p.is_file():
        from dsq.formats.gguf_file import GGUFFile

        url = GGUFFile(p).field("general.source.url")
        if isinstance(url, str) and url.startswith("file://") and Path(url[7:]).exists():
            return url[7:]
    return None


def _window_stats(logits: np.ndarray, ref: np.ndarray | None, targets: np.ndarray) -> dict:
    """Sums over positions: NLL of targets (model and reference), KL(ref || model), top-1 agreement."""
    out = {"nll": 0.0, "ref_nll": 0.0, "kld": 0.0, "agree": 0, "n": 0}
    for s in range(0, len(targets), 128):
        lm = torch.from_numpy(np.ascontiguousarray(logits[s:s + 128])).double().log_softmax(-1)
        t = torch.from_numpy(targets[s:s + 128]).long()
        out["nll"] -= float(lm.gather(1, t[:, None]).sum())
        out["n"] += len(t)
        if ref is not None:
            lr = torch.from_numpy(np.ascontiguousarray(ref[s:s + 128])).double().log_softmax(-1)
            out["ref_nll"] -= float(lr.gather(1, t[:, None]).sum())
            out["kld"] += float((lr.exp() * (lr - lm)).sum())
            out["agree"] += int((lr.argmax(-1) == lm.argmax(-1)).sum())
    return out


def _logits(model, windows: list[list[int]]) -> list:
    """Each window's logits, in one forward pass where the backend takes a batch."""
    if len(windows) > 1 and hasattr(model, "logits_batch"):
        return list(model.logits_batch(windows))
    return [model.logits(w) for w in windows]


def check_window(window: int, tokens: int) -> None:
    """A scoring window of at least 16 tokens, and at least one window's worth of tokens to score."""
    if window < 16 or tokens < window:
        raise DsqError(f"--window {window} with --tokens {tokens}: the window must be >= 16 tokens and --tokens "
                       ">= --window", "e.g. --window 512 --tokens 4096")


def evaluate(model: str, ref: str | None = None, text: str | None = None, ctx: int = 512, max_tokens: int = 4096,
             backend: str | None = None, ref_backend: str | None = None, threads: int | None = None,
             on_window=None, batch: int = 1) -> dict:
    """Perplexity of MODEL on held-out text; KLD and top-1 agreement against REF if given;
    `batch` windows a forward pass where the backend scores several at once (native)."""
    from dsq.eval.corpus import held_out_text

    check_window(ctx, max_tokens)
    if text is None:
        text = held_out_text()
    m = load_for_eval(model, backend, ctx, threads)
    r = load_for_eval(ref, ref_backend, ctx, threads) if ref else None
    tok = r or m
    ids = tok.tokenize(text, add_bos=False, special=False)
    bos = tok.tokenize("", add_bos=True, special=False)
    step = ctx - len(bos)
    n_win = min(len(ids) // step, max_tokens // ctx)
    if n_win < 1:
        raise DsqError(f"the evaluation text has {len(ids)} tokens, fewer than one window of {ctx}",
                       "give more text or a smaller --window")
    if r is not None:
        vm = m.logits(bos + ids[:4]).shape[-1]
        vr = r.logits(bos + ids[:4]).shape[-1]
        if vm != vr:
            raise DsqError(f"the model has {vm} logits, the reference {vr}", "compare models with the same vocabulary")
    tot = {"nll": 0.0, "ref_nll": 0.0, "kld": 0.0, "agree": 0, "n": 0}
    windows = [bos + ids[w * step:(w + 1) * step] for w in range(n_win)]
    for first in range(0, n_win, batch):
        group = windows[first:first + batch]
        lms = _logits(m, group)
        lrs = _logits(r, group) if r is not None else [None] * len(group)
        for i, (window, lm, lr) in enumerate(zip(group, lms, lrs)):
            st = _window_stats(lm[:-1], None if lr is None else lr[:-1], np.asarray(window[1:]))
            for k in tot:
                tot[k] += st[k]
            if on_window:
                on_window(first + i + 1, n_win)
    res = {"model": model, "reference": ref, "tokens": tot["n"], "windows": n_win, "ctx": ctx,
           "perplexity": math.exp(tot["nll"] / tot["n"]), "backend": m.backend}
    if r is not None:
        ref_ppl = math.exp(tot["ref_nll"] / tot["n"])
        res.update(kld=tot["kld"] / tot["n"], top1_agreement=tot["agree"] / tot["n"], reference_perplexity=ref_ppl,
                   delta_perplexity=res["perplexity"] - ref_ppl)
    return res
