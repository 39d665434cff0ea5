"""The layer-by-layer methods on a mixture-of-experts model (the tiny deepseek_v3: a dense first
layer, then MoE layers of 8 routed experts, 2 a token, and a shared expert): RTN and FP8 per
expert, AWQ and GPTQ per expert on the calibration tokens the model's own router sends each one,
RTN for experts that saw too few; routers and the dense layer kept 16-bit (unless asked); the
output in per-expert HF names that dsq's native runtime loads back close to the float model; the
model card's per-layer record. (Resume after a kill: tests/test_quant_crash.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from dsq.quant import CalibSpec, QuantSpec, quantize
from test_quant_crash import tensors

KIND = "deepseek_v3"
CALIB = CalibSpec(samples=16, seq_len=64)  # 1,024 tokens: 256 per expert on average, 2 of 8 a token
METHODS = ["rtn", "gptq", "awq", "fp8"]
# KLD from the float model on 1,024 held-out tokens, at most (measured: rtn 0.217, gptq 0.185,
# awq 0.156, fp8 0.035; a tiny random model is far more sensitive to its weights than a trained one)
MAX_KLD = {"rtn": 0.3, "gptq": 0.25, "awq": 0.25, "fp8": 0.06}


@pytest.fixture(scope="module")
def made(tiny_dir, tmp_path_factory):
    """method -> its artifact of the tiny deepseek_v3 (experts under 64 tokens fall back)."""
    cache = {}

    def get(method: str, **kw):
        key = (method, tuple(sorted(kw.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp("moe") / method
            spec = QuantSpec(method, calib=CALIB, min_expert_tokens=kw.pop("min_expert_tokens", 64), **kw)
            cache[key] = quantize(tiny_dir(KIND), out, spec, eval_tokens=0)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def kld(made, tiny_dir):
    from dsq.eval.quality import evaluate

    cache = {}

    def get(method: str) -> float:
        if method not in cache:
            cache[method] = evaluate(str(made(method)), str(tiny_dir(KIND)), ctx=256, max_tokens=1024)["kld"]
        return cache[method]

    return get


@pytest.mark.parametrize("method", METHODS)
def test_native_runtime_loads_it_close_to_the_float_model(method, kld):
    print(f"{method}: KLD {kld(method):.4f}")
    assert kld(method) < MAX_KLD[method]


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibration_beats_rounding(method, kld):
    assert kld(method) < kld("rtn")


def _stored(out) -> dict[str, torch.Tensor]:
    return tensors(out)


@pytest.mark.parametrize("method", METHODS)
def test_layout_is_the_hf_checkpoints(method, made):
    """Every expert quantized under its HF name (mlp.experts.N.gate_proj, ...), as vLLM and
    transformers load DeepSeek MoE checkpoints; the routers, V3's selection bias and the dense
    first layer in float; the config naming the dense layer as kept, the way its format's
    loaders skip modules."""
    out = made(method)
    t = _stored(out)
    suffix = "weight" if method == "fp8" else "qweight"
    for e in range(8):
        for p in ("gate_proj", "up_proj", "down_proj"):
            for layer in (1, 2):
                name = f"model.layers.{layer}.mlp.experts.{e}.{p}.{suffix}"
                assert name in t, name
                assert method != "fp8" or t[name].dtype == torch.float8_e4m3fn
    assert t["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in t
    assert "model.layers.1.mlp.shared_experts.down_proj." + suffix in t
    assert t["model.layers.0.mlp.gate_proj.weight"].dtype == torch.float32
    assert t["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.float32
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    kept = {"rtn": qc.get("dynamic"), "gptq": qc.get("dynamic"), "awq": qc.get("modules_to_not_convert"),
            "fp8": qc.get("ignore")}[method]
    assert kept == {"rtn": {r"-:model\.layers\.0\.": {}}, "gptq": {r"-:model\.layers\.0\.": {}},
                    "awq": ["lm_head", "model.layers.0."], "fp8": ["lm_head", r"re:model\.layers\.0\..*"]}[method]


def test_deepseek_fp8_format_names_its_kept_linears(made):
    qc = json.loads((made("fp8", fp8_scheme="block", fp8_format="deepseek") / "config.json").read_text())
    assert qc["quantization_config"]["modules_to_not_convert"] == [
        f"model.layers.0.{n}" for n in ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
                                        "self_attn.kv_b_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                        "mlp.down_proj")]


def _routing_counts(src, ids: torch.Tensor, layer: int) -> list[int]:
    """How many of the calibration tokens the float model's router at `layer` sends each expert."""
    from dsq.runtime.native import NativeModel

    model = NativeModel(src, "hf", n_ctx=256, dtype="fp32").model
    chosen = []
    hook = model.model.layers[layer].mlp.gate.register_forward_hook(lambda m, a, out: chosen.append(out[1]))
    with torch.inference_mode():
        model(ids)
    hook.remove()
    return torch.bincount(torch.cat(chosen).flatten(), minlength=8).tolist()


