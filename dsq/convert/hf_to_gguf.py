"""HF safetensors directory -> GGUF (F32/F16/BF16), our own converter for llama, qwen2, gemma3.

Tensor data streams one tensor at a time from memory-mapped safetensors into the output, so a
model larger than RAM converts. The output appears only when complete (temp file + rename).
Reference for the layout: llama.cpp's convert_hf_to_gguf.py (not shipped in the wheel).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from dsq.errors import UnsupportedModel
from dsq.formats.arch import ArchSpec, arch_for_model_type, gemma3_layer_types, head_dim, llama3_rope_factors
from dsq.formats.gguf_types import FTYPES
from dsq.formats.hf import HFModelDir, atomic_output_file, rope_parameters
from dsq.formats.tokenizer_gguf import vocab_from_hf, write_vocab_gguf

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


def _write_hparams(w, spec: ArchSpec, cfg: dict, n_vocab: int) -> None:
    from gguf import RopeScalingType

    n_head = cfg["num_attention_heads"]
    hd = head_dim(cfg)
    w.add_context_length(int(cfg.get("max_position_embeddings", 4096)))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or n_head)
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(n_vocab)
    if cfg.get("head_dim") or spec.gguf_arch == "gemma3":
        w.add_key_length(hd)
        w.add_value_length(hd)
    rope = rope_parameters(cfg, "full_attention")
    w.add_rope_freq_base(float(rope["rope_theta"]))
    if spec.gguf_arch != "gemma3":
        w.add_rope_dimension_count(hd)
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

    if spec.gguf_arch == "gemma3":
        if cfg.get("attn_logit_softcapping"):
            raise UnsupportedModel("Gemma 3 with attn_logit_softcapping is not supported by llama.cpp")
        qpas = cfg.get("query_pre_attn_scalar", hd)
        if qpas != hd and cfg["num_hidden_layers"] != 62:
            raise UnsupportedModel(f"query_pre_attn_scalar {qpas} != head_dim {hd}",
                                   "llama.cpp's gemma3 scales queries by 1/sqrt(head_dim)")
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
        if cfg.get("sliding_window"):
            w.add_sliding_window(int(cfg["sliding_window"]))
            w.add_sliding_window_pattern([t == "sliding_attention" for t in gemma3_layer_types(cfg)])
            w.add_rope_freq_base_swa(float(rope_parameters(cfg, "sliding_attention")["rope_theta"]))


def _plan(hf: HFModelDir, spec: ArchSpec, cfg: dict) -> list[tuple[str, str]]:
    """[(hf name, gguf name)] in output order; refuses tensors it does not know."""
    tied = cfg.get("tie_word_embeddings", spec.gguf_arch == "gemma3")
    pairs = []
    for name in hf.tensor_names():
        if _SKIP.search(name):
            continue
        if name == "lm_head.weight" and tied:
            continue
        g = spec.hf_to_gguf_name(name)
        if g is None:
            raise UnsupportedModel(f"tensor {name} has no GGUF counterpart for {spec.model_type}",
                                   "this checkpoint has parts dsq does not convert yet")
        pairs.append((name, g))

    def key(p):
        m = re.match(r"blk\.(\d+)\.", p[1])
        return (1, int(m.group(1)), p[1]) if m else (0 if p[1].startswith("token_embd") else 2, 0, p[1])

    return sorted(pairs, key=key)


def hf_to_gguf(model_dir: str | Path, out: str | Path, outtype: str = "auto", force: bool = False,
               progress: Progress | None = None, name: str | None = None) -> Path:
    """Convert an HF model directory to a float GGUF at `out`. Returns `out`."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, GGUFWriter

    hf = HFModelDir(model_dir)
    spec = arch_for_model_type(hf.model_type)
    cfg = hf.config
    hf.require(*spec.required)
    outtype = pick_outtype(cfg, outtype)
    pairs = _plan(hf, spec, cfg)
    if not any(g == "token_embd.weight" for _, g in pairs):
        raise UnsupportedModel(f"{hf.path} has no model.embed_tokens.weight", "is this a full checkpoint?")

    shapes = {hname: hf.tensor_shape(hname) for hname, _ in pairs}
    n_vocab = shapes["model.embed_tokens.weight"][0]
    vocab = vocab_from_hf(hf, n_vocab, cfg)
    if len(vocab.tokens) != n_vocab:
        raise UnsupportedModel(f"tokenizer has {len(vocab.tokens)} tokens but the embedding has {n_vocab} rows",
                               "the tokenizer does not belong to these weights")

    n_head = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_head
    rope = rope_parameters(cfg, "full_attention")
    extra = []
    if rope.get("rope_type") == "llama3":
        extra.append(("rope_freqs.weight", llama3_rope_factors(rope, head_dim(cfg))))

    qtype = {"F32": GGMLQuantizationType.F32, "F16": GGMLQuantizationType.F16,
             "BF16": GGMLQuantizationType.BF16}[outtype]
    np_dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[outtype]

    def target(shape) -> tuple:
        return (GGMLQuantizationType.F32, np.float32) if len(shape) == 1 else (qtype, np_dtype)

    with atomic_output_file(Path(out), force=force) as tmp:
        w = GGUFWriter(str(tmp), spec.gguf_arch)
        w.add_name(name or hf.path.name)
        w.add_source_url(f"file://{hf.path.resolve()}")  # lets `dsq eval` find the reference
        w.add_file_type(FTYPES[outtype])
        _write_hparams(w, spec, cfg, n_vocab)
        write_vocab_gguf(w, vocab)
        for hname, gname in pairs:
            t, d = target(shapes[hname])
            nbytes = int(np.prod(shapes[hname])) * np.dtype(d).itemsize
            w.add_tensor_info(gname, shapes[hname], np.dtype(d), nbytes, raw_dtype=t)
        for gname, data in extra:
            w.add_tensor_info(gname, tuple(data.shape), np.dtype(np.float32), data.numel() * 4,
                              raw_dtype=GGMLQuantizationType.F32)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()

        total = len(pairs) + len(extra)
        for i, (hname, gname) in enumerate(pairs):
            x = spec.to_gguf(hname, hf.get_tensor(hname).to(torch.float32), n_head, n_kv)
            w.write_tensor_data(_to_numpy(x, target(tuple(x.shape))[0]))
            if progress:
                progress(gname, i + 1, total)
        for j, (gname, data) in enumerate(extra):
            w.write_tensor_data(data.numpy())
            if progress:
                progress(gname, len(pairs) + j + 1, total)
        w.close()
    return Path(out)


def _to_numpy(x, qtype):
    import torch
    from gguf import GGMLQuantizationType

    if qtype == GGMLQuantizationType.F32:
        return x.to(torch.float32).contiguous().numpy()
    if qtype == GGMLQuantizationType.F16:
        return x.to(torch.float16).contiguous().numpy()
    return x.to(torch.bfloat16).contiguous().view(torch.uint16).numpy()
