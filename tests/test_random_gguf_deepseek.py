"""Random GGUFs of DeepSeek shapes (dsq.bench.random_gguf --shape deepseek-*): llama.cpp's
deepseek2 layout and Q4_K_M's types (its fallbacks where rows are no multiple of 256), a trained
range of weights, and the small versions loaded by both dsq and llama.cpp, which agree on them."""

from __future__ import annotations

import numpy as np
import pytest

from dsq.bench import random_gguf as rg
from dsq.bench.random_models import DEEPSEEK_SHAPES, deepseek_config

IDS = list(range(5, 60))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("random-deepseek")
    return {k: rg.write_random_gguf(d / f"{k}.gguf", f"tiny-deepseek-{k}", "Q4_K_M", seed=3) for k in ("v2", "v3")}


def test_full_shapes_plan_as_llama_cpp_quantizes_them():
    """V2-Lite: ~10 GB at Q4_K_M, 26 MoE layers of 64 stacked experts, the 1408-wide expert rows of
    ffn_down_exps in Q5_0 / Q8_0 (llama.cpp's fallbacks for Q4_K / Q6_K); V3's slice at its real
    widths with 256 experts, a dense layer first."""
    plan = {n: (s, t) for n, s, t in rg._deepseek_plan(deepseek_config("deepseek-v2-lite"), "Q4_K_M")}
    from dsq.kernels.gguf_ref import row_bytes

    total = sum(int(np.prod(s[:-1])) * (4 * s[-1] if t == "F32" else row_bytes(t, s[-1])) for s, t in plan.values())
    assert 9.0e9 < total < 11.0e9, total
    assert plan["blk.1.ffn_gate_exps.weight"] == ((64, 1408, 2048), "Q4_K")
    assert {plan[f"blk.{i}.ffn_down_exps.weight"][1] for i in range(1, 27)} == {"Q5_0", "Q8_0"}
    assert plan["blk.0.ffn_down.weight"][0] == (2048, 10944) and "blk.0.ffn_gate_exps.weight" not in plan
    assert plan["blk.3.attn_k_b.weight"] == ((16, 512, 128), "Q5_0") and "blk.3.attn_q.weight" in plan
    assert plan["blk.3.ffn_gate_inp.weight"][1] == "F32" and "blk.3.exp_probs_b.bias" not in plan
    v3 = {n: (s, t) for n, s, t in rg._deepseek_plan(deepseek_config("deepseek-v3-slice"), "Q4_K_M")}
    assert v3["blk.1.ffn_up_exps.weight"] == ((256, 2048, 7168), "Q4_K")
    assert v3["blk.1.attn_q_b.weight"][0] == (128 * 192, 1536) and v3["blk.1.exp_probs_b.bias"][1] == "F32"
    assert v3["blk.0.ffn_gate.weight"][0] == (18432, 7168) and v3["blk.1.ffn_gate_shexp.weight"][0] == (2048, 7168)
    assert DEEPSEEK_SHAPES["deepseek-v3-slice"]["first_k_dense_replace"] == 1


def test_small_versions_hold_the_planned_tensors(files):
    from dsq.formats.gguf_file import GGUFFile

    g = GGUFFile(files["v3"])
    types = {t.name: t.type_name for t in g.tensors}
    assert g.arch == "deepseek2" and types["blk.1.ffn_gate_exps.weight"] == "Q4_K"
    assert g.arch_field("expert_count") == 8 and g.arch_field("leading_dense_block_count") == 1
    for name in ("blk.1.ffn_up_exps.weight", "blk.1.attn_k_b.weight", "output.weight"):
        w = g.dequantize(name)
        assert np.isfinite(w).all() and 2e-3 < w.std() and np.abs(w).max() < 0.06, name
    router = g.dequantize("blk.2.ffn_gate_inp.weight")
    assert router.std() > 1e-3  # rows differ: tokens spread over the experts


@pytest.mark.parametrize("kind", ["v2", "v3"])
def test_dsq_and_llama_cpp_load_and_agree(kind, files):
    from dsq.runtime.llama_cpp_backend import LlamaCppModel
    from dsq.runtime.native import NativeModel

    native = NativeModel(files[kind], "gguf", n_ctx=128, dtype="fp32").logits(IDS)
    in_ram = NativeModel(files[kind], "gguf", n_ctx=128, dtype="fp32", experts="cpu").logits(IDS)
    llama = LlamaCppModel(files[kind], logits_all=True, n_ctx=128).logits(IDS)
    assert np.isfinite(llama).all() and native.std() > 0.01
    assert np.corrcoef(native.ravel(), llama.ravel())[0, 1] > 0.99
    assert np.abs(in_ram - native).max() <= 1e-5 * np.abs(native).max()
