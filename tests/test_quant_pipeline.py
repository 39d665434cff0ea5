"""The layer-by-layer quantization pipeline: methods against RTN on a real block, round trips
through the written formats, calibration input, bad input, eval, recipes (resume, kills and a full
disk: test_quant_crash.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dsq.cli import app
from dsq.quant import CalibSpec, GGUFSpec, QuantSpec, evals_of, quantize


def listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def one_line_error(r, needle: str) -> None:
    assert r.exit_code == 1, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.stderr


# -- the methods on a block of the built-in model ---------------------------------------------
@pytest.fixture(scope="module")
def builtin_block(builtin_hf):
    """Block 2 of the built-in model (fp32), the activations entering it, its block context."""
    from dsq.formats.hf import HFModelDir
    from dsq.models.registry import build_args
    from dsq.quant.blocks import block_tensors, materialize, run_block
    from dsq.quant.calib import calibration_for

    hf = HFModelDir(builtin_hf)
    mod, args = build_args(hf.config)
    ids = calibration_for(hf, CalibSpec(samples=16, seq_len=256))
    with torch.device("meta"):
        model = mod.Model(args)
    hidden = hf.get_tensor("model.embed_tokens.weight").float()[ids] * float(
        torch.tensor(args.embed_scale, dtype=torch.bfloat16))
    for i in range(3):
        materialize(model.model.layers[i], block_tensors(hf, i), "cpu", torch.float32)
        ctx = model.block_context(i, ids.shape[1], "cpu")
        if i < 2:
            hidden = run_block(model.model.layers[i], hidden, ctx, "cpu", torch.float32, 8)
    return model, hidden, ctx


def _linear_io(layer, hidden, ctx) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every Linear's (input, output) when the block runs on `hidden`."""
    from dsq.quant.blocks import linears, run_block

    seen, handles = {}, []
    for name, m in linears(layer).items():
        def hook(mod, args, out, name=name):
            seen.setdefault(name, ([], []))
            seen[name][0].append(args[0].detach().reshape(-1, args[0].shape[-1]))
            seen[name][1].append(out.detach().reshape(-1, out.shape[-1]))
        handles.append(m.register_forward_hook(hook))
    run_block(layer, hidden, ctx, "cpu", torch.float32, 8)
    for h in handles:
        h.remove()
    return {n: (torch.cat(a), torch.cat(b)) for n, (a, b) in seen.items()}


def test_gptq_and_awq_beat_rtn_on_every_linear(builtin_block):
    """Output error of every Linear of a real block, in place (errors of earlier layers included)."""
    import copy

    from dsq.quant.driver import quantize_block

    model, hidden, ctx = builtin_block
    ref = _linear_io(model.model.layers[2], hidden, ctx)
    errs = {}
    for method in ("rtn", "gptq", "awq"):
        layer = copy.deepcopy(model.model.layers[2])
        quantize_block(layer, 2, QuantSpec(method, sym=False).validate(), hidden, ctx, "cpu", torch.float32, 8)
        got = _linear_io(layer, hidden, ctx)
        # AWQ folds the next group's scale into some Linears' output rows (they compute y / s):
        # compare those in the original function's units
        unscale = getattr(layer, "awq_output_scales", {})
        errs[method] = {n: float((got[n][1] * unscale.get(n, 1.0) - ref[n][1]).pow(2).mean()) for n in ref}
    for n in errs["rtn"]:
        print(f"{n:20} rtn {errs['rtn'][n]:.3e}  gptq {errs['gptq'][n]:.3e}  awq {errs['awq'][n]:.3e}")
        assert errs["gptq"][n] < errs["rtn"][n], n
        assert errs["awq"][n] < errs["rtn"][n], n


