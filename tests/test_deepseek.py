"""DeepSeek V2 / V3 (MLA + MoE) on tiny random models: the native engine against transformers'
DeepseekV2/V3 classes (fp32, with and without the latent cache, absorbed and plain attention;
left-padded batches: tests/test_native.py), GGUF both ways against gguf-py's names and llama.cpp's loader, K-quants
with an importance matrix over the experts, every command through the CLI, and bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from dsq.cli import app
from test_cli_errors import one_line_error
from tiny import held_out_text, hf_logits, kld_top1

KINDS = ["deepseek_v2", "deepseek_v3"]
IDS = [5, 17, 99, 250, 31, 7, 400, 12, 3, 77] * 8  # 80 tokens: past the YaRN original context of 64
TOL = 1e-4


@pytest.fixture(scope="module")
def native(tiny_dir, tiny_gguf):
    from dsq.runtime.native import NativeModel

    cache = {}

    def get(kind, fmt="hf"):
        if (kind, fmt) not in cache:
            path, k = (tiny_dir(kind), "hf") if fmt == "hf" else (tiny_gguf(kind, fmt), "gguf")
            cache[(kind, fmt)] = NativeModel(path, k, n_ctx=256, dtype="fp32")
        return cache[(kind, fmt)]

    return get


@pytest.fixture(scope="module")
def reference(tiny_dir):
    cache = {}

    def get(kind, ids=tuple(IDS)):
        if (kind, tuple(ids)) not in cache:
            cache[(kind, tuple(ids))] = hf_logits(tiny_dir(kind), list(ids))
        return cache[(kind, tuple(ids))]

    return get


def _attention_path(model, absorb):
    from dsq.models.deepseek_model import MLAttention

    for m in model.modules():
        if isinstance(m, MLAttention):
            m.absorb = absorb


def _cached_logits(model, ids, prefix: int) -> np.ndarray:
    """A prefill of `prefix` tokens into a fresh latent cache, then one token a step."""
    with torch.inference_mode():
        cache = model.make_cache(1, 128, torch.float32)
        outs = [model(torch.tensor([ids[:prefix]]), torch.arange(prefix), cache, kv_len=prefix)[0]]
        for i in range(prefix, len(ids)):
            outs.append(model(torch.tensor([[ids[i]]]), torch.tensor([i]), cache, kv_len=i + 1)[0])
    return torch.cat(outs).numpy()


# -- the native model against transformers -------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(kind, native, reference):
    m, ref = native(kind), reference(kind)
    assert np.abs(m.logits(IDS) - ref).max() < TOL
    try:
        for absorb in (None, True, False):  # by cost (absorbed decode, plain prefill), then each way throughout
            _attention_path(m.model, absorb)
            assert np.abs(_cached_logits(m.model, IDS, 37) - ref).max() < TOL, absorb
    finally:
        _attention_path(m.model, None)


@pytest.mark.parametrize("kind", KINDS)
def test_absorbed_decode_equals_plain(kind, native):
    """The decode step through the latent cache with W_UK in the query and W_UV on the output
    gives what expanding every cached latent into keys and values gives."""
    m = native(kind)
    try:
        _attention_path(m.model, True)
        absorbed = _cached_logits(m.model, IDS[:60], 50)
        _attention_path(m.model, False)
        plain = _cached_logits(m.model, IDS[:60], 50)
    finally:
        _attention_path(m.model, None)
    assert np.abs(absorbed - plain).max() < TOL


def test_v2_group_limited_greedy_matches_transformers(tiny_dir, tmp_path):
    """DeepSeek-V2's routing over expert groups (best topk_group of n_group by their best score)."""
    from dsq.runtime.native import NativeModel

    d = tmp_path / "v2-grouped"
    shutil.copytree(tiny_dir("deepseek_v2"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5)
    (d / "config.json").write_text(json.dumps(cfg))
    m = NativeModel(d, "hf", n_ctx=128, dtype="fp32")
    assert np.abs(m.logits(IDS) - hf_logits(d, IDS)).max() < TOL


def test_latent_cache_layout(native):
    """One row of kv_lora_rank + qk_rope_head_dim values a token and layer (no separate values),
    per-layer dtypes as a split model keeps them."""
    from dsq.models.deepseek_model import MLACache

    model = native("deepseek_v3").model
    a = model.args
    cache = model.make_cache(2, 16, torch.float32)
    assert type(cache) is MLACache and len(cache.k) == a.num_hidden_layers
    assert cache.k[0].shape == (2, 1, 16, a.kv_lora_rank + a.qk_rope_head_dim) and cache.v[0].shape == (2, 1, 16, 0)
    mixed = MLACache(a, 1, 8, [torch.float32, torch.bfloat16, torch.bfloat16], model.layer_devices())
    assert [k.dtype for k in mixed.k] == [torch.float32, torch.bfloat16, torch.bfloat16]
    assert cache.rope_on("full", torch.device("cpu"))[0].shape == (16, a.qk_rope_head_dim)


def test_moe_model_decodes_eagerly(native):
    """Routing picks experts on the host: no captured or compiled decode step."""
    m = native("deepseek_v3")
    assert not m.model.graph_safe and m._graph is None and m._compiled is None
    assert native("deepseek_v2").model.model.layers[0].mlp.__class__.__name__ == "MLP"  # first_k_dense_replace


# -- GGUF ------------------------------------------------------------------------------------------
def _gguf_plan(tiny_dir, kind):
    from dsq.formats.hf import HFModelDir
    from dsq.models.registry import arch_for_model_type

    hf = HFModelDir(tiny_dir(kind))
    arch = arch_for_model_type(hf.model_type)
    return arch, hf, arch.to_gguf_tensors(hf.tensor_names(), hf.config, "tiny")


@pytest.mark.parametrize("kind", KINDS)
def test_tensor_names_agree_with_gguf_py(kind, tiny_dir):
    """Each GGUF tensor is named as gguf-py names what llama.cpp's converter makes from the same
    HF tensors (experts merged, kv_b_proj split into k_b_proj / v_b_proj), and is one llama.cpp's
    deepseek2 loads."""
    import gguf

    arch, hf, plan = _gguf_plan(tiny_dir, kind)
    ref = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, hf.config["num_hidden_layers"])
    known = {gguf.TENSOR_NAMES[t].split(".")[-1] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.DEEPSEEK2]}
    for made in plan:
        src = made.sources[0]
        if len(made.sources) > 1:  # stacked experts: the converter's merged name
            src = src.replace(".experts.0.", ".experts.")
        elif "kv_b_proj" in src:
            src = src.replace("kv_b_proj", "k_b_proj" if "attn_k_b" in made.name else "v_b_proj")
        theirs = ref.get_name(src.replace("_bias", ".bias"), try_suffixes=(".weight", ".bias"))
        assert made.name == theirs, src
        assert made.name.split(".")[-2] in known or made.name.split(".")[0] in known, made.name
    names = {m.name for m in plan}
    assert "blk.1.ffn_gate_exps.weight" in names and "blk.1.attn_k_b.weight" in names
    assert not any("attn_kv_b" in n or ".experts." in n for n in names)


