"""HF safetensors directory -> GGUF (F32/F16/BF16), our own converter for the architectures in
dsq.models.registry.

Tensor data streams one tensor at a time from memory-mapped safetensors into the output, so a
model larger than RAM converts; FP8 checkpoints (DeepSeek's weight_scale_inv) are dequantized one
tensor at a time as they are read (dsq.convert.fp8_source). The output appears only when complete
(temp file + rename).
Reference for the layout: llama.cpp's convert_hf_to_gguf.py (not shipped in the wheel).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from dsq.convert.fp8_source import float_view
from dsq.errors import UnsupportedModel
from dsq.formats.gguf_types import FTYPES
from dsq.formats.hf import HFModelDir, atomic_output_file, rope_parameters
from dsq.formats.tokenizer_gguf import vocab_from_hf, write_vocab_gguf
from dsq.models.arch import Arch, Made, head_dim
from dsq.models.registry import arch_for_model_type
from dsq.models.rope import llama3_rope_factors

_SKIP = re.compile(r"rotary_emb\.inv_freq$|\.attn\.masked_bias$|\.attn\.bias$")

Progress = Callable[[str, int, int], None]  # (tensor name, index, total)
# MoE routers pick experts by small score differences: llama.cpp's converter writes them in F32
# whatever the output type, and its quantizer leaves them so
F32_TENSORS = ("ffn_gate_inp.weight",)


def _source_dtype(cfg: dict) -> str:
    return str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32").replace("torch.", "")


def pick_outtype(cfg: dict, outtype: str) -> str:
    outtype = outtype.upper()
    if outtype == "AUTO":
        return "BF16" if _source_dtype(cfg) == "bfloat16" else "F16"
    if outtype not in ("F32", "F16", "BF16"):
        raise UnsupportedModel(f"unknown float type {outtype!r}", "use auto, f32, f16 or bf16")
    return outtype


def write_hparams(w, arch: Arch, cfg: dict, n_vocab: int) -> None:
    """The GGUF hyperparameters of `cfg`: the keys every architecture has, then the arch's own."""
    _write_shape(w, arch, cfg, n_vocab)
    _write_rope(w, arch, cfg)
    arch.write_gguf(w, cfg)


def _write_shape(w, arch: Arch, cfg: dict, n_vocab: int) -> None:
    n_head = cfg["num_attention_heads"]
    keys = {
        "context_length": int(cfg.get("max_position_embeddings", 4096)),
        "embedding_length": cfg["hidden_size"],
        "block_count": cfg["num_hidden_layers"],
        "feed_forward_length": cfg["intermediate_size"],
        "head_count": n_head,
        "head_count_kv": cfg.get("num_key_value_heads") or n_head,
        "layer_norm_rms_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "vocab_size": n_vocab,
    }
    if cfg.get("head_dim") or arch.gguf_head_dim_always:
        keys["key_length"] = keys["value_length"] = head_dim(cfg)
    if arch.gguf_rope_dims:
        keys["rope_dimension_count"] = head_dim(cfg)
    keys.update(arch.gguf_shape(cfg))
    for key, value in keys.items():
        getattr(w, f"add_{key}")(value)


def _write_rope(w, arch: Arch, cfg: dict) -> None:
    from gguf import RopeScalingType

    rope = rope_parameters(cfg, "full_attention")
    w.add_rope_freq_base(float(rope["rope_theta"]))
    rtype = rope.get("rope_type", "default")
    if rtype == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    elif rtype == "yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        if rope.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(float(rope["beta_fast"]))
        if rope.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(float(rope["beta_slow"]))
    elif rtype not in ("default", "llama3"):
        raise UnsupportedModel(f"rope scaling {rtype!r} is not supported", "supported: linear, yarn, llama3")


def _plan(hf: HFModelDir, arch: Arch, cfg: dict) -> list[Made]:
    """The GGUF tensors in output order, each with the HF tensors it is made from; refuses
    tensors it does not know."""
    tied = cfg.get("tie_word_embeddings", arch.tied_default)
    names = [n for n in hf.tensor_names()
             if not _SKIP.search(n) and not (n == "lm_head.weight" and tied) and arch.model_tensor(n, cfg)]

    def key(m: Made):
        b = re.match(r"blk\.(\d+)\.", m.name)
        return (1, int(b.group(1)), m.name) if b else (0 if m.name.startswith("token_embd") else 2, 0, m.name)

    return sorted(arch.to_gguf_tensors(names, cfg, str(hf.path)), key=key)


def _shape(hf: HFModelDir, made: Made) -> tuple:
    """A GGUF tensor's shape, from its sources' shapes (built on the meta device)."""
    import torch

    return tuple(made.build([torch.empty(hf.tensor_shape(s), device="meta") for s in made.sources]).shape)