@pytest.mark.parametrize("spec", [QuantSpec("gptq"), QuantSpec("gptq", act_order=True, sym=False, bits=8),
                                  QuantSpec("awq"), QuantSpec("rtn", group_size=-1),
                                  QuantSpec("fp8", fp8_scheme="block", fp8_format="deepseek")],
                         ids=["gptq", "gptq-act-order-asym-8bit", "awq", "rtn-per-channel", "fp8-deepseek"])
def test_round_trip_through_the_format(spec, builtin_block, tmp_path):
    """quantize -> write -> load (the native runtime's modules) -> dequantize == the method's own fake-quant."""
    import copy

    from safetensors.torch import load_file, save_file

    from dsq.quant.blocks import linears
    from dsq.quant.driver import quantize_block
    from dsq.runtime.native_loader import _swap_quantized

    model, hidden, ctx = builtin_block
    spec.validate()
    layer = copy.deepcopy(model.model.layers[2])
    out = quantize_block(layer, 2, spec, hidden, ctx, "cpu", torch.float32, 8)
    save_file({k: v.contiguous() for k, v in out.items()}, str(tmp_path / "b.safetensors"))
    stored = load_file(str(tmp_path / "b.safetensors"))
    fake = {n: m.weight.data.clone() for n, m in linears(layer).items()}
    holder = copy.deepcopy(model.model.layers[2]).to("meta")
    _swap_quantized(holder, spec.quantization_config(), stored, torch.float32)
    holder.load_state_dict({k: v for k, v in stored.items()}, strict=False, assign=True)
    for n, m in holder.named_modules():
        if n in fake:
            if spec.method == "fp8":
                from dsq.quant.fp8 import fp8_quantize
                from dsq.formats.fp8_checkpoint import fp8_dequantize

                want = fp8_dequantize(*fp8_quantize(model.model.layers[2].get_submodule(n).weight.data, "block"))
            else:
                want = fake[n]
            torch.testing.assert_close(m.weight_float(), want, rtol=0, atol=1e-6)


# -- the driver end to end on tiny models ------------------------------------------------------
@pytest.mark.parametrize("method", ["rtn", "gptq", "awq", "fp8"])
def test_native_runtime_loads_what_it_writes(method, tiny_dir, tmp_path):
    import numpy as np

    from dsq.runtime.native import NativeModel
    from tiny import hf_logits

    src = tiny_dir("qwen2")
    out = tmp_path / method
    quantize(src, out, QuantSpec(method, calib=CalibSpec(samples=8, seq_len=64)))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] in (method, "gptq", "compressed-tensors")
    assert (out / "tokenizer.json").is_file() and "KLD" in (out / "README.md").read_text()
    assert evals_of(out)["tokens"] > 0  # evaluated on held-out text by default, before it appeared
    assert listing(tmp_path) == [method]
    m = NativeModel(out, "hf", n_ctx=128, dtype="fp32")
    kinds = {type(x).__name__ for x in m.model.modules()}
    assert kinds & {"IntLinear", "FP8Linear", "PackedLinear"}  # the kernel-ready forms of each format
    ids = list(range(3, 40))
    got, ref = m.logits(ids), hf_logits(src, ids)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < (0.2 if method == "fp8" else 0.8)


def test_rtn_artifact_equals_independent_rtn(tiny_dir, tmp_path):
    from dsq.formats.hf import HFModelDir
    from dsq.quant.rtn import rtn
    from dsq.runtime.native import NativeModel

    src = tiny_dir("llama")
    quantize(src, tmp_path / "q", QuantSpec("rtn", bits=8, group_size=64), eval_tokens=0)
    m = NativeModel(tmp_path / "q", "hf", n_ctx=64, dtype="fp32", fuse=False)
    w = HFModelDir(src).get_tensor("model.layers.1.mlp.down_proj.weight")
    want = rtn(w, 8, 64, sym=True).dequantize()
    torch.testing.assert_close(m.model.model.layers[1].mlp.down_proj.weight_float(), want, rtol=0, atol=0)


