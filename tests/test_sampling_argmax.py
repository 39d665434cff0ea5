"""Greedy sampling's argmax over a large vocabulary (dsq.runtime.sampling.argmax, two passes over
chunks): the index torch.argmax gives, the first maximum, ties and NaN included."""

from __future__ import annotations

import torch

from dsq.runtime.sampling import Sampler, SamplingParams, argmax


def test_argmax_equals_torch():
    gen = torch.Generator().manual_seed(0)
    V = 512 * 512
    for t in range(60):
        x = torch.randn(3, V, generator=gen) if t % 2 else torch.randint(0, 3, (3, V), generator=gen).float()
        if t % 5 == 0:  # NaN wins, the first one
            x[1, 70_000] = x[1, 9] = float("nan")
        if t % 7 == 0:  # a tie across chunks: the first
            x[2, 5] = x[2, 200_000] = x[2].max() + 1
        assert torch.equal(argmax(x), x.argmax(-1))
    odd = torch.randn(2, V + 3, generator=gen)  # not whole chunks: torch's argmax
    assert torch.equal(argmax(odd), odd.argmax(-1))
    wide = torch.randn(V, 2, generator=gen).t()  # not contiguous
    assert torch.equal(argmax(wide), wide.argmax(-1))
    assert torch.equal(Sampler(SamplingParams(temperature=0))(x), x.argmax(-1))
