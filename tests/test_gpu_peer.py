"""The side-by-side with llama.cpp on one file: random GGUFs of a model shape (dsq.bench.random_gguf)
that llama.cpp and the native runtime both load and agree on; llama.cpp's GPU settings; the guard
against a llama.cpp build that crashes beside PyTorch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dsq.bench import random_gguf as rg

TEXT = "The history of the Roman Empire, in 12 chapters; with maps."


def test_tensor_types_follow_llama_cpps_q4_k_m_rule():
    n = 32  # attn_v / ffn_down get Q6_K in the first and last eighth and every third layer between
    six = [i for i in range(n) if rg.tensor_type("Q4_K_M", f"blk.{i}.ffn_down.weight", n) == "Q6_K"]
    assert six == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert [rg.tensor_type("Q4_K_M", f"blk.{i}.attn_v.weight", n) for i in (0, 4, 6)] == ["Q6_K", "Q4_K", "Q6_K"]
    assert rg.tensor_type("Q4_K_M", "output.weight", n) == "Q6_K"
    assert rg.tensor_type("Q4_K_M", "token_embd.weight", n) == "Q4_K"
    assert rg.tensor_type("Q4_K_M", "blk.3.ffn_gate.weight", n) == "Q4_K"
    assert rg.tensor_type("Q8_0", "output.weight", n) == "Q8_0"
    assert rg.tensor_type("Q8_0", "blk.0.attn_norm.weight", n) == "F32"
    assert rg.tensor_type("Q4_K_M", "blk.0.attn_q.bias", n) == "F32"
    assert rg.tensor_type("Q4_K_M", "token_embd.weight", n, tied=True) == "Q6_K"  # the output head too
    with pytest.raises(ValueError, match="unknown mix"):
        rg.tensor_type("Q3_K_S", "output.weight", n)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("random-gguf")
    out = {mix: rg.write_random_gguf(d / f"tiny-{mix}.gguf", "tiny", mix, seed=1) for mix in ("Q4_K_M", "Q4_0")}
    out["qwen2"] = rg.write_random_gguf(d / "tiny-qwen2.gguf", "tiny-qwen2", "Q4_K_M", seed=1)
    return out


def test_file_holds_the_planned_tensors_in_a_trained_range(files):
    from dsq.formats.gguf_file import GGUFFile

    g = GGUFFile(files["Q4_K_M"])
    cfg = rg.SHAPES["tiny"]
    types = {t.name: t.type_name for t in g.tensors}
    assert types["blk.1.attn_v.weight"] == "Q6_K" and types["blk.0.attn_v.weight"] == "Q4_K"
    assert len(types) == 2 + 9 * cfg["num_hidden_layers"] + 1
    assert g.n_layers == cfg["num_hidden_layers"] and len(g.field("tokenizer.ggml.tokens")) == cfg["vocab_size"]
    for name in ("token_embd.weight", "blk.1.attn_v.weight", "blk.0.ffn_down.weight", "output.weight"):
        w = g.dequantize(name)
        assert np.isfinite(w).all() and 2e-3 < w.std() and np.abs(w).max() < 0.06, (name, w.std(), np.abs(w).max())
        assert abs(w.mean()) < 0.2 * w.std(), name  # Q4_K's dmin offsets its codes' mean


def test_qwen2_file_has_biases_and_ties_its_embeddings(files):
    from dsq.formats.gguf_file import GGUFFile

    g = GGUFFile(files["qwen2"])
    cfg = rg.SHAPES["tiny-qwen2"]
    types = {t.name: t.type_name for t in g.tensors}
    assert g.field("general.architecture") == "qwen2"
    assert "output.weight" not in types and types["token_embd.weight"] == "Q6_K"
    assert len(types) == 2 + 12 * cfg["num_hidden_layers"]
    bias = g.dequantize("blk.1.attn_k.bias")
    assert types["blk.1.attn_k.bias"] == "F32" and bias.shape == (cfg["num_key_value_heads"] * cfg["head_dim"],)
    assert 0.01 < bias.std() < 0.03


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q4_0", "qwen2"])
def test_llama_cpp_and_native_agree_on_the_file(mix, files):
    """Both engines load the file and agree (qwen2: a file without its q/k/v biases applied
    would be ~0.37 apart)."""
    from dsq.runtime.llama_cpp_backend import LlamaCppModel
    from dsq.runtime.native import NativeModel

    ours = NativeModel(files[mix], "gguf", n_ctx=256, dtype="fp32")
    theirs = LlamaCppModel(files[mix], logits_all=True, n_ctx=256, f32_kv=True)
    ids = ours.tokenize(TEXT)
    assert ids == theirs.tokenize(TEXT) and len(ids) > 40
    a, b = ours.logits(ids), theirs.logits(ids)
    assert b.std() > 0.05  # logits that differ between tokens: agreement means something
    rel = np.linalg.norm(a - b) / np.linalg.norm(b)
    top1 = (a.argmax(-1) == b.argmax(-1)).mean()
    # llama.cpp rounds activations to 8 bits for these types: ~1e-2 apart, not float-exact
    assert rel < 3e-2 and top1 >= 0.9, (rel, top1)


def test_existing_file_kept_without_force(files):
    from dsq.errors import DsqError

    before = files["Q4_0"].read_bytes()
    with pytest.raises(DsqError, match="already exists"):
        rg.write_random_gguf(files["Q4_0"], "tiny", "Q8_0")
    assert files["Q4_0"].read_bytes() == before


def test_flash_attention_on_where_layers_sit_on_a_gpu(monkeypatch):
    from dsq.runtime import llama_cpp_backend as lcb
    from dsq.runtime.gpu_layers import GpuLayers

    none, eight, every = (GpuLayers.parse(g) for g in ("0", "8", "all"))
    monkeypatch.delenv("DSQ_LLAMA_FLASH_ATTN", raising=False)
    monkeypatch.setattr(lcb, "supports_gpu_offload", lambda: True)
    assert [lcb.flash_attn_for(g) for g in (none, eight, every)] == [False, True, True]
    monkeypatch.setattr(lcb, "supports_gpu_offload", lambda: False)
    assert lcb.flash_attn_for(every) is False
    monkeypatch.setenv("DSQ_LLAMA_FLASH_ATTN", "1")
    assert lcb.flash_attn_for(none) is True
    monkeypatch.setenv("DSQ_LLAMA_FLASH_ATTN", "0")
    monkeypatch.setattr(lcb, "supports_gpu_offload", lambda: True)
    assert lcb.flash_attn_for(every) is False


def test_symbol_owner_is_told_apart():
    """The probe behind the C++-runtime guard: which loaded library itself defines a symbol."""
    import llama_cpp

    from dsq.runtime import llama_cpp_backend as lcb

    lib = Path(llama_cpp.__file__).parent / "lib"
    std = next(ln.split()[-1] for ln in open("/proc/self/maps") if "libstdc++.so" in ln)
    assert lcb.defines_symbol(std, lcb._CXX_PROBE)
    assert lcb.defines_symbol(next(lib.glob("libllama.so*")), "llama_model_load_from_file")
    assert not lcb.defines_symbol(next(lib.glob("libggml-cpu.so*")), lcb._CXX_PROBE)
    assert not lcb.defines_symbol(next(lib.glob("libggml-cpu.so*")), "llama_model_load_from_file")
    assert not lcb.defines_symbol(lib / "no-such-library.so", lcb._CXX_PROBE)


def test_a_build_that_would_crash_beside_torch_is_refused(files, monkeypatch):
    import torch  # noqa: F401  - the guard applies once PyTorch is in the process

    from dsq.errors import BackendError
    from dsq.runtime import llama_cpp_backend as lcb

    monkeypatch.setattr(lcb, "exports_cxx_runtime", lambda llama_cpp: True)
    with pytest.raises(BackendError, match="crashes loading a model") as e:
        lcb.LlamaCppModel(files["Q4_0"], n_ctx=64)
    assert "exclude-libs" in e.value.hint
    assert lcb.LlamaCppModel(files["Q4_0"], n_ctx=64, vocab_only=True).tokenize(TEXT)  # vocab-only loads stay


def test_command_line_errors_are_one_line(files, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        rg.main([str(files["Q4_0"]), "--shape", "tiny"])
    assert e.value.code == 1 and "already exists" in capsys.readouterr().err
    rg.main([str(tmp_path / "t.gguf"), "--shape", "tiny", "--layers", "1", "--mix", "Q8_0"])
    from dsq.formats.gguf_file import GGUFFile

    assert GGUFFile(tmp_path / "t.gguf").n_layers == 1


def test_every_token_decodes_to_text_that_text_never_tokenizes_into(files):
    """The vocabulary's padding words render as text in both engines, so whatever a random model
    generates streams as text (dsq bench --serve times its first text), and tokenizing those very
    words never yields them, so real text tokenizes as with the base pieces alone."""
    from dsq.runtime.llama_cpp_backend import LlamaCppModel
    from dsq.runtime.native import NativeModel

    V = rg.SHAPES["tiny"]["vocab_size"]
    pad = list(range(V - 40, V))
    words = "".join(f" w{i}" for i in pad)
    for eng in (NativeModel(files["Q4_0"], "gguf", n_ctx=64, dtype="fp32"), LlamaCppModel(files["Q4_0"], n_ctx=64)):
        assert eng.detokenize(pad).strip() == words.strip()
        ids = eng.tokenize(words, add_bos=False)
        assert ids and not set(ids) & set(pad)


def test_awq_twin_shares_the_shape_and_vocabulary_of_the_gguf(files, tmp_path):
    """dsq.bench.random_models' AWQ directory of a shape: the native runtime loads it as AWQ, its
    weights lie in a trained range, and its tokenizer.json tokenizes text into the same ids as the
    random GGUF of that shape (the same prompts cost both servers the same tokens)."""
    import torch

    from dsq.bench.random_models import write_random_awq
    from dsq.formats.awq_gptq import awq_dequantize
    from dsq.runtime.native import NativeModel

    d = write_random_awq("tiny", tmp_path / "awq", seed=1)
    assert not (tmp_path / "awq.partial").exists()
    from safetensors.torch import load_file

    t = load_file(str(next(d.glob("model-*.safetensors"))))
    w = awq_dequantize(t["model.layers.1.mlp.down_proj.qweight"], t["model.layers.1.mlp.down_proj.qzeros"],
                       t["model.layers.1.mlp.down_proj.scales"], 128)
    assert w.shape == (256, 512) and 5e-3 < w.std() < 0.03 and w.abs().max() < 0.06 and abs(w.mean()) < 1e-3
    ours = NativeModel(d, "hf", n_ctx=128, dtype="fp32")
    gguf = NativeModel(files["Q4_0"], "gguf", n_ctx=128, dtype="fp32")
    down = ours.model.model.layers[1].mlp.down_proj
    assert type(down).__name__ == "IntLinear" and down.source == "awq int4"
    ids = ours.tokenize(TEXT)
    assert ids == gguf.tokenize(TEXT) and len(ids) > 40
    logits = torch.as_tensor(ours.logits(ids))
    assert torch.isfinite(logits).all() and logits.std() > 0.05
