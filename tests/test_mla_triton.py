"""DeepSeek MLA's decode attention kernel (triton_attn.mla_decode) inside the model: a tiny random
V2 / V3's decode steps, and dsq serve's paged steps over latent blocks read in place, through the
kernel (under TRITON_INTERPRET=1, standing in for the GPU it runs on) against the model's own
attention. The kernel against its float64 oracle: tests/test_attn_triton.py."""

from __future__ import annotations

import pytest
import torch
from triton_interp import CUDA  # (sets TRITON_INTERPRET without a GPU)

from dsq.kernels import dispatch
from dsq.kernels import triton_attn as ta  # noqa: E402
from dsq.serve.paged import PagedKV
from test_serve_deepseek import KINDS, _check_paged_forward, hf_model  # noqa: F401

# the CPU stands in for a GPU here; on one, tests/test_elementwise_triton.py and the GPU tests of
# tests/test_serve_deepseek.py run the model's real path
pytestmark = pytest.mark.skipif(CUDA, reason="the interpreter stands in for a GPU")


def _kernel_on_the_cpu(monkeypatch) -> list:
    """dispatch.mla_decode as on a GPU: the kernel wherever it takes the shapes; its calls."""
    calls = []

    def mla_decode(q_lat, q_rope, c, mask, scale, table=None, lens=None):
        if not ta.mla_supported(q_lat, q_rope, c, mask):
            return None
        calls.append(table is not None)
        return ta.mla_decode(q_lat, q_rope, c, mask, scale, table=table, lens=lens)

    monkeypatch.setattr(dispatch, "mla_decode", mla_decode)
    return calls


@pytest.mark.parametrize("kind", KINDS)
def test_decode_steps_through_the_kernel(kind, hf_model, monkeypatch):  # noqa: F811
    """A prompt, then four one-token steps on the model's cache: every layer of every step goes
    through the kernel, and the logits are those of the model's own attention."""
    model = hf_model(kind).model
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.args.vocab_size, (2, 13), generator=g)

    def run():
        cache = model.make_cache(2, 32, torch.float32)
        pad = torch.zeros(2, dtype=torch.long)
        with torch.inference_mode():
            out = [model(ids[:, :9], torch.arange(9), cache, pad, kv_len=9, last_only=True)]
            for t in range(9, 13):
                out.append(model(ids[:, t:t + 1], torch.tensor([t]), cache, pad, kv_len=t + 1))
        return torch.cat(out, 1)

    want = run()
    calls = _kernel_on_the_cpu(monkeypatch)
    got = run()
    assert len(calls) == 4 * model.args.num_hidden_layers and not any(calls)
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())


@pytest.mark.parametrize("kind", KINDS)
def test_paged_steps_read_the_latent_blocks_in_place(kind, hf_model, monkeypatch):  # noqa: F811
    """dsq serve's decode steps with the paged kernel on (as on a GPU): the latent rows written
    into their blocks and attended through the block table, the full forward's logits still."""
    calls = _kernel_on_the_cpu(monkeypatch)
    init = PagedKV.__init__

    def kernel_on(self, *a, **k):
        init(self, *a, **k)
        self.paged_kernel = True

    monkeypatch.setattr(PagedKV, "__init__", kernel_on)
    _check_paged_forward(hf_model(kind).model, True, 1e-4)
    # every layer of the 6 decode steps, and of the shortest sequence's one-token first chunk
    assert len(calls) == 7 * hf_model(kind).model.args.num_hidden_layers and all(calls)

