"""HF -> GGUF for tiny random llama / qwen2 / gemma3: llama.cpp's logits against transformers'
on the same weights, tokenization against HF tokenizers, names against gguf-py's own map."""

from __future__ import annotations

import numpy as np
import pytest

from tiny import held_out_text, hf_logits, kld_top1

KINDS = ["llama", "qwen2", "gemma3"]


def _ids(m, kind, n=96):
    from tokenizers import Tokenizer  # noqa: F401  (the model's own tokenizer is checked elsewhere)

    ids = m.tokenize(held_out_text(2000), add_bos=m.add_bos, special=False)
    return ids[:n]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    cache = {}

    def get(kind, ids):
        key = (kind, tuple(ids))
        if key not in cache:
            cache[key] = hf_logits(tiny_dir(kind), ids)
        return cache[key]

    return get


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qtype,max_kld,min_top1", [("F32", 1e-6, 1.0), ("F16", 1e-4, 0.97), ("Q8_0", 2e-3, 0.9)])
def test_llama_cpp_logits_match_transformers(kind, qtype, max_kld, min_top1, tiny_gguf, reference, record_property):
    from dsq.runtime.llama_cpp_backend import LlamaCppModel

    m = LlamaCppModel(tiny_gguf(kind, qtype), logits_all=True, n_ctx=256, f32_kv=True)
    ids = _ids(m, kind)
    assert len(ids) == 96
    ref = reference(kind, ids)
    got = m.logits(ids)
    kld, top1, maxdiff = kld_top1(ref, got)
    record_property("kld", kld)
    record_property("top1", top1)
    print(f"{kind} {qtype}: KLD {kld:.2e} top-1 {top1:.3f} max|dlogit| {maxdiff:.2e}")
    assert kld < max_kld
    assert top1 >= min_top1
    if qtype == "F32":
        assert maxdiff < 1e-2 * max(1.0, float(np.abs(ref).max()))


@pytest.mark.parametrize("kind", KINDS)
def test_tokenization_matches_hf(kind, tiny_dir, tiny_gguf):
    from tokenizers import Tokenizer

    from dsq.runtime.llama_cpp_backend import LlamaCppModel

    tok = Tokenizer.from_file(str(tiny_dir(kind) / "tokenizer.json"))
    m = LlamaCppModel(tiny_gguf(kind, "F32"), vocab_only=True, n_ctx=64)
    text = held_out_text(6000) + "\n  tabs\tand  double  spaces, numbers 1234567 and ünïcödé ✓\n"
    assert m.tokenize(text, add_bos=False, special=False) == tok.encode(text, add_special_tokens=False).ids
    # special tokens are parsed as one token when templated
    s = "<|im_start|>user\nhi<|im_end|>\n"
    assert m.tokenize(s, add_bos=False, special=True) == tok.encode(s, add_special_tokens=False).ids


@pytest.mark.parametrize("kind", KINDS)
def test_tensor_names_agree_with_gguf_py(kind, tiny_dir):
    import gguf

    from dsq.formats.hf import HFModelDir
    from dsq.models.registry import arch_for_model_type

    hf = HFModelDir(tiny_dir(kind))
    spec = arch_for_model_type(hf.model_type)
    n = hf.config["num_hidden_layers"]
    ref = gguf.get_tensor_name_map(gguf.MODEL_ARCH[spec.gguf_arch.upper()], n)
    for name in hf.tensor_names():
        ours = spec.hf_to_gguf_name(name)
        theirs = ref.get_name(name, try_suffixes=(".weight", ".bias"))
        assert ours == theirs, name
        assert spec.gguf_to_hf_name(ours) == name


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_hf_gguf_round_trip(kind, tiny_gguf, tmp_path):
    """What an architecture reads back from GGUF (Arch.read_gguf) writes the same GGUF again
    (Arch.write_gguf): same keys and values, same tensor bytes."""
    from dsq.convert.gguf_to_hf import gguf_to_hf
    from dsq.convert.hf_to_gguf import hf_to_gguf
    from dsq.formats.gguf_file import GGUFFile

    a = GGUFFile(tiny_gguf(kind, "F32"))
    hf = gguf_to_hf(a.path, tmp_path / "hf", "float32", progress=lambda *_: None)
    b = GGUFFile(hf_to_gguf(hf, tmp_path / "again.gguf", "F32", name=a.field("general.name")))
    keys = (set(a._fields) | set(b._fields)) - {"general.source.url"}
    head_dim = a.arch_field("embedding_length") // a.arch_field("attention.head_count")
    for k in sorted(keys):
        if k not in a._fields and k.endswith(("attention.key_length", "attention.value_length")):
            assert b.field(k) == head_dim, k  # the read-back config always says head_dim
        else:
            assert a.field(k) == b.field(k), k
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for t in a.tensors:
        assert np.array_equal(a.raw(t.name)[0], b.raw(t.name)[0]), t.name


