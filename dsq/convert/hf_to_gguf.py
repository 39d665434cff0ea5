"""HF safetensors directory -> GGUF (F32/F16/BF16), our own converter for the architectures in
dsq.models.registry.

Tensor data streams one tensor at a time from memory-mapped safetensors into the output, so a
model larger than RAM converts. The output appears only when complete (temp file + rename).
Reference for the layout: llama.cpp's convert_hf_to_gguf.py (not shipped in the wheel).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from dsq.errors import UnsupportedModel
from dsq.formats.gguf_types import FTYPES
from dsq.formats.hf import HFModelDir, atomic_output_file, rope_parameters
from dsq.formats.tokenizer_gguf import vocab_from_hf, write_vocab_gguf
from dsq.models.arch import Arch, head_dim
from dsq.models.registry import arch_for_model_type
from dsq.models.rope import llama3_rope_factors

_SKIP = re.compile(r"rotary_emb\.inv_freq$|\.attn\.masked_bias$|\.attn\.bias$")

Progress = Callable[[str, int, int], None]  # (tensor name, index, total)


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
    w.add_context_length(int(cfg.get("max_position_embeddings", 4096)))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or n_head)
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(n_vocab)
    if cfg.get("head_dim") or arch.gguf_head_dim_always:
        hd = head_dim(cfg)
        w.add_key_length(hd)
        w.add_value_length(hd)


def _write_rope(w, arch: Arch, cfg: dict) -> None:
    from gguf import RopeScalingType

    rope = rope_parameters(cfg, "full_attention")
    w.add_rope_freq_base(float(rope["rope_theta"]))
    if arch.gguf_rope_dims:
        w.add_rope_dimension_count(head_dim(cfg))
    rtype = rope.get("rope_type", "default")
    if rtype == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    elif rtype == "yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    elif rtype not in ("default", "llama3"):
        raise UnsupportedModel(f"rope scaling {rtype!r} is not supported", "supported: linear, yarn, llama3")


def _plan(hf: HFModelDir, arch: Arch, cfg: dict) -> list[tuple[str, str]]:
    """[(hf name, gguf name)] in output order; refuses tensors it does not know."""
    tied = cfg.get("tie_word_embeddings", arch.tied_default)
    pairs = []
    for name in hf.tensor_names():
        if _SKIP.search(name):
            continue
        if name == "lm_head.weight" and tied:
            continue
        g = arch.hf_to_gguf_name(name)
        if g is None:
            raise UnsupportedModel(f"tensor {name} has no GGUF counterpart for {arch.model_type}",
                                   "this checkpoint has parts dsq does not convert yet")
        pairs.append((name, g))

    def key(p):
        m = re.match(r"blk\.(\d+)\.", p[1])
        return (1, int(m.group(1)), p[1]) if m else (0 if p[1].startswith("token_embd") else 2, 0, p[1])

    return sorted(pairs, key=key)


def hf_to_gguf(model_dir: str | Path, out: str | Path, outtype: str = "auto", force: bool = False,
               progress: Progress | None = None, name: str | None = None) -> Path:
    """Convert an HF model directory to a float GGUF at `out`. Returns `out`."""
    from gguf import GGUFWriter

    hf = HFModelDir(model_dir)
    arch = arch_for_model_type(hf.model_type)
    cfg = hf.config
    hf.require(*arch.required)
    outtype = pick_outtype(cfg, outtype)
    pairs = _plan(hf, arch, cfg)
    if not any(g == "token_embd.weight" for _, g in pairs):
        raise UnsupportedModel(f"{hf.path} has no model.embed_tokens.weight", "is this a full checkpoint?")
    shapes = {hname: hf.tensor_shape(hname) for hname, _ in pairs}
    vocab = _vocab(hf, cfg, shapes["model.embed_tokens.weight"][0])
    extra = _extra_tensors(cfg)
    with atomic_output_file(Path(out), force=force) as tmp:
        w = GGUFWriter(str(tmp), arch.gguf_arch)
        w.add_name(name or hf.path.name)
        w.add_source_url(f"file://{hf.path.resolve()}")  # lets `dsq eval` find the reference
        w.add_file_type(FTYPES[outtype])
        write_hparams(w, arch, cfg, len(vocab.tokens))
        write_vocab_gguf(w, vocab)
        _add_tensor_infos(w, [(g, shapes[h]) for h, g in pairs], extra, outtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        tensors = [(g, lambda h=h: _hf_tensor(hf, arch, cfg, h)) for h, g in pairs]
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


def _target(shape: tuple, outtype: str):
    """(GGML type, numpy dtype) a tensor of `shape` is written as: vectors stay F32."""
    import numpy as np
    from gguf import GGMLQuantizationType

    if len(shape) == 1:
        return GGMLQuantizationType.F32, np.float32
    return GGMLQuantizationType[outtype], {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[outtype]


def _add_tensor_infos(w, shapes: list[tuple[str, tuple]], extra: list, outtype: str) -> None:
    import numpy as np
    from gguf import GGMLQuantizationType

    for gname, shape in shapes:
        t, d = _target(shape, outtype)
        nbytes = int(np.prod(shape)) * np.dtype(d).itemsize
        w.add_tensor_info(gname, shape, np.dtype(d), nbytes, raw_dtype=t)
    for gname, data in extra:
        w.add_tensor_info(gname, tuple(data.shape), np.dtype(np.float32), data.numel() * 4,
                          raw_dtype=GGMLQuantizationType.F32)


def _hf_tensor(hf: HFModelDir, arch: Arch, cfg: dict, hname: str):
    import torch

    n_head = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_head
    return arch.to_gguf(hname, hf.get_tensor(hname).to(torch.float32), n_head, n_kv)


def _write_tensor_data(w, tensors: list[tuple[str, Callable]], outtype: str, progress: Progress | None) -> None:
    """Write each (GGUF name, loader) in order, one tensor in memory at a time."""
    for i, (gname, load) in enumerate(tensors):
        x = load()
        w.write_tensor_data(_to_numpy(x, _target(tuple(x.shape), outtype)[0]))
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