def test_calibration_files(tmp_path):
    from dsq.errors import DsqError
    from dsq.quant.calib import calibration_ids

    tok = lambda s: [ord(c) for c in s]  # noqa: E731
    (tmp_path / "a.txt").write_text("hello world " * 100)
    assert calibration_ids(str(tmp_path / "a.txt"), tok, 4, 64).shape == (4, 64)
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "x" * 300}) + "\n" +
                                      json.dumps({"messages": [{"role": "user", "content": "y" * 300}]}) + "\n")
    ids = calibration_ids(str(tmp_path / "b.jsonl"), tok, 8, 64, render=lambda m: m[0]["content"])
    assert ids.shape == (8, 64)  # 600 tokens: 9 windows available, 8 asked for
    assert set(ids.flatten().tolist()) == {ord("x"), ord("y")}
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(DsqError, match="empty"):
        calibration_ids(str(tmp_path / "empty.txt"), tok, 4, 64)


@pytest.mark.parametrize("args,needle", [
    (["--method", "gptq", "--bits", "3"], "--bits 3"),
    (["--method", "rtn", "--group-size", "100"], "--group-size 100"),
    (["--method", "awq", "--bits", "8"], "4-bit"),
    (["--method", "fp8", "--fp8-scheme", "tile"], "FP8 scheme"),
])
def test_bad_settings_refused_before_work(args, needle, runner, tiny_dir, tmp_path):
    out = tmp_path / "o"
    one_line_error(runner.invoke(app, ["quantize", str(tiny_dir("qwen2")), "--out", str(out), *args]), needle)
    assert list(tmp_path.iterdir()) == []