def hf_to_gguf(model_dir: str | Path, out: str | Path, outtype: str = "auto", force: bool = False,
               progress: Progress | None = None, name: str | None = None) -> Path:
    """Convert an HF model directory to a float GGUF at `out`. Returns `out`."""
    from gguf import GGUFWriter

    hf = float_view(HFModelDir(model_dir))
    arch = arch_for_model_type(hf.model_type)
    cfg = hf.config
    hf.require(*arch.required)
    outtype = pick_outtype(cfg, outtype)
    plan = _plan(hf, arch, cfg)
    if not any(m.name == "token_embd.weight" for m in plan):
        raise UnsupportedModel(f"{hf.path} has no model.embed_tokens.weight", "is this a full checkpoint?")
    shapes = {m.name: _shape(hf, m) for m in plan}
    vocab = _vocab(hf, cfg, shapes["token_embd.weight"][0])
    extra = _extra_tensors(cfg)
    with atomic_output_file(Path(out), force=force) as tmp:
        w = GGUFWriter(str(tmp), arch.gguf_arch)
        w.add_name(name or hf.path.name)
        w.add_source_url(f"file://{hf.path.resolve()}")  # lets `dsq eval` find the reference
        w.add_file_type(FTYPES[outtype])
        write_hparams(w, arch, cfg, len(vocab.tokens))
        write_vocab_gguf(w, vocab)
        _add_tensor_infos(w, list(shapes.items()), extra, outtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        tensors = [(m.name, lambda m=m: _hf_tensor(hf, m)) for m in plan]
        tensors += [(g, lambda x=x: x) for g, x in extra]
        _write_tensor_data(w, tensors, outtype, progress)
        w.close()
    return Path(out)


def _vocab(hf: HFModelDir, cfg: dict, n_vocab: int):
    vocab = vocab_from_hf(hf, n_vocab, cfg)
    if len(vocab.tokens) != n_vocab:
        raise UnsupportedModel(f"tokenizer has {len(vocab.tokens)} tokens but the embedding has {n_vocab} rows",
                               "the tokenizer does not belong to these weights")
    return vocab


def _extra_tensors(cfg: dict) -> list[tuple[str, object]]:
    """Tensors GGUF has and the checkpoint does not: llama3 rope scaling as `rope_freqs`."""
    rope = rope_parameters(cfg, "full_attention")
    if rope.get("rope_type") == "llama3":
        return [("rope_freqs.weight", llama3_rope_factors(rope, head_dim(cfg)))]
    return []


def _target(name: str, shape: tuple, outtype: str):
    """(GGML type, numpy dtype) a tensor is written as: vectors and routers stay F32."""
    import numpy as np
    from gguf import GGMLQuantizationType

    if len(shape) == 1 or name.endswith(F32_TENSORS):
        return GGMLQuantizationType.F32, np.float32
    return GGMLQuantizationType[outtype], {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[outtype]


def _add_tensor_infos(w, shapes: list[tuple[str, tuple]], extra: list, outtype: str) -> None:
    import numpy as np
    from gguf import GGMLQuantizationType

    for gname, shape in shapes:
        t, d = _target(gname, shape, outtype)
        nbytes = int(np.prod(shape)) * np.dtype(d).itemsize
        w.add_tensor_info(gname, shape, np.dtype(d), nbytes, raw_dtype=t)
    for gname, data in extra:
        w.add_tensor_info(gname, tuple(data.shape), np.dtype(np.float32), data.numel() * 4,
                          raw_dtype=GGMLQuantizationType.F32)


def _hf_tensor(hf: HFModelDir, made: Made):
    import torch

    return made.build([hf.get_tensor(s).to(torch.float32) for s in made.sources])


def _write_tensor_data(w, tensors: list[tuple[str, Callable]], outtype: str, progress: Progress | None) -> None:
    """Write each (GGUF name, loader) in order, one tensor in memory at a time."""
    for i, (gname, load) in enumerate(tensors):
        x = load()
        w.write_tensor_data(_to_numpy(x, _target(gname, tuple(x.shape), outtype)[0]))
        if progress:
            progress(gname, i + 1, len(tensors))


def _to_numpy(x, qtype):
    import torch
    from gguf import GGMLQuantizationType

    if qtype == GGMLQuantizationType.F32:
        return x.to(torch.float32).contiguous().numpy()
    if qtype == GGMLQuantizationType.F16:
        return x.to(torch.float16).contiguous().numpy()
    return x.to(torch.bfloat16).contiguous().view(torch.uint16).numpy()
