"""GGUF blocks into the GPU kernels' layout (kernels/packed.py from_gguf), the torch path against the
Triton one (kernels/triton_gguf.py, DSQ_TRITON_GGUF=1), on one layer's weights from pinned memory as a
streamed prefill converts them: wall ms per module (synced), whether the planes agree byte for byte,
and the layer's total.

    python -m benchmarks.gguf_convert MODEL.gguf [--layer 0] [--repeat 5]
    python -m benchmarks.gguf_convert MODEL.gguf --count-ops   # no GPU needed: the torch path's ops
                                                               # per tensor (each a kernel launch on a GPU)
"""

from __future__ import annotations

import argparse
import time


def _timed(fn, repeat: int) -> tuple[float, object]:
    import torch

    out = fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best * 1e3, out


def _count_ops(model: str, layer: int) -> None:
    """The torch ops packed.from_gguf dispatches for each of a layer's tensors (its CPU-side cost on a
    GPU, where each is a kernel launch), counted by a dispatch mode on the CPU."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from dsq.formats.gguf_file import GGUFFile
    from dsq.kernels import gguf_ref, packed

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    g = GGUFFile(model)
    total = 0
    for t in [t for t in g.tensors if t.name.startswith(f"blk.{layer}.") and t.type_name in gguf_ref.SUPPORTED
              and t.type_name not in ("F32", "F16", "BF16")]:
        arr, _, shape = g.raw(t.name)
        raw = torch.from_numpy(arr.copy()).reshape(-1, gguf_ref.row_bytes(t.type_name, shape[-1]))
        with Count() as c:
            packed.from_gguf(raw, t.type_name, shape[-1])
        total += c.n
        print(f"{t.name:32} {t.type_name:5} {c.n:5} ops")
    print(f"layer {layer}: {total} ops")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--count-ops", action="store_true", help="count the torch path's dispatched ops, on the CPU")
    a = ap.parse_args(argv)
    if a.count_ops:
        return _count_ops(a.model, a.layer)

    import torch

    from dsq.formats.gguf_file import GGUFFile
    from dsq.kernels import gguf_ref, packed

    g = GGUFFile(a.model)
    total = {"torch": 0.0, "triton": 0.0}
    print(f"{'tensor':32} {'type':5} {'MB':>6} {'torch ms':>9} {'triton ms':>9} same")
    for t in [t for t in g.tensors if t.name.startswith(f"blk.{a.layer}.") and t.type_name in ("Q4_K", "Q6_K")]:
        arr, _, shape = g.raw(t.name)
        K = shape[-1]
        raw = torch.from_numpy(arr.copy()).reshape(-1, gguf_ref.row_bytes(t.type_name, K)).pin_memory()
        ms = {}
        outs = {}
        for path, on in (("torch", False), ("triton", True)):
            packed.TRITON_GGUF = on
            ms[path], outs[path] = _timed(lambda: packed.from_gguf(raw, t.type_name, K, device="cuda"), a.repeat)
            total[path] += ms[path]
        same = all(torch.equal(outs["torch"].tensors()[k].view(torch.uint8), v.view(torch.uint8))
                   for k, v in outs["triton"].tensors().items())
        print(f"{t.name:32} {t.type_name:5} {raw.numel() / 1e6:6.1f} {ms['torch']:9.2f} {ms['triton']:9.2f} {same}",
              flush=True)
    print(f"layer {a.layer}: torch {total['torch']:.2f} ms, triton {total['triton']:.2f} ms")


if __name__ == "__main__":
    main()
