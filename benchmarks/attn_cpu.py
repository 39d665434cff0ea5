"""The C decode attention (kernels/csrc/attn_cpu.inc dsq_attn_decode) at a model's head layout: one
query token over a float32 KV cache of --pos positions, as each CPU layer of a decode step runs it.

    python -m benchmarks.attn_cpu [--shape llama3-8b] [--pos 512,2048] [--threads 1,2] [--lib OTHER.so ...]

Every build (this tree's, then each --lib: a library built from another commit's csrc, for an A/B)
is timed call by call in turn, --repeat rounds after 3 warm-ups (benchmarks.layer_decode's race), on fresh random q, k and v (16 MiB+
of keys and values at 8B and 2048 positions: more than a core's L2, as in decode, where each layer
reads its own cache). Prints the median and best us a call, the whole step's share for the shape's
layers, and each build's ratio to the first; the outputs of every build are checked against this
tree's (atol 2e-5).
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

HEADS = {"llama3-8b": (32, 8, 128, 32), "qwen2-7b": (28, 4, 128, 28)}  # H, Hk, D, layers


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(HEADS), default="llama3-8b")
    p.add_argument("--pos", default="512,2048", help="cache positions (comma-separated)")
    p.add_argument("--threads", default="1,2", help="thread counts (comma-separated)")
    p.add_argument("--lib", action="append", default=[], help="another build of the kernels' library")
    p.add_argument("--repeat", type=int, default=40)
    a = p.parse_args(argv)

    from benchmarks.layer_decode import _race
    from dsq.kernels import cpu

    builds = [("this tree", cpu.library()[0])] + [(path, cpu.load_file(path)) for path in a.lib]
    H, Hk, D, layers = HEADS[a.shape]
    g = torch.Generator().manual_seed(0)
    for S in (int(x) for x in a.pos.split(",")):
        q, k, v = torch.randn(1, 1, H, D, generator=g), torch.randn(1, Hk, S, D, generator=g), \
            torch.randn(1, Hk, S, D, generator=g)
        for th in (int(x) for x in a.threads.split(",")):
            calls = {name: partial(cpu.attn_decode, q, k, v, None, D ** -0.5, lib=lib, threads=th) for name, lib in builds}
            want = calls["this tree"]()
            for name, run in list(calls.items())[1:]:
                torch.testing.assert_close(run(), want, atol=2e-5, rtol=1e-4, msg=f"{name} differs")
            ms = _race({name: (lambda: None, run) for name, run in calls.items()}, a.repeat)
            first = ms["median"]["this tree"]
            for name in calls:
                med, best = ms["median"][name], ms["best"][name]
                print(f"{a.shape} pos {S:5d} threads {th:2d} {name:>12.12}: median {1e3 * med:8.1f} us  best "
                      f"{1e3 * best:8.1f} us  x{layers} layers {med * layers:6.2f} ms a token  "
                      f"{med / first:5.2f}x this tree's time")


if __name__ == "__main__":
    main()
