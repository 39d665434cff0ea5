"""dsq serve --tp 2 on the CPU (two processes over gloo), tiny random models: the split pool's logits
and the engine's greedy tokens against one process (llama, qwen2, DeepSeek V2 and V3 in float32;
a Q8_0 V2 with its routed experts in RAM; a Q4_K_M llama whose o_proj columns are not whole
blocks a rank), a GGUF Linear's column split, a server on 127.0.0.1 against the one-process
server, and the bad --tp values. Every wait is bounded."""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.request

import pytest
import torch

from serve_util import _start, int8_x_build
from test_serve_engine import _run_engine

CTX = 256
PROMPTS = ["The history of the Roman Empire", "Why is the sky blue?", "def fibonacci(n):"]
N_TOKENS = 8
# (kind, GGUF type or None for the HF directory in float32, --experts)
CASES = [("llama", None, "auto"), ("qwen2", None, "auto"), ("deepseek_v2", None, "auto"), ("deepseek_v3", None, "auto"),
         ("deepseek_v2", "Q8_0", "cpu"), ("llama", "Q4_K_M", "auto")]


@pytest.fixture(autouse=True, scope="module")
def _float_x():
    """x kept in float on the avx2 build (serve_util.int8_x_build), here and in the ranks' processes."""
    if not int8_x_build():
        yield
        return
    mp = pytest.MonkeyPatch()
    mp.setenv("DSQ_NO_VNNI", "1")
    yield
    mp.undo()


@pytest.fixture(scope="module")
def pair(tiny_dir, tiny_gguf):
    """case -> (the model in this process, rank 0's share of it, the ranks): one rank each, one thread
    each (the two processes share the machine's cores). A process is rank 0 of one group at a
    time: a new case's ranks replace the last one's."""
    from dsq.runtime.engine import load
    from dsq.serve import tp

    live = {}

    def get(case):
        if case not in live:
            for ranks in [v[2] for v in live.values()]:
                ranks.close()
            live.clear()
            kind, qtype, experts = case
            path = str(tiny_gguf(kind, qtype) if qtype else tiny_dir(kind))
            ref = load(path, backend="native", ctx=CTX, threads=1, cuda_graph=False, experts=experts)
            load_kw, cuda = tp.plan(2, path, gpu_layers="0", threads=1)
            assert not cuda and load_kw["threads"] == 1
            ranks, nm = tp.start(2, cuda, {**load_kw, "ctx": CTX, "dtype": None, "cuda_graph": False,
                                           "experts": experts})
            live[case] = (ref, nm, ranks)
        return live[case]

    yield get
    for ref, nm, ranks in live.values():
        ranks.close()


def _pool(nm, ranks=None, blocks: int = 32):
    from dsq.serve.paged import PagedKV

    if ranks is None:
        return PagedKV(nm.model, blocks, 4, CTX)
    return ranks.leader(nm.model, blocks, 4, CTX)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(x for x in c if x and x != "auto"))
def test_split_logits_and_greedy_tokens_match_one_process(case, pair):
    ref, nm, ranks = pair(case)
    kind, qtype, _ = case
    a, b = ref.model.args, nm.model.args
    # rank 0 holds half the heads (and, but for MLA's one latent row, half the KV cache's heads)
    assert b.num_attention_heads * 2 == a.num_attention_heads
    if not kind.startswith("deepseek"):
        assert nm.model.model.layers[0].self_attn.n_kv * 2 == a.num_key_value_heads
    else:
        moe = nm.model.model.layers[-1].mlp
        assert moe.gate.lookup.tolist() == [0, -1, 1, -1, 2, -1, 3, -1]  # experts 0, 2, 4, 6 live here
    if qtype == "Q4_K_M":  # o_proj's 128 columns a rank are half a 256-value block: dequantized
        assert any("dequantized" in n for n in nm.tp_notes), nm.tp_notes
        assert type(nm.model.model.layers[0].self_attn.o_proj) is torch.nn.Linear
    # the pool's logits: a prompt in two chunks, then decode steps of two sequences at their own positions
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, a.vocab_size, (24,), generator=g).tolist() for _ in range(2)]
    out = []
    for kv in (_pool(ref), _pool(nm, ranks)):
        tables = [[5, 9, 2, 30, 7, 11], [1, 3, 20, 4, 8, 6]]
        got = []
        for s in range(2):
            got.append(kv.forward([ids[s][:10]], [0], [tables[s]], every_position=True)[0])
            got.append(kv.forward([ids[s][10:20]], [10], [tables[s]], every_position=True)[0])
        for t in range(20, 24):
            got.append(kv.forward_rows([ids[0][t], ids[1][t]], [t, t], [0, 1], tables, [0, 1]))
        out.append(torch.cat(got).float())
    one, split = out
    assert one.shape == split.shape and one.abs().max() > 0
    assert (split - one).abs().max() <= 1e-4 * one.abs().max(), (split - one).abs().max()
    # the engine's greedy tokens, several requests batched
    from dsq.runtime.engine import encode_prompt

    prompts = [encode_prompt(ref, p) for p in PROMPTS]
    t1, _, _, r1 = _run_engine(ref, prompts, N_TOKENS, ignore_eos=True, kv_tokens=1024, max_seqs=4)
    t2, _, eng, r2 = _run_engine(nm, prompts, N_TOKENS, ignore_eos=True, kv_tokens=1024, max_seqs=4, ranks=ranks)
    assert [r.tokens for r in r2] == [r.tokens for r in r1]
    assert all(len(r.tokens) == len(p) + N_TOKENS for r, p in zip(r2, prompts)) and t2 == t1
    assert eng.counters["failed"] == 0


