"""GGUF -> HF safetensors directory, dequantized (bf16 by default), with config and tokenizer.

Undoes what the HF -> GGUF direction does (q/k row interleave, norm offsets, tied output heads),
as the architecture's registry entry says. The tokenizer is rebuilt from the GGUF vocabulary
(tokenizer_gguf).
"""

from __future__ import annotations

from pathlib import Path

from dsq.errors import UnsupportedModel
from dsq.formats.gguf_file import GGUFFile
from dsq.formats.hf import ShardedSafetensorsWriter, atomic_output_dir, write_json
from dsq.formats.tokenizer_gguf import vocab_from_gguf, write_hf_tokenizer
from dsq.models.arch import Arch, Made
from dsq.models.registry import arch_for_gguf


def hf_config_from_gguf(g: GGUFFile, arch: Arch, dtype: str) -> dict:
    """The HF config.json of a GGUF's metadata: the keys every architecture has, then the arch's own."""
    names = {t.name for t in g.tensors}
    cfg = _common_config(g, arch, dtype, names)
    scaling = _rope_scaling(g)
    if scaling:
        cfg["rope_scaling"] = scaling
    cfg = {k: v for k, v in cfg.items() if v is not None}
    cfg.update(arch.read_gguf(g, cfg, names))  # the arch's own keys as given: null can mean something
    if "rope_freqs.weight" in names:
        cfg["rope_scaling"] = _llama3_rope_scaling(g, cfg)
    return cfg


def _rope_scaling(g: GGUFFile) -> dict | None:
    """Linear or YaRN rope scaling from the rope.scaling.* keys (llama3's is a tensor)."""
    a = g.arch_field
    kind = a("rope.scaling.type")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
    if kind != "yarn":
        return None
    out = {"rope_type": "yarn", "factor": float(a("rope.scaling.factor")),
           "original_max_position_embeddings": int(a("rope.scaling.original_context_length"))}
    for key in ("beta_fast", "beta_slow"):
        if a(f"rope.scaling.yarn_{key}") is not None:
            out[key] = float(a(f"rope.scaling.yarn_{key}"))
    return out


def _common_config(g: GGUFFile, arch: Arch, dtype: str, names: set[str]) -> dict:
    a = g.arch_field
    n_head = int(a("attention.head_count"))
    n_embd = int(a("embedding_length"))
    vocab = g.field("tokenizer.ggml.tokens")
    n_vocab = next(t.shape[0] for t in g.tensors if t.name == "token_embd.weight")
    return {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "hidden_size": n_embd,
        "intermediate_size": int(a("feed_forward_length")),
        "num_hidden_layers": g.n_layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": int(a("attention.head_count_kv", n_head)),
        "head_dim": int(a("attention.key_length", n_embd // n_head)),
        "max_position_embeddings": int(a("context_length", 4096)),
        "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(a("rope.freq_base", 10000.0)),
        "vocab_size": n_vocab if vocab is None else max(n_vocab, len(vocab)),
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": dtype,
        "bos_token_id": g.field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": g.field("tokenizer.ggml.eos_token_id"),
        "pad_token_id": g.field("tokenizer.ggml.padding_token_id"),
    }


def _llama3_rope_scaling(g: GGUFFile, cfg: dict) -> dict:
    from dsq.models.rope import llama3_rope_from_factors

    rope = llama3_rope_from_factors(g.dequantize("rope_freqs.weight"), cfg["rope_theta"], cfg["head_dim"])
    if rope is None:
        raise UnsupportedModel("this GGUF's rope_freqs tensor matches no llama3 rope scaling",
                               "its rope scaling cannot be written as an HF config")
    return {k: v for k, v in rope.items() if k != "rope_theta"}


def gguf_plan(g: GGUFFile, arch: Arch, cfg: dict) -> list[Made]:
    """The HF tensors of a GGUF, each with the GGUF tensors it is made from."""
    shapes = {t.name: tuple(g.raw(t.name)[2]) for t in g.tensors}
    return arch.from_gguf_tensors(list(shapes), cfg, shapes.__getitem__, g.path.name)


def _dequantized(g: GGUFFile, name: str, last: dict):
    import torch

    if name not in last:
        last.clear()
        last[name] = torch.from_numpy(g.dequantize(name).copy())
    return last[name]


def gguf_to_hf(src: str | Path, out: str | Path, dtype: str = "bfloat16", force: bool = False,
               console=None, progress=None, fallback_template: str | None = None) -> Path:
    """Dequantize a GGUF into an HF directory at `out` (written atomically).

    `fallback_template` becomes the chat template when the GGUF carries none.
    """
    import torch

    g = GGUFFile(src)
    arch = arch_for_gguf(g.arch)
    tdtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    cfg = hf_config_from_gguf(g, arch, dtype)
    plan = gguf_plan(g, arch, cfg)
    vocab = vocab_from_gguf(g)

    def run(cb):
        with atomic_output_dir(Path(out), force=force) as tmp:
            writer = ShardedSafetensorsWriter(tmp)
            last: dict = {}  # one dequantized tensor: a stacked one feeds each of its experts
            for i, made in enumerate(plan):
                x = made.build([_dequantized(g, s, last) for s in made.sources])
                keep_f32 = x.ndim == 1 and dtype == "float32"
                writer.add(made.name, x if keep_f32 else x.to(tdtype))
                cb(made.sources[0], i + 1, len(plan))
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