# (max KLD, min top-1) of llama.cpp against transformers. Q8_0 moves routing: llama.cpp rounds
# activations to int8 per 32 values, and transformers' own model with its Linears' inputs rounded
# so moves by KLD 1.2e-3 (V2) and 4.3e-2 (V3, whose sigmoid scores sit close) as tokens switch
# experts; llama.cpp on the dequantized Q8_0 weights measured 6.7e-4 and 7.3e-2.
LLAMA_CPP_AGREEMENT = {"F32": {k: (1e-6, 1.0) for k in KINDS}, "F16": {k: (1e-4, 0.97) for k in KINDS},
                       "Q8_0": {"deepseek_v2": (5e-3, 0.85), "deepseek_v3": (0.15, 0.7)}}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0"])
def test_llama_cpp_logits_match_transformers(kind, qtype, tiny_gguf, reference):
    from dsq.runtime.llama_cpp_backend import LlamaCppModel

    m = LlamaCppModel(tiny_gguf(kind, qtype), logits_all=True, n_ctx=256, f32_kv=True)
    ids = m.tokenize(held_out_text(2000), add_bos=m.add_bos, special=False)[:96]
    ref = reference(kind, ids)
    kld, top1, maxdiff = kld_top1(ref, m.logits(ids))
    print(f"{kind} {qtype}: KLD {kld:.2e} top-1 {top1:.3f} max|dlogit| {maxdiff:.2e}")
    max_kld, min_top1 = LLAMA_CPP_AGREEMENT[qtype][kind]
    assert kld < max_kld and top1 >= min_top1
    if qtype == "F32":
        assert maxdiff < 1e-3


