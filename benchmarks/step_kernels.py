"""The kernels one GPU decode step launches, counted on the CPU: a tiny random GGUF of a shape,
loaded in the GPU's layout (PackedLinear, stacked experts), its decode step run with every
dispatch that a GPU would send to a Triton kernel sent there under TRITON_INTERPRET=1 (the
quantized GEMVs, the decode attention, the elementwise kernels), and every launch recorded: each
Triton kernel, and each torch op that launches one on a GPU (view and allocation ops do not).

Triton launches are recorded, not run: the counts need no values, and the interpreter takes
seconds for one quantized GEMV. A decode step that is captured as a CUDA graph replays exactly
these launches, and at decode's few thousand values a launch costs ~2-3 us whatever it does, so
their count is what bounds such a step (docs/benchmarks.md#gpu-decode). Counts only: timings need the GPU.

    python -m benchmarks.step_kernels [--shape tiny,tiny-deepseek-v2] [--mix Q4_K_M] [--layers N] [--list]

Prints, per shape, the launches per decode step with the one-launch elementwise kernels
(kernels/triton_elementwise.py) and without (DSQ_GPU_ELEMENTWISE=0), and per layer. --layers
gives the tiny widths a real model's depth (32: Llama-3-8B's, 27: DeepSeek-V2-Lite's), whose type
mix then varies by layer as the real file's does.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is decorated
os.environ.setdefault("DSQ_FUSED_LAYER", "0")  # the CPU's one-call layer is not the GPU's step

# torch ops that launch no kernel on a GPU: views, metadata, allocation
NO_LAUNCH = {"empty", "empty_strided", "empty_like", "view", "_unsafe_view", "reshape", "split", "split_with_sizes",
             "chunk", "slice", "select", "transpose", "t", "permute", "unsqueeze", "squeeze", "expand", "as_strided",
             "alias", "detach", "lift_fresh", "unbind", "view_as", "_reshape_alias", "narrow", "unflatten",
             "flatten", "diagonal", "movedim", "resize_", "set_", "_local_scalar_dense", "promote_types", "detach_",
             "resolve_neg", "resolve_conj", "result_type"}
# torch ops that launch a kernel only when they return a new tensor (a cast to the same dtype does not)
WHEN_NEW = {"to", "contiguous", "reshape", "type_as"}


@contextmanager
def _launches(counts: Counter):
    """While inside: Triton launches are recorded, not run (the interpreter takes seconds for one
    quantized GEMV, and a count needs no values: their outputs keep whatever memory they got,
    which no later launch count depends on), and torch ops that launch a kernel are counted too.
    Record into `counts` only while `counts["on"]` is set (then removed)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            out = func(*args, **(kwargs or {}))
            if counts["on"] and name not in NO_LAUNCH and not (name in WHEN_NEW and out is args[0]):
                counts[f"torch {name}"] += 1
            return out

    run = InterpretedFunction.run

    def recorded(self, *args, **kw):
        if counts["on"]:
            counts[f"triton {getattr(self.fn, '__name__', self.fn)}"] += 1

    InterpretedFunction.run = recorded
    try:
        with Ops(), torch.inference_mode():
            yield
    finally:
        InterpretedFunction.run = run
        del counts["on"]


