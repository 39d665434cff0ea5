"""LiveBytes: the peak bytes of tensor storage that torch ops made and kept alive at once, inside
the `with` (a TorchDispatchMode, so it works on the CPU for code that runs the same ops on a GPU).
A storage counts from the op that made it until the last tensor made on it is gone; storage an
op returns from its inputs (views, in-place ops) is not new."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.refs: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.now = self.peak = 0

    def _drop(self, ptr: int) -> None:
        self.refs[ptr] -= 1
        if not self.refs[ptr]:
            del self.refs[ptr]
            self.now -= self.size.pop(ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0]
                  if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr not in self.refs:
                if ptr in inputs:
                    continue
                self.refs[ptr], self.size[ptr] = 0, s.nbytes()
                self.now += s.nbytes()
                self.peak = max(self.peak, self.now)
            self.refs[ptr] += 1
            weakref.finalize(t, self._drop, ptr)
        return out