def test_unsupported_architectures():
    from dsq.errors import UnsupportedModel
    from dsq.models.registry import arch_for_gguf, arch_for_model_type, build_args

    with pytest.raises(UnsupportedModel, match="multimodal Gemma 3") as e:
        arch_for_model_type("gemma3")
    assert "gemma3_text" in e.value.hint
    with pytest.raises(UnsupportedModel, match="'mamba' is not supported") as e:
        arch_for_model_type("mamba")
    assert e.value.hint == "supported: llama, qwen2, gemma3_text, deepseek_v3, deepseek_v2"
    with pytest.raises(UnsupportedModel, match="'gemma3' is not supported by the native runtime"):
        build_args({"model_type": "gemma3"})
    with pytest.raises(UnsupportedModel, match="'gemma2' cannot be converted to HF yet") as e:
        arch_for_gguf("gemma2")
    assert e.value.hint == "supported: llama, qwen2, gemma3, deepseek2"


def test_chat_template_fallbacks_by_architecture():
    from dsq.models.registry import gguf_name
    from dsq.runtime.chat_template import CHATML_TEMPLATE, GEMMA_TEMPLATE, fallback_for, pick_template

    assert [gguf_name(m) for m in ("gemma3_text", "qwen2", "llama", "mistral")] == ["gemma3", "qwen2", "llama",
                                                                                      "mistral"]
    assert fallback_for("gemma3") == fallback_for("gemma2") == fallback_for("gemma") == GEMMA_TEMPLATE
    assert fallback_for("qwen2") == fallback_for("qwen3") == CHATML_TEMPLATE
    assert fallback_for("llama") is None and fallback_for("mistral") is None
    assert pick_template(None, "qwen3", lambda t: False, "", "").origin == "fallback:qwen3"


def test_metadata_written(tiny_gguf):
    from dsq.formats.gguf_file import GGUFFile

    g = GGUFFile(tiny_gguf("gemma3", "F16"))
    assert g.arch == "gemma3"
    assert g.field("general.file_type") == 1
    assert g.arch_field("attention.sliding_window") == 16
    assert g.arch_field("attention.sliding_window_pattern") == [True, True, False]
    assert "<|im_start|>" in g.field("tokenizer.chat_template")
    assert g.field("tokenizer.ggml.pre") == "gpt-2"
    gl = GGUFFile(tiny_gguf("llama", "F32"))
    assert gl.field("tokenizer.ggml.pre") == "llama-bpe"
    assert gl.field("tokenizer.ggml.add_bos_token") is True
    assert any(t.name == "rope_freqs.weight" for t in gl.tensors)  # llama3 rope scaling
    assert any(t.name == "output.weight" for t in gl.tensors)  # untied
    gq = GGUFFile(tiny_gguf("qwen2", "F32"))
    assert gq.field("tokenizer.ggml.pre") == "qwen2"
    assert not any(t.name == "output.weight" for t in gq.tensors)  # tied
    assert any(t.name == "blk.0.attn_q.bias" for t in gq.tensors)


def test_our_reader_agrees_with_gguf_py(tiny_gguf):
    from gguf import GGUFReader

    from dsq.formats.gguf_file import GGUFFile

    path = tiny_gguf("qwen2", "Q8_0")
    ours, ref = GGUFFile(path), GGUFReader(path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        assert ours.field(key) == field.contents(), key
    for t in ref.tensors:
        data, qtype, shape = ours.raw(t.name)
        assert qtype == t.tensor_type and shape == tuple(reversed(t.shape.tolist()))
        assert np.array_equal(np.asarray(data).reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))


def test_q4_k_m_mixture_and_run(tiny_gguf):
    """The quantizer applies llama.cpp's Q4_K_M mixture; dsq loads and generates from it."""
    from dsq.formats.gguf_file import GGUFFile
    from dsq.runtime.engine import generate, load

    path = tiny_gguf("llama", "Q4_K_M")
    g = GGUFFile(path)
    types = {t.name: t.type_name for t in g.tensors}
    assert g.describe_quant() == "Q4_K_M"
    assert types["blk.0.attn_q.weight"] == "Q4_K"
    assert types["output.weight"] == "Q6_K"
    assert types["blk.0.attn_norm.weight"] == "F32"
    r = generate(load(path, ctx=128), "The", max_tokens=8, temperature=0)
    assert r.stats.generated_tokens + (r.stats.finish_reason == "stop") >= 1
    assert len(r.token_ids) == r.stats.generated_tokens
