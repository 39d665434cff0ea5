"""Where the captured DeepSeek decode step departs from the eager one, layer by layer (GPU only).

Loads one random tiny GGUF three ways (captured, eager, and eager attending over the graph's whole
span), prefills the same prompt, takes one decode step each and prints which attention each step
ran (the MLA decode kernel or SDPA), per layer the attention output's difference, the experts each
router chose and how far the latent cache row each step wrote differs; then the logits.

    python -m benchmarks.deepseek_graph_probe [--shape tiny-deepseek-v2] [--mix Q4_K_M] [--prompt 12] [--grad]

Run it again with DSQ_TRITON_ATTN=0 (the MLA kernel off) and DSQ_GPU_ELEMENTWISE=0. With --grad
the steps run with autograd on, where the MLA kernel declines and the eager step attends through
SDPA: what made the test fail (one bf16 ulp of attention output, ~1% of the random logits).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

_SEEN: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}


def _record_routers() -> None:
    """Each router's chosen experts copied into a buffer per (router, shape): a copy the captured
    step replays, so the graph's choices are seen too."""
    from dsq.models.deepseek_model import Router

    forward = Router.forward

    def recorded(self, x):
        w, ids = forward(self, x)
        key = (id(self), tuple(ids.shape))
        if key not in _SEEN:
            _SEEN[key] = torch.empty_like(ids)
        _SEEN[key].copy_(ids)
        return w, ids

    Router.forward = recorded


_ATTN: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
_CALLS: dict[str, int] = {}


def _record_attention() -> None:
    """Each layer's attention output (o_proj's input) copied into a buffer per (module, shape), so
    the captured step's are seen too; and a count of the MLA kernel's and the plain attention's
    calls (the captured step's counted once, at capture)."""
    from dsq.kernels import dispatch
    from dsq.models.deepseek_model import MLAttention

    for name in ("mla_decode", "attention"):
        fn = getattr(dispatch, name)

        def counted(*a, _fn=fn, _name=name, **k):
            out = _fn(*a, **k)
            key = _name + ("" if out is not None else " (declined)")
            _CALLS[key] = _CALLS.get(key, 0) + 1
            return out

        setattr(dispatch, name, counted)
    forward = MLAttention.forward

    def recorded(self, *a, **k):
        out = forward(self, *a, **k)
        key = (id(self), tuple(out.shape))
        if key not in _ATTN:
            _ATTN[key] = torch.empty_like(out)
        _ATTN[key].copy_(out)
        return out

    MLAttention.forward = recorded


def _attn_out(m, shape) -> list[torch.Tensor | None]:
    return [_ATTN.get((id(layer.self_attn), shape)) for layer in m.model.model.layers]


def _choices(m, rows: int) -> list[list[int] | None]:
    from dsq.models.deepseek_model import Router

    out = []
    for layer in m.model.model.layers:
        r = next((x for x in layer.modules() if isinstance(x, Router)), None)
        buf = None if r is None else _SEEN.get((id(r), (rows, r.top_k)))
        out.append(None if buf is None else sorted(buf[0].tolist()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grad", action="store_true", help="steps with autograd on (the MLA kernel then declines)")
    ap.add_argument("--shape", default="tiny-deepseek-v2")
    ap.add_argument("--mix", default="Q4_K_M")
    ap.add_argument("--prompt", type=int, default=12)
    ap.add_argument("--ctx", type=int, default=128)
    a = ap.parse_args()

    from dsq.bench.random_gguf import write_random_gguf
    from dsq.runtime.native import NativeModel

    _record_routers()
    _record_attention()
    path = Path(tempfile.mkdtemp()) / f"{a.shape}.gguf"
    write_random_gguf(path, shape=a.shape, mix=a.mix)
    kw = dict(n_ctx=a.ctx, gpu_layers="all", experts="gpu")
    graph = NativeModel(path, "gguf", **kw)
    print(f"calls at load and capture: {_CALLS}")
    _CALLS.clear()
    eager = NativeModel(path, "gguf", cuda_graph=False, **kw)
    full = NativeModel(path, "gguf", cuda_graph=False, **kw)
    assert graph._graph is not None, "the model's step was not captured"
    V = graph.model.args.vocab_size
    ids = [(j * 104729 + 5) % V for j in range(a.prompt)]
    import contextlib

    with contextlib.nullcontext() if a.grad else torch.inference_mode():  # as generation runs
        pad = torch.zeros(1, dtype=torch.long, device="cuda")
        pre = [m._prefill(ids, 0, m.cache, pad) for m in (graph, eager, full)]
        print(f"prefill logits, largest difference: graph-eager {float((pre[0] - pre[1]).abs().max()):.3g}")
        tok = pre[1].argmax(-1)
        n = a.prompt
        la = graph._decode(tok, n, graph.cache, pad).clone()
        oa = [None if t is None else t.clone() for t in _attn_out(graph, (1, 1, graph.model.args.hidden_size))]
        _CALLS.clear()
        lb = eager._decode(tok, n, eager.cache, pad)
        print(f"calls in an eager decode step: {_CALLS}")
        ob = _attn_out(eager, (1, 1, eager.model.args.hidden_size))
        for i, (x, y) in enumerate(zip(oa, ob)):
            if x is not None and y is not None:
                print(f"layer {i}: attention output graph-eager {float((x.float() - y.float()).abs().max()):.3g}, "
                      f"scale {float(y.float().abs().max()):.3g}")
        slots = torch.tensor([n], device="cuda")
        lc = full.model(tok[:, None], slots, full.cache, pad, kv_len=a.ctx, last_only=True)[:, -1]
        torch.cuda.synchronize()
        ca, cb, cc = _choices(graph, 1), _choices(eager, 1), _choices(full, 1)
        for i in range(len(graph.cache.k)):
            ra, rb, rc = (m.cache.k[i][:, :, n].float() for m in (graph, eager, full))
            same = "same" if ca[i] == cb[i] else f"graph {ca[i]} eager {cb[i]}"
            print(f"layer {i}: experts {same if ca[i] is not None else '(dense)'}"
                  f"{'' if cb[i] == cc[i] else f'; eager over the whole span {cc[i]}'}; latent row graph-eager "
                  f"{float((ra - rb).abs().max()):.3g}, eager-eager(whole span) {float((rb - rc).abs().max()):.3g}, "
                  f"scale {float(rb.abs().max()):.3g}")
        s = float(lb.abs().max())
        print("decode logits, largest difference over the largest: "
              f"graph-eager {float((la - lb).abs().max()) / s:.3g}, "
              f"graph-eager(whole span) {float((la - lc).abs().max()) / s:.3g}, "
              f"eager-eager(whole span) {float((lb - lc).abs().max()) / s:.3g}")


if __name__ == "__main__":
    main()