def test_metadata_written(tiny_gguf):
    from dsq.formats.gguf_file import GGUFFile

    g3, g2 = GGUFFile(tiny_gguf("deepseek_v3", "F16")), GGUFFile(tiny_gguf("deepseek_v2", "F32"))
    a3, a2 = g3.arch_field, g2.arch_field
    assert g3.arch == g2.arch == "deepseek2"
    assert (a3("expert_gating_func"), a2("expert_gating_func")) == (2, 1)  # sigmoid, softmax
    assert (a3("attention.head_count_kv"), a3("attention.key_length"), a3("attention.value_length")) == (1, 288, 256)
    assert (a3("attention.key_length_mla"), a3("attention.value_length_mla")) == (96, 64)
    assert a3("rope.dimension_count") == 32
    assert (a3("attention.q_lora_rank"), a2("attention.q_lora_rank"), a3("attention.kv_lora_rank")) == (256, 0, 256)
    assert (a3("expert_count"), a3("expert_used_count"), a3("expert_shared_count")) == (8, 2, 1)
    assert a2("expert_shared_count") == 2
    assert (a3("leading_dense_block_count"), a3("expert_group_count"), a3("expert_group_used_count")) == (1, 4, 2)
    assert a3("expert_weights_norm") is True and a2("expert_weights_norm") is None
    assert a3("expert_weights_scale") == pytest.approx(2.5) and a3("expert_feed_forward_length") == 256
    assert a3("rope.scaling.type") == "yarn" and a3("rope.scaling.yarn_log_multiplier") == pytest.approx(0.1)
    assert a2("rope.scaling.yarn_log_multiplier") == pytest.approx(0.0707)
    types = {t.name: (t.type_name, t.shape) for t in g3.tensors}
    assert types["blk.1.ffn_gate_exps.weight"] == ("F16", (8, 256, 256))
    assert types["blk.1.attn_k_b.weight"] == ("F16", (4, 256, 64)) and types["blk.1.attn_v_b.weight"][1] == (4, 64, 256)
    assert types["blk.1.ffn_gate_inp.weight"][0] == "F32" and types["blk.1.exp_probs_b.bias"][0] == "F32"
    assert "blk.0.ffn_gate.weight" in types and "blk.0.ffn_gate_exps.weight" not in types


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_hf_gguf_round_trip(kind, tiny_gguf, tmp_path, reference):
    """GGUF -> HF -> GGUF gives the same keys and tensor bytes; the HF directory in between
    computes what the source does."""
    from dsq.convert.gguf_to_hf import gguf_to_hf
    from dsq.convert.hf_to_gguf import hf_to_gguf
    from dsq.formats.gguf_file import GGUFFile

    a = GGUFFile(tiny_gguf(kind, "F32"))
    hf = gguf_to_hf(a.path, tmp_path / "hf", "float32", progress=lambda *_: None)
    b = GGUFFile(hf_to_gguf(hf, tmp_path / "again.gguf", "F32", name=a.field("general.name")))
    for k in sorted((set(a._fields) | set(b._fields)) - {"general.source.url"}):
        assert a.field(k) == b.field(k), k
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for t in a.tensors:
        assert np.array_equal(a.raw(t.name)[0], b.raw(t.name)[0]), t.name
    assert json.loads((hf / "config.json").read_text())["model_type"] == kind
    assert np.abs(hf_logits(hf, IDS) - reference(kind)).max() < TOL


@pytest.mark.parametrize("kind", KINDS)
def test_native_runs_gguf(kind, native, reference):
    assert np.abs(native(kind, "F32").logits(IDS) - reference(kind)).max() < TOL