@contextmanager
def _as_on_a_gpu():
    """dispatch sends CPU tensors where it would send CUDA ones (Triton kernels, interpreted)."""
    import torch

    from dsq.kernels import dispatch, packed, triton_attn
    from dsq.runtime import native_loader

    saved = {k: getattr(dispatch, k) for k in ("use_triton", "_elementwise_gpu", "packed_linear", "packed_experts",
                                                "attention", "attention_step", "mla_decode")}
    stack_on = native_loader.STACK_ON
    native_loader.STACK_ON = ("cuda", "cpu")  # routed experts stacked, as on a GPU
    plain_attention, plain_linear, plain_experts = dispatch.attention, dispatch.packed_linear, dispatch.packed_experts

    def packed_linear(x, p, bias=None):
        y = dispatch._triton_linear(dispatch.gpu_kernel(p, x.numel() // p.K, x.dtype), x, p, bias)
        return y if y is not None else plain_linear(x, p, bias)

    def packed_experts(x, p, ids, n_expert):
        from dsq.kernels import triton_common, triton_gemv, triton_gemv_q8

        if dispatch.ACT_Q8 and packed.q8_ok(p, 1):
            return triton_gemv_q8.q8_experts(x, p, ids, n_expert)
        if triton_common.supported(p, x):
            return triton_gemv.gemv_experts(x, p, ids, n_expert)
        return plain_experts(x, p, ids, n_expert)

    def attention(q, k, v, mask, scale, softcap=None):
        qt = q.transpose(1, 2)
        if q.shape[1] == 1 and mask is not None and not softcap and triton_attn.supported(qt, k, v, mask):
            return triton_attn.attn_decode(qt, k, v, mask, scale)
        return plain_attention(q, k, v, mask, scale, softcap)

    dispatch.use_triton = lambda device: True
    dispatch._elementwise_gpu = lambda *ts: dispatch.GPU_ELEMENTWISE and not torch.is_grad_enabled()
    dispatch.packed_linear, dispatch.packed_experts = packed_linear, packed_experts
    def mla_decode(q_lat, q_rope, c, mask, scale, table=None, lens=None):
        if not triton_attn.mla_supported(q_lat, q_rope, c, mask):
            return None
        return triton_attn.mla_decode(q_lat, q_rope, c, mask, scale, table=table, lens=lens)

    def attention_step(q, k, v, norms, cos, sin, k_cache, v_cache, slots, kv_len, mask, scale, softcap):
        if q.shape[1] != 1 or mask is None or softcap:
            return None
        return dispatch._attention_step_gpu(q, k, v, norms, cos, sin, k_cache, v_cache, slots, kv_len, mask, scale)

    dispatch.attention, dispatch.attention_step, dispatch.mla_decode = attention, attention_step, mla_decode
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(dispatch, k, v)
        native_loader.STACK_ON = stack_on


def step_launches(path: Path, elementwise: bool) -> tuple[Counter, int]:
    """(launches of one decode step by name, layers) for the GGUF at `path`, loaded in bf16."""
    import torch

    from dsq.kernels import dispatch
    from dsq.runtime.native import NativeModel

    dispatch.GPU_ELEMENTWISE = elementwise
    counts: Counter = Counter(on=0)
    with _as_on_a_gpu(), _launches(counts):
        m = NativeModel(path, "gguf", n_ctx=64, dtype="bf16")
        model, cache = m.model, m.cache
        pad = torch.zeros(1, dtype=torch.long)
        model(torch.tensor([[3, 5, 7, 9]]), torch.arange(4), cache, pad, kv_len=4, last_only=True)
        counts["on"] = 1
        model(torch.tensor([[11]]), torch.tensor([4]), cache, pad, kv_len=5, last_only=True)
    return counts, len(model.model.layers)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="tiny,tiny-deepseek-v2")
    ap.add_argument("--mix", default="Q4_K_M")
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the shape's)")
    ap.add_argument("--list", action="store_true", help="every launch by name, not only the totals")
    a = ap.parse_args(argv)

    from dsq.bench.random_gguf import write_random_gguf

    print("| shape | layers | launches a step, one-launch elementwise | without | per layer, with / without |")
    print("|---|---|---|---|---|")
    lists = []
    with tempfile.TemporaryDirectory() as d:
        for shape in a.shape.split(","):
            path = Path(d) / f"{shape}.gguf"
            write_random_gguf(path, shape=shape, mix=a.mix, layers=a.layers)
            on, n = step_launches(path, True)
            off, _ = step_launches(path, False)
            t_on, t_off = sum(on.values()), sum(off.values())
            print(f"| {shape} {a.mix} | {n} | {t_on} | {t_off} | {t_on / n:.1f} / {t_off / n:.1f} |")
            lists.append((shape, on, off))
    if a.list:
        for shape, on, off in lists:
            print(f"\n{shape}: launches a step (with / without the elementwise kernels)")
            for k in sorted(set(on) | set(off), key=lambda k: -max(on[k], off[k])):
                print(f"  {on[k]:4d} {off[k]:4d}  {k}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
