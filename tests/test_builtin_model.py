"""The built-in Gemma 3 270M (Q4_K_M): llama.cpp against transformers on its dequantized export,
the exported tokenizer against llama.cpp's, and the README's main command."""

from __future__ import annotations

import json

import pytest

from dsq.cli import app
from tiny import corpus, hf_logits, kld_top1

PROMPT = "The history of the Roman Empire"


@pytest.fixture(scope="module")
def builtin_llama(builtin_gguf):
    from dsq.runtime.llama_cpp_backend import LlamaCppModel

    return LlamaCppModel(builtin_gguf, logits_all=True, n_ctx=512, seed=0)


def test_readme_main_command(runner):
    r = runner.invoke(app, ["run", "-p", PROMPT, "--max-tokens", "32", "--temperature", "0", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 32 and out["generated_tokens"] == 32
    assert out["prompt_tokens"] == 7 and out["decode_tok_s"] > 0 and out["ttft_ms"] > 0
    assert out["text"].strip()
    # streamed (non-JSON) output is the same text
    r2 = runner.invoke(app, ["run", "-p", PROMPT, "--max-tokens", "32", "--temperature", "0"])
    assert r2.exit_code == 0
    assert r2.stdout.rstrip("\n") == out["text"]
    assert "decode" in r2.stderr and "tok/s" in r2.stderr


def test_greedy_continuation_matches_transformers(builtin_llama, builtin_hf):
    """Coherence, checked by an independent implementation on the same (dequantized) weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from dsq.runtime.engine import generate

    ours = generate(builtin_llama, PROMPT, max_tokens=32, temperature=0).token_ids
    ids = builtin_llama.tokenize(PROMPT)
    hf = AutoModelForCausalLM.from_pretrained(builtin_hf, dtype=torch.float32)
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0][len(ids):].tolist()
    agree = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ref))
    print(f"greedy agreement with transformers: {agree}/32 tokens")
    assert agree >= 16


def test_logits_against_transformers(builtin_llama, builtin_hf):
    text = corpus()[100_000:104_000]
    ids = builtin_llama.tokenize(text)[:256]
    kld, top1, _ = kld_top1(hf_logits(builtin_hf, ids), builtin_llama.logits(ids))
    print(f"built-in Q4_K_M (llama.cpp) vs its bf16 export (transformers): KLD {kld:.4f}, top-1 {top1:.3f}")
    assert top1 >= 0.85 and kld < 0.03


def test_exported_tokenizer_is_llama_cpps(builtin_llama, builtin_hf):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(builtin_hf / "tokenizer.json"))
    text = corpus()
    for start in range(0, 150_000, 5_000):
        chunk = text[start:start + 5_000]
        assert builtin_llama.tokenize(chunk, add_bos=False, special=False) == \
            tok.encode(chunk, add_special_tokens=False).ids, start
    turn = "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"
    assert builtin_llama.tokenize(turn, add_bos=True, special=True) == tok.encode(turn).ids


def test_export_round_trip_through_gguf(builtin_hf, tmp_path):
    """bf16 export -> our HF->GGUF (F16) -> llama.cpp equals transformers on the export."""
    from dsq.convert.hf_to_gguf import hf_to_gguf
    from dsq.runtime.llama_cpp_backend import LlamaCppModel

    path = hf_to_gguf(builtin_hf, tmp_path / "rt.gguf", "F16")
    m = LlamaCppModel(path, logits_all=True, n_ctx=256, f32_kv=True)
    ids = m.tokenize(corpus()[200_000:202_000])[:128]
    kld, top1, _ = kld_top1(hf_logits(builtin_hf, ids), m.logits(ids))
    print(f"round trip F16: KLD {kld:.2e}, top-1 {top1:.3f}")
    assert kld < 1e-4 and top1 >= 0.98


def test_quantize_default_uses_builtin_export(runner, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["quantize", "--type", "Q8_0"])
    assert r.exit_code == 0, r.output
    out = tmp_path / "gemma-3-270m-Q8_0.gguf"
    from dsq.formats.gguf_file import GGUFFile

    assert GGUFFile(out).describe_quant() == "Q8_0"
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # no temp files left