def test_a_summed_mlp_leaves_the_residual_to_its_layer(monkeypatch):
    """A rank's MLP output is summed over the ranks: the layer's residual is added once, after the
    sum, never by each rank's down projection (MLP's adds_residual, dispatch.linear_add)."""
    from torch import nn

    from dsq.models.base import MLP, DecoderLayer, ModelArgs
    from dsq.runtime import tp

    class Attn(nn.Module):
        def forward(self, x, *rest):
            return torch.sin(x)

    args = ModelArgs(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    layer = DecoderLayer(args, 0)
    layer.self_attn = Attn()
    for n in ("input_layernorm", "post_attention_layernorm"):
        nn.init.normal_(getattr(layer, n).weight)
    monkeypatch.setattr(tp, "all_reduce", lambda y: 2 * y)  # two ranks with equal shares
    layer.mlp.__class__ = tp.summed(MLP)
    assert MLP.adds_residual and not layer.mlp.adds_residual
    x = torch.randn(1, 1, 32)
    with torch.no_grad():
        x2, h = layer.post_attention_layernorm.add_norm(x, torch.sin(layer.input_layernorm(x)))
        assert torch.equal(layer(x, None, None, None, None, None, None), x2 + 2 * MLP.forward(layer.mlp, h))


def test_gguf_columns_split_by_blocks_or_dequantized(tiny_gguf):
    """o_proj (Q8_0, 256 columns): halves of whole 32-value blocks stay blocks, a split at 112
    (three and a half blocks) is dequantized; either way the parts' outputs sum to the whole's."""
    from dsq.runtime import tp
    from dsq.runtime.native_loader import load_gguf
    from dsq.runtime.qmodules import GGUFLinear

    model, _ = load_gguf(tiny_gguf("llama", "Q8_0"), torch.float32)
    m = model.model.layers[0].self_attn.o_proj
    assert isinstance(m, GGUFLinear) and m.qtype == "Q8_0" and m.in_features == 256
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    whole = m(x)
    for cut, kind in ((128, GGUFLinear), (112, torch.nn.Linear)):
        notes = []
        parts = [tp.columns(m, 0, cut, True, torch.float32, notes),
                 tp.columns(m, cut, 256, False, torch.float32, notes)]
        assert all(type(p) is kind for p in parts) and bool(notes) == (kind is torch.nn.Linear)
        y = parts[0](x[:, :cut]) + parts[1](x[:, cut:])
        assert torch.allclose(y, whole, atol=1e-4, rtol=1e-4)


def _complete(base: str, prompt: str) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": N_TOKENS, "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_served_tp2_answers_as_one_process(tiny_gguf):
    pytest.importorskip("uvicorn")
    path = str(tiny_gguf("llama", "Q8_0"))
    got = {}
    for flags in ((), ("--tp", "2")):
        server = _start(path, "--threads", "1", *flags, ctx=CTX)
        try:
            got[flags] = [_complete(server["base"], p) for p in PROMPTS]
        finally:
            proc = server["proc"]
            proc.send_signal(signal.SIGTERM)
            try:
                out, _ = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
        assert proc.returncode == 0, out
        if flags:
            assert "tensor-parallel over 2 ranks (gloo" in out, out
    one, split = got[()], got[("--tp", "2")]
    assert [r["choices"][0]["text"] for r in split] == [r["choices"][0]["text"] for r in one]
    assert all(r["usage"]["completion_tokens"] == N_TOKENS for r in split)


@pytest.mark.parametrize("flags,needles", [
    (["--tp", "0"], ["--tp must be at least 1"]),
    (["--tp", "3"], ["--tp 3 does not split", "4 attention heads, 2 key/value heads", "Pass --tp 1 or 2"]),
    (["--tp", "2", "--draft", "builtin"], ["--draft runs beside one rank"]),
])
def test_bad_tp_is_one_line(flags, needles, runner, tiny_dir):
    from test_cli_errors import one_line_error

    from dsq.cli import app

    one_line_error(runner.invoke(app, ["serve", str(tiny_dir("llama")), "--port", "0", *flags]), *needles)


@pytest.mark.parametrize("gpu_layers,needles", [
    ("all", ["--tp 2 needs 2 GPUs, this machine has 1", "Leave --tp out"]),
    ("1", ["--gpu-layers 1 leaves some on the CPU", "Pass --gpu-layers all"]),
])
def test_tp_on_gpus_checks_them(gpu_layers, needles, runner, tiny_dir, monkeypatch):
    """With a GPU (one, stood in for): more ranks than GPUs, or a layer split, is one line."""
    from test_cli_errors import one_line_error

    from dsq.cli import app

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    r = runner.invoke(app, ["serve", str(tiny_dir("llama")), "--port", "0", "--tp", "2", "--gpu-layers", gpu_layers])
    one_line_error(r, *needles)