@pytest.mark.parametrize("fmt", ["hf", "F32", "Q4_K_M"])
def test_a_16_bit_model_keeps_its_routers_in_float32(fmt, tiny_dir, tiny_gguf):
    """In bf16 every router's weight stays float32, equal to the float32 model's (the file's: GGUF
    keeps routers F32, as llama.cpp runs them), while the other float weights are bf16; a router
    call then copies only x to float32, not its weight as well."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from dsq.models.deepseek_model import Router
    from dsq.runtime.native import NativeModel

    path, k = (tiny_dir("deepseek_v3"), "hf") if fmt == "hf" else (tiny_gguf("deepseek_v3", fmt), "gguf")
    m16, m32 = (NativeModel(path, k, n_ctx=64, dtype=d).model for d in ("bf16", "fp32"))
    r16, r32 = ([m for m in m.modules() if isinstance(m, Router)] for m in (m16, m32))
    assert r16 and len(r16) == len(r32)
    for a, b in zip(r16, r32):
        assert a.weight.dtype == torch.float32 and torch.equal(a.weight, b.weight)
    assert m16.model.layers[0].input_layernorm.weight.dtype == torch.bfloat16

    class Copies(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Copies.n += func.__name__.split(".")[0] in ("to", "_to_copy") and out is not args[0]  # a new tensor
            return out

    x = torch.randn(3, m16.args.hidden_size).bfloat16()
    with torch.inference_mode(), Copies():
        w, ids = r16[0](x)
    assert Copies.n == 1 and w.dtype == torch.float32 and ids.shape == (3, m16.args.num_experts_per_tok)


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_gguf_equals_transformers_on_dequantized_weights(kind, native, tiny_gguf, tmp_path, monkeypatch):
    """Q4_K_M: each expert a GGUFLinear over its slice of the stacked blocks (no copy); logits
    those of the dequantized model. An expert routed one token takes the M = 1 row dots, which on
    the avx2 build round x to int8: this compares against the float model, so x stays in float."""
    from dsq.convert.gguf_to_hf import gguf_to_hf
    from dsq.kernels import cpu
    from dsq.runtime.qmodules import GGUFLinear

    if cpu.library()[1] == "avx2":
        monkeypatch.setenv("DSQ_NO_VNNI", "1")

    m = native(kind, "Q4_K_M")
    experts = m.model.model.layers[1].mlp.experts
    assert all(type(e.gate_proj) is GGUFLinear for e in experts)
    base = experts[0].gate_proj.raw.untyped_storage().data_ptr()
    assert all(e.gate_proj.raw.untyped_storage().data_ptr() == base for e in experts)
    deq = gguf_to_hf(tiny_gguf(kind, "Q4_K_M"), tmp_path / "deq", dtype="float32", progress=lambda *a: None)
    assert np.abs(m.logits(IDS) - hf_logits(deq, IDS)).max() < TOL


def test_imatrix_covers_experts_and_mla(tiny_dir, tiny_gguf, tmp_path):
    """Every quantized matrix gets an entry of llama.cpp's size (stacked: a row per expert or head)
    and the quantizer uses them: the experts quantize differently with it."""
    from dsq.formats.gguf_file import GGUFFile
    from dsq.quant.gguf import quantize_gguf
    from dsq.quant.imatrix import compute_imatrix
    from dsq.quant.spec import CalibSpec

    imat = compute_imatrix(tiny_dir("deepseek_v3"), CalibSpec(samples=4, seq_len=64), "cpu")
    src = GGUFFile(tiny_gguf("deepseek_v3", "F32"))
    shapes = {t.name: t.shape for t in src.tensors}
    quantized = {n for n, s in shapes.items() if len(s) >= 2 and n not in ("token_embd.weight", "output.weight")
                 and "ffn_gate_inp" not in n}
    assert set(imat) == quantized
    for n, v in imat.items():
        s = shapes[n]
        assert v.shape == (s[-1] * (s[0] if len(s) == 3 else 1),) and np.isfinite(v).all() and (v > 0).all(), n
    with_imat = GGUFFile(quantize_gguf(src.path, tmp_path / "imat.gguf", "Q4_K_M", imatrix=imat))
    plain = GGUFFile(tiny_gguf("deepseek_v3", "Q4_K_M"))
    for n in ("blk.1.ffn_gate_exps.weight", "blk.2.ffn_up_exps.weight"):
        assert not np.array_equal(with_imat.raw(n)[0], plain.raw(n)[0]), n


# -- placement ---------------------------------------------------------------------------------------
def test_offload_counts_experts(tiny_gguf, tiny_dir):
    """The plan knows each layer's routed-expert bytes, reads only a token's share of them (2 of
    8), and sizes the latent cache (one row of kv_lora_rank + rope dims, 2 bytes a value) rather
    than per-head keys and values."""
    from dataclasses import replace

    from dsq.runtime.model_shape import load_shape
    from dsq.runtime.placement import plan_placement

    for model in (tiny_gguf("deepseek_v3", "F16"), tiny_dir("deepseek_v3")):
        shape = load_shape(model)
        plan = plan_placement(shape, 0, ctx=256, cpu_bw=10e9, gpu_bw=100e9)
        experts = [layer.expert_bytes for layer in plan.layers]
        assert experts[0] == 0 and experts[1] == experts[2] > 0 and experts == shape.expert_bytes
        dense = plan_placement(replace(shape, expert_bytes=None), 0, ctx=256, cpu_bw=10e9, gpu_bw=100e9)
        assert dense.bytes_per_token_cpu - plan.bytes_per_token_cpu == sum(experts) * 6 // 8
        assert plan.layers[0].kv_bytes == 256 * 288 * 2
        assert any("a token reads 2 of 8" in n for n in plan.notes)


# -- every command through the CLI --------------------------------------------------------------
def test_cli_run_both_backends_and_chat(runner, tiny_dir, tiny_gguf):
    toks = []
    for model, backend in [(tiny_dir("deepseek_v3"), "native"), (tiny_dir("deepseek_v3"), "llama.cpp"),
                           (tiny_gguf("deepseek_v3", "F32"), "native")]:
        r = runner.invoke(app, ["run", str(model), "-b", backend, "-p", "Classes", "-n", "6", "-t", "0", "--json",
                                "--ignore-eos"])
        assert r.exit_code == 0, r.output
        toks.append(json.loads(r.stdout)["token_ids"])
    assert toks[0] == toks[1] == toks[2] and len(toks[0]) == 6
    for backend in ("native", "llama.cpp"):
        r = runner.invoke(app, ["chat", str(tiny_dir("deepseek_v3")), "-b", backend, "-n", "4"],
                          input="hi\n/reset\nhow are you\n")
        assert r.exit_code == 0, r.output
        assert "history cleared" in r.output


def test_cli_quantize_bench_offload_convert(runner, tiny_dir, tmp_path):
    d = str(tiny_dir("deepseek_v3"))
    q = tmp_path / "q.gguf"
    r = runner.invoke(app, ["quantize", d, "--method", "gguf", "--type", "Q4_K_M", "--imatrix", "--calib-samples", "4",
                            "--calib-seq-len", "64", "--out", str(q)])
    assert r.exit_code == 0, r.output
    jp = tmp_path / "b.json"
    r = runner.invoke(app, ["bench", str(q), "-b", "native,llama.cpp", "--prompt-tokens", "32", "--max-tokens", "4",
                            "--repeat", "1", "--out", str(jp)])
    assert r.exit_code == 0, r.output
    assert [x["backend"] for x in json.loads(jp.read_text())["runs"]] == ["native", "llama.cpp"]
    for model in (str(q), d):
        r = runner.invoke(app, ["offload", model, "--vram", "1G", "--ctx", "256", "-b", "native"])
        assert r.exit_code == 0, r.output
        assert "a token reads 2 of 8" in r.output
    r = runner.invoke(app, ["convert", str(q), str(tmp_path / "hf")])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["convert", str(tmp_path / "hf"), str(tmp_path / "f16.gguf"), "--outtype", "f16"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["run", str(tmp_path / "f16.gguf"), "-p", "Classes", "-n", "2", "-t", "0"])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq", "fp8"])
def test_cli_layer_methods_quantize_moe(method, runner, tiny_dir, tmp_path):
    """Per-expert quantization (tests/test_moe_quant.py) through the CLI; the artifact runs natively."""
    out = tmp_path / "o"
    r = runner.invoke(app, ["quantize", str(tiny_dir("deepseek_v3")), "--method", method, "--calib-samples", "4",
                            "--calib-seq-len", "64", "--eval-tokens", "64", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "routers (mlp.gate), dense layer 0" in (out / "README.md").read_text()
    r = runner.invoke(app, ["run", str(out), "-p", "Classes", "-n", "4", "-t", "0", "--ignore-eos", "--json"])
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["token_ids"]) == 4


# -- bad input -------------------------------------------------------------------------------------
def _edited(tiny_dir, tmp_path, edit) -> str:
    d = tmp_path / "edited"
    shutil.copytree(tiny_dir("deepseek_v3"), d)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.mark.parametrize("field", ["kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                                   "q_lora_rank", "n_routed_experts"])
@pytest.mark.parametrize("backend", ["native", "llama.cpp"])
def test_config_missing_an_mla_or_moe_field(field, backend, runner, tiny_dir, tmp_path):
    d = _edited(tiny_dir, tmp_path, lambda cfg: cfg.pop(field))
    one_line_error(runner.invoke(app, ["run", d, "-b", backend, "-p", "x"]), "missing", field)


def test_expert_count_not_matching_the_tensors_hf(runner, tiny_dir, tmp_path):
    d = _edited(tiny_dir, tmp_path, lambda cfg: cfg.update(n_routed_experts=16))
    for backend in ("native", "llama.cpp"):
        one_line_error(runner.invoke(app, ["run", d, "-b", backend, "-p", "x"]), "8 experts", "says 16")


def test_expert_count_not_matching_the_tensors_gguf(runner, tiny_gguf, tmp_path):
    """A GGUF whose expert_count says 16 over stacked tensors of 8 experts."""
    import gguf

    from dsq.formats.gguf_file import GGUFFile

    src = GGUFFile(tiny_gguf("deepseek_v3", "F32"))
    out = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(out), "deepseek2")
    for key, field in gguf.GGUFReader(src.path).fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        val = 16 if key == "deepseek2.expert_count" else field.contents()
        sub = {"sub_type": field.types[-1]} if field.types[0] == gguf.GGUFValueType.ARRAY else {}
        w.add_key_value(key, val, field.types[0], **sub)
    for t in src.tensors:
        w.add_tensor(t.name, np.ascontiguousarray(src.dequantize(t.name)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for backend in ("native", "llama.cpp"):
        one_line_error(runner.invoke(app, ["run", str(out), "-b", backend, "-p", "x"]), "holds 8 experts", "says 16")


# -- CUDA (skipped without a GPU) --------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("gpu_layers", ["all", "1", "0"])
def test_cuda_placements(gpu_layers, tiny_dir, tiny_gguf, native):
    """All layers on the GPU, split, and CPU layers with a GPU present (prompts streamed to it):
    float32 weights compute what the CPU model does; Q4_K_M in the GPU's bf16 through the Triton
    kernels stays close (routing may move a few tokens); both decode."""
    from dsq.runtime.generate import GenStats
    from dsq.runtime.native import NativeModel
    from dsq.runtime.sampling import SamplingParams

    m = NativeModel(tiny_dir("deepseek_v3"), "hf", n_ctx=256, gpu_layers=gpu_layers, dtype="fp32")
    assert np.abs(m.logits(IDS) - native("deepseek_v3").logits(IDS)).max() < 1e-3
    q = NativeModel(tiny_gguf("deepseek_v3", "Q4_K_M"), "gguf", n_ctx=256, gpu_layers=gpu_layers)
    kld, top1, _ = kld_top1(native("deepseek_v3", "Q4_K_M").logits(IDS), q.logits(IDS))
    assert kld < 0.25 and top1 >= 0.6
    for model in (m, q):
        st = GenStats()
        list(model.stream(IDS[:40], SamplingParams(temperature=0), 8, st, ignore_eos=True))
        assert len(st.token_ids) == 8
        assert [len(x) for x in model.generate_batch([IDS[:20], IDS[5:9]], SamplingParams(temperature=0), 4,
                                                     ignore_eos=True)] == [4, 4]