def test_layer_the_format_cannot_hold(runner, tiny_dir, tmp_path):
    """An MLP 320 wide: down_proj's 320 inputs do not split into groups of 128."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "odd"
    shutil.copytree(tiny_dir("qwen2"), d)
    out = tmp_path / "o"
    cfg = json.loads((d / "config.json").read_text())
    sd = load_file(str(d / "model.safetensors"))
    for k in list(sd):
        if "gate_proj" in k or "up_proj" in k:
            sd[k] = sd[k][:320].contiguous()
        if "down_proj" in k:
            sd[k] = sd[k][:, :320].contiguous()
    save_file(sd, str(d / "model.safetensors"))
    cfg["intermediate_size"] = 320
    (d / "config.json").write_text(json.dumps(cfg))
    one_line_error(runner.invoke(app, ["quantize", str(d), "--method", "gptq", "--out", str(out)]), "down_proj")
    assert not out.exists() and not Path(str(out) + ".partial").exists()


def test_empty_calibration_file_refused(runner, tiny_dir, tmp_path):
    (tmp_path / "c.txt").write_text("")
    one_line_error(runner.invoke(app, ["quantize", str(tiny_dir("qwen2")), "--method", "gptq", "--calib",
                                       str(tmp_path / "c.txt"), "--out", str(tmp_path / "o")]), "empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt"]


# -- CLI: quantize + eval, imatrix GGUF, recipes -------------------------------------------------
def test_quantize_cli_then_eval(runner, tiny_dir, tmp_path):
    out = tmp_path / "awq"
    r = runner.invoke(app, ["quantize", str(tiny_dir("llama")), "--method", "awq", "--calib-samples", "8",
                            "--calib-seq-len", "64", "--eval-tokens", "256", "--out", str(out)])
    assert r.exit_code == 0, r.output
    card = (out / "README.md").read_text()
    assert "group_size | 128" in card and "KLD" in card
    r = runner.invoke(app, ["eval", str(out), "--window", "128", "--tokens", "512", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["reference"] == str(tiny_dir("llama").resolve())  # found from dsq_quant.json
    assert res["perplexity"] > 1 and 0 <= res["kld"] and 0 <= res["top1_agreement"] <= 1
    r = runner.invoke(app, ["eval", str(tiny_dir("llama")), "--ref", str(tiny_dir("llama")), "--window", "128",
                            "--tokens", "256", "--json"])
    same = json.loads(r.stdout)
    assert same["kld"] < 1e-9 and same["top1_agreement"] == 1.0


def test_gguf_with_imatrix_loads_in_llama_cpp(runner, tiny_dir, tmp_path):
    from dsq.quant.imatrix import compute_imatrix
    from dsq.runtime.llama_cpp_backend import LlamaCppModel

    imat = compute_imatrix(tiny_dir("llama"), CalibSpec(samples=4, seq_len=64))
    assert set(imat) >= {"blk.0.attn_q.weight", "blk.1.ffn_down.weight"}
    assert imat["blk.1.ffn_down.weight"].shape == (512,) and (imat["blk.1.ffn_down.weight"] > 0).all()
    out = tmp_path / "m.gguf"
    r = runner.invoke(app, ["quantize", str(tiny_dir("llama")), "--type", "Q4_K_M", "--imatrix", "--calib-samples",
                            "4", "--calib-seq-len", "64", "--out", str(out)])
    assert r.exit_code == 0, r.output
    plain = tmp_path / "p.gguf"
    args = ["quantize", str(tiny_dir("llama")), "--type", "Q4_K_M", "--out", str(plain)]
    assert runner.invoke(app, args).exit_code == 0
    assert out.read_bytes() != plain.read_bytes()  # the importance matrix changed the rounding
    m = LlamaCppModel(out, logits_all=True, n_ctx=64)
    assert m.logits(list(range(1, 20))).shape[0] == 19
    # the Python call the CLI makes: the same bytes, its progress as one task after another
    steps = []
    api = quantize(tiny_dir("llama"), tmp_path / "api.gguf", GGUFSpec("q4_k_m", imatrix=True,
                   calib=CalibSpec(samples=4, seq_len=64)), progress=steps.append)
    assert api.read_bytes() == out.read_bytes()
    tasks = [s.task for s in steps if s.done == 0 and s.total is None]
    assert tasks == ["importance matrix: blocks", f"{tiny_dir('llama').name} -> GGUF", "quantizing to Q4_K_M (llama.cpp)"]
    assert steps[-1].unit == "bytes" and steps[-1].done == steps[-1].total


def test_recipes_dsq_commands_use_real_options():
    """Each recipe's `dsq` serving line (quantize, then serve) names only commands and options the
    CLI has, and serves what it quantized."""
    import shlex

    import typer

    from dsq.cli import app
    from dsq.quant.recipes import list_recipes, load_recipe

    group = typer.main.get_command(app)
    for n in list_recipes():
        line = load_recipe(n)["serve"]["dsq"].split("#")[0]
        steps = [shlex.split(part) for part in line.split("&&")]
        assert [st[:2] for st in steps] == [["dsq", "quantize"], ["dsq", "serve"]], (n, line)
        for st in steps:
            cmd = group.commands[st[1]]
            known = {o for p in cmd.params for o in p.opts + p.secondary_opts}
            unknown = [t for t in st[2:] if t.startswith("-") and t not in known]
            assert not unknown, (n, st[1], unknown)
        out = steps[0][steps[0].index("--out") + 1]
        assert out in steps[1][2:3], (n, line)  # serve's model is quantize's output


def test_recipes_validate_and_apply(runner, tiny_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a quantize the test expects refused would write its default output here
    from dsq.quant.recipes import FORMATS, apply_recipe, list_recipes, load_recipe, validate_recipe

    names = list_recipes()
    assert {"r1-distill-qwen-1.5b", "r1-distill-qwen-7b", "r1-distill-qwen-14b", "r1-distill-qwen-32b",
            "r1-distill-llama-8b", "r1-distill-llama-70b", "deepseek-v2-lite", "deepseek-v3"} <= set(names)
    for n in names:
        validate_recipe(load_recipe(n))
    bad = load_recipe("r1-distill-qwen-32b")
    bad["parallel"]["tp"] = 3
    with pytest.raises(Exception, match="tensor parallel"):
        validate_recipe(bad)
    assert apply_recipe("r1-distill-qwen-7b", {"method": "gguf"})["method"] == "awq"
    # the DeepSeek recipes are real: dsq runs and quantizes them, and each gives its formats' memory
    # and its offload plans, which the schema checks
    for n in ("deepseek-v2-lite", "deepseek-v3"):
        r = load_recipe(n)
        assert r["dsq_support"] == "native" and set(r["memory_gb"]["weights"]) == set(FORMATS)
        assert r["offload"]["plans"] and "--experts" in r["serve"]["dsq"]
    v3 = load_recipe("deepseek-v3")
    assert [p["fits"] for p in v3["offload"]["plans"] if p["gpu_gb"] == 24] == [True, False]
    assert apply_recipe("deepseek-v3", {})["method"] == "fp8"
    for field, value, msg in (("dsq_support", "maybe", "dsq_support"), ("active_params_b", 700, "active_params_b")):
        bad = load_recipe("deepseek-v3")
        bad[field] = value
        with pytest.raises(Exception, match=msg):
            validate_recipe(bad)
    bad = load_recipe("deepseek-v3")
    bad["memory_gb"]["weights"]["q4_k_m"] = 40  # a tenth of 671B at 4.5 bits
    with pytest.raises(Exception, match="q4_k_m weights"):
        validate_recipe(bad)
    bad = load_recipe("deepseek-v3")
    bad["offload"]["plans"][1]["fits"] = True  # 367 GiB of experts in 256 GiB of RAM
    with pytest.raises(Exception, match="offload plan"):
        validate_recipe(bad)
    pending = {**load_recipe("deepseek-v3"), "dsq_support": "pending"}
    monkeypatch.setattr("dsq.quant.recipes.load_recipe", lambda name: pending)
    one_line_error(runner.invoke(app, ["quantize", "--recipe", "deepseek-v3", str(tiny_dir("qwen2"))]),
                   "cannot quantize yet")
    monkeypatch.undo()
    out = tmp_path / "v2"
    r = runner.invoke(app, ["quantize", str(tiny_dir("deepseek_v2")), "--recipe", "deepseek-v2-lite",
                            "--eval-tokens", "0", "--out", str(out)])
    assert r.exit_code == 0, r.output
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["block_structure"] == [128, 128]
    from safetensors import safe_open

    dtypes = {}
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            dtypes.update({k: h.get_slice(k).get_dtype() for k in h.keys()})
    # the routed experts are FP8, the router (keep_16bit) is not
    assert dtypes["model.layers.1.mlp.experts.0.up_proj.weight"] == "F8_E4M3"
    assert dtypes["model.layers.1.mlp.gate.weight"] != "F8_E4M3"
    out = tmp_path / "r"
    r = runner.invoke(app, ["quantize", str(tiny_dir("qwen2")), "--recipe", "r1-distill-qwen-14b", "--calib-samples",
                            "8", "--eval-tokens", "0", "--out", str(out)])
    assert r.exit_code == 0, r.output
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["desc_act"] is True and qc["checkpoint_format"] == "gptq"
    # flags given on the command line win over the recipe
    assert json.loads((out / "dsq_quant.json").read_text())["spec"]["calib_samples"] == 8


def test_deepseek_recipes_hold_what_the_planner_computes():
    """The DeepSeek recipes' memory per format and offload plans are benchmarks.deepseek_recipes'
    output (the real configs' tensors, dsq's planner), not numbers typed in by hand."""
    from benchmarks.deepseek_recipes import MODELS, active_params, model_shape, plans, weight_bytes
    from dsq.quant.recipes import load_recipe

    for name, (cfg, keep) in MODELS.items():
        r = load_recipe(name)
        total, _ = active_params(cfg)
        assert abs(total / 1e9 - r["params_b"]) < 0.05
        for fmt, gb in r["memory_gb"]["weights"].items():
            assert abs(weight_bytes(cfg, fmt, keep) / 1e9 - gb) < 0.06, (name, fmt)
        computed = plans(model_shape(name, cfg), r["offload"]["ctx"])
        for p in r["offload"]["plans"]:
            for ram in p["ram_gb"]:
                c = next(x for x in computed if (x["gpu_gb"], x["ram_gb"]) == (p["gpu_gb"], ram))
                assert (c["experts"], c["gpu_layers"], c["fits"]) == (p["experts"], p["gpu_layers"], p["fits"])
                assert abs(c["gpu_used_gb"] - p["gpu_used_gb"]) < 0.06 and abs(c["ram_used_gb"] - p["ram_used_gb"]) < 0.06


@pytest.mark.parametrize("method,kind", [("awq", "gemma3"), ("gptq", "llama"), ("awq", "deepseek_v3"),
                                         ("gptq", "deepseek_v3")])
def test_artifact_computes_what_the_driver_computed(method, kind, tiny_dir, tmp_path):
    """Rebuild the quantized model in memory block by block (the driver's own steps) and compare
    its logits with the written artifact's: folded scales, norms and codes all made it to disk
    (gemma3: norms with the +1 offset; deepseek_v3: AWQ's scale in the routers and the latent
    norms, per-expert codes, the dense layer kept float)."""
    import numpy as np

    from dsq.formats.hf import HFModelDir
    from dsq.models.registry import build_args
    from dsq.quant.blocks import block_tensors, materialize, run_block
    from dsq.quant.calib import calibration_for
    from dsq.quant.driver import quantize_block
    from dsq.quant.moe import dense_layers
    from dsq.runtime.native import NativeModel

    src = tiny_dir(kind)
    spec = QuantSpec(method, calib=CalibSpec(samples=8, seq_len=64), min_expert_tokens=32).validate()
    quantize(src, tmp_path / "q", spec, eval_tokens=0)
    hf = HFModelDir(src)
    mod, args = build_args(hf.config)
    ids = calibration_for(hf, spec.calib)
    with torch.device("meta"):
        model = mod.Model(args)
    model.load_state_dict({k: v.float() for k, v in hf.mmap_tensors().items() if not k.startswith("model.layers.")},
                          strict=False, assign=True)
    model.tie_weights()
    scale = float(torch.tensor(args.embed_scale, dtype=torch.float32)) if args.embed_scale else 1.0
    hidden = model.model.embed_tokens.weight[ids] * scale
    for i in range(args.num_hidden_layers):
        materialize(model.model.layers[i], block_tensors(hf, i), "cpu", torch.float32)
        ctx = model.block_context(i, ids.shape[1], "cpu")
        quantize_block(model.model.layers[i], i, spec, hidden, ctx, "cpu", torch.float32, 8, dense_layers(args, spec))
        hidden = run_block(model.model.layers[i], hidden, ctx, "cpu", torch.float32, 8)
    toks = list(range(3, 50))
    with torch.no_grad():
        want = model(torch.tensor([toks]))[0].numpy()
    got = NativeModel(tmp_path / "q", "hf", n_ctx=64, dtype="fp32").logits(toks)
    assert np.abs(got - want).max() < 1e-3 * max(1.0, float(np.abs(want).max()))


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_bf16_blocks_as_on_a_gpu(method, tiny_dir, tmp_path):
    """On a GPU blocks compute in bf16: every step must keep the weights in that dtype (an AWQ
    scale search once left float32 weights behind, and the next forward failed)."""
    from dsq.runtime.native import NativeModel

    out = tmp_path / method
    quantize(tiny_dir("llama"), out, QuantSpec(method, calib=CalibSpec(samples=4, seq_len=32)),
             compute_dtype=torch.bfloat16, eval_tokens=0)
    m = NativeModel(out, "hf", n_ctx=64, dtype="fp32")
    assert torch.isfinite(torch.as_tensor(m.logits(list(range(3, 20))))).all()
