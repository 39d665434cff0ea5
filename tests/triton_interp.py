"""Imported first by the Triton kernel tests: without a GPU the kernels run under
TRITON_INTERPRET=1, which Triton reads when a kernel is decorated, i.e. when its module is
imported; with one, on the GPU (DEV)."""

from __future__ import annotations

import os
import platform

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
if platform.system() == "Linux":  # the dev install brings Triton there: never skip these silently
    import triton  # noqa: F401
else:
    pytest.importorskip("triton")

DEV = "cuda" if CUDA else "cpu"