def test_experts_see_the_tokens_their_router_sends_them(made, tiny_dir):
    """AWQ captures a block's inputs in one forward of the block as it came in: in the first MoE
    layer (after the dense layer, kept float) each expert saw exactly the calibration tokens the
    float model's router sends it. Every layer's counts add up to the tokens times 2 a token;
    the model card and dsq_quant.json list them and the experts below the threshold, which fell
    back to RTN."""
    from dsq.formats.hf import HFModelDir
    from dsq.quant.calib import calibration_for

    src = tiny_dir(KIND)
    out = made("awq")
    record = json.loads((out / "dsq_quant.json").read_text())["experts"]
    ids = calibration_for(HFModelDir(src), CALIB)
    assert record["1"]["tokens"] == _routing_counts(src, ids, 1)
    for layer, r in record.items():
        assert sum(r["tokens"]) == CALIB.samples * CALIB.seq_len * 2
        assert r["rtn"] == [e for e, n in enumerate(r["tokens"]) if n < 64]
    card = (out / "README.md").read_text()
    assert "## Routed experts" in card and "routers (mlp.gate), dense layer 0" in card
    assert f"| 1 | {' '.join(map(str, record['1']['tokens']))} | {', '.join(map(str, record['1']['rtn'])) or 'none'} |" \
        in card


def test_experts_with_too_few_tokens_are_rounded(made):
    """With a threshold no expert reaches, GPTQ's experts are RTN's, bit for bit, and its
    attention is still GPTQ's."""
    gptq, rtn = _stored(made("gptq", min_expert_tokens=10**9)), _stored(made("rtn"))
    experts = [n for n in rtn if ".experts." in n]
    assert experts and all(torch.equal(gptq[n], rtn[n]) for n in experts)
    assert not torch.equal(gptq["model.layers.1.self_attn.o_proj.qweight"], rtn["model.layers.1.self_attn.o_proj.qweight"])
    record = json.loads((made("gptq", min_expert_tokens=10**9) / "dsq_quant.json").read_text())["experts"]
    assert all(r["rtn"] == list(range(8)) for r in record.values())


def test_dense_layers_quantized_when_asked(made):
    out = made("rtn", quantize_dense=True)
    t = _stored(out)
    assert "model.layers.0.mlp.gate_proj.qweight" in t and "model.layers.0.self_attn.q_a_proj.qweight" in t
    assert "dynamic" not in json.loads((out / "config.json").read_text())["quantization_config"]
    assert t["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # routers stay float


def test_skip_patterns_still_apply(tiny_dir, tmp_path):
    out = quantize(tiny_dir(KIND), tmp_path / "q", QuantSpec("rtn", skip=["*.shared_experts.*"]), eval_tokens=0)
    t = _stored(out)
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in t and "model.layers.1.mlp.experts.0.up_proj.qweight" in t
    dynamic = json.loads((out / "config.json").read_text())["quantization_config"]["dynamic"]
    assert r"-:model\.layers\.2\.mlp\.shared_experts\.down_proj$" in dynamic


def test_stages_group_linears_by_input():
    from dsq.quant.blocks import input_stages

    names = ["self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
             "self_attn.o_proj", "mlp.experts.0.gate_proj", "mlp.experts.0.up_proj", "mlp.experts.0.down_proj",
             "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"]
    assert input_stages(names) == [
        [["self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"]], [["self_attn.q_b_proj"], ["self_attn.kv_b_proj"]],
        [["self_attn.o_proj"]], [["mlp.experts.0.gate_proj", "mlp.experts.0.up_proj"],
                                 ["mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"]],
        [["mlp.experts.0.down_proj"], ["mlp.shared_experts.down_proj"]]]
    llama = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj"]
    assert input_stages(llama) == [[llama[:3]], [llama[3:4]], [llama[4:6]], [llama[6:]]]


def test_gptq_hessian_chunks_fit_the_budget(monkeypatch, made, tiny_dir, tmp_path):
    """An MoE stage whose Hessians do not fit HESSIAN_BYTES together is gathered in several
    forwards (here 3 experts' at a time): the same artifact."""
    from dsq.quant import gptq

    monkeypatch.setattr(gptq, "HESSIAN_BYTES", 3 * 4 * 256 * 256)
    chunked = quantize(tiny_dir(KIND), tmp_path / "q", QuantSpec("gptq", calib=CALIB, min_expert_tokens=64),
                       eval_tokens=0)
    whole, chunked = _stored(made("gptq")), _stored(chunked)
    assert whole.keys() == chunked.keys() and all(torch.equal(whole[k], chunked[k]) for k in whole)
