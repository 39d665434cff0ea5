"""GGUF -> HF safetensors directory, dequantized (bf16 by default), with config and tokenizer.

Undoes what the HF -> GGUF direction does: llama's q/k row interleave, Gemma's (1 + w) norms,
tied output heads. The tokenizer is rebuilt from the GGUF vocabulary (tokenizer_gguf).
"""

from __future__ import annotations

from pathlib import Path

from dsq.formats.arch import ArchSpec, arch_for_gguf
from dsq.formats.gguf_file import GGUFFile
from dsq.formats.hf import ShardedSafetensorsWriter, atomic_output_dir, write_json
from dsq.formats.tokenizer_gguf import vocab_from_gguf, write_hf_tokenizer


def hf_config_from_gguf(g: GGUFFile, spec: ArchSpec, dtype: str) -> dict:
    a = g.arch_field
    n_head = int(a("attention.head_count"))
    n_embd = int(a("embedding_length"))
    hd = int(a("attention.key_length", n_embd // n_head))
    names = {t.name for t in g.tensors}
    tied = "output.weight" not in names
    vocab = g.field("tokenizer.ggml.tokens")
    n_vocab = next(t.shape[0] for t in g.tensors if t.name == "token_embd.weight")
    cfg = {
        "architectures": [spec.hf_class],
        "model_type": spec.model_type,
        "hidden_size": n_embd,
        "intermediate_size": int(a("feed_forward_length")),
        "num_hidden_layers": g.n_layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": int(a("attention.head_count_kv", n_head)),
        "head_dim": hd,
        "max_position_embeddings": int(a("context_length", 4096)),
        "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(a("rope.freq_base", 10000.0)),
        "vocab_size": n_vocab if vocab is None else max(n_vocab, len(vocab)),
        "tie_word_embeddings": tied,
        "torch_dtype": dtype,
        "bos_token_id": g.field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": g.field("tokenizer.ggml.eos_token_id"),
        "pad_token_id": g.field("tokenizer.ggml.padding_token_id"),
    }
    if a("rope.scaling.type") == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
    if spec.model_type in ("llama", "qwen2"):
        cfg["hidden_act"] = "silu"
        cfg["attention_bias"] = spec.model_type == "qwen2" or "blk.0.attn_q.bias" in names
        cfg["mlp_bias"] = False
    if spec.model_type == "qwen2":
        cfg["use_sliding_window"] = False
    if spec.model_type == "gemma3_text":
        window = int(a("attention.sliding_window", 0) or 0)
        pattern = a("attention.sliding_window_pattern")
        if isinstance(pattern, list):
            swa = [bool(x) for x in pattern]
        else:
            p = int(pattern or 6)
            swa = [(i + 1) % p != 0 for i in range(g.n_layers)]
        cfg.update({
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": hd,
            "sliding_window": window or None,
            "layer_types": ["sliding_attention" if s and window else "full_attention" for s in swa],
            "rope_local_base_freq": float(a("rope.freq_base_swa", 10000.0)),
            "final_logit_softcapping": a("final_logit_softcapping"),
            "attn_logit_softcapping": None,
            "attention_bias": False,
        })
    if "rope_freqs.weight" in names:
        from dsq.errors import UnsupportedModel
        from dsq.formats.arch import llama3_rope_from_factors

        rope = llama3_rope_from_factors(g.dequantize("rope_freqs.weight"), cfg["rope_theta"], hd)
        if rope is None:
            raise UnsupportedModel("this GGUF's rope_freqs tensor matches no llama3 rope scaling",
                                   "its rope scaling cannot be written as an HF config")
        cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {k: v for k, v in cfg.items() if v is not None or k in ("sliding_window",)}


def gguf_to_hf(src: str | Path, out: str | Path, dtype: str = "bfloat16", force: bool = False,
               console=None, progress=None, fallback_template: str | None = None) -> Path:
    """Dequantize a GGUF into an HF directory at `out` (written atomically).

    `fallback_template` becomes the chat template when the GGUF carries none.
    """
    import torch

    g = GGUFFile(src)
    spec = arch_for_gguf(g.arch)
    tdtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    cfg = hf_config_from_gguf(g, spec, dtype)
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    plan = spec.gguf_plan([t.name for t in g.tensors], Path(src).name)
    vocab = vocab_from_gguf(g)

    def run(cb):
        with atomic_output_dir(Path(out), force=force) as tmp:
            writer = ShardedSafetensorsWriter(tmp)
            for i, (gname, hname) in enumerate(plan):
                x = spec.from_gguf(hname, torch.from_numpy(g.dequantize(gname).copy()), n_head, n_kv)
                keep_f32 = x.ndim == 1 and dtype == "float32"
                writer.add(hname, x if keep_f32 else x.to(tdtype))
                cb(gname, i + 1, len(plan))
            writer.close()
            write_json(tmp / "config.json", cfg)
            gen = {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id")}
            write_json(tmp / "generation_config.json", {k: v for k, v in gen.items() if v is not None})
            write_hf_tokenizer(vocab, tmp, cfg.get("max_position_embeddings"),
                               chat_template=fallback_template)
        return Path(out)

    if progress is not None:
        return run(progress)
    from dsq.ui import convert_with_progress

    return convert_with_progress(run, f"exporting {Path(src).name} to HF ({dtype})", console)
