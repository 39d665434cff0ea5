"""What the placement plan needs to know about a model, read from a GGUF file or an HF directory
without loading its weights: layer count, widths, and the bytes of every tensor at its stored type."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ModelShape:
    """What the planner needs to know about a model, read from GGUF or HF."""

    name: str
    arch: str
    n_layer: int
    n_ctx_train: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_vocab: int
    n_ff: int
    layers: list[dict[str, int]]  # per block: type -> bytes
    embed_bytes: int
    output_bytes: int  # the output head (tied models: a copy of the embedding)
    output_type: str
    misc_bytes: int  # norms and other small non-block tensors
    swa_layers: list[bool]
    sliding_window: int = 0
    tied: bool = False  # the output head is the token embedding (one tensor in the file)
    expert_bytes: list[int] | None = None  # per block: bytes of its routed experts (None: no MoE)
    n_expert: int = 0  # routed experts in each MoE block
    n_expert_used: int = 0  # of which a token runs this many

    def read_bytes(self, i: int, stored: int) -> int:
        """Of block i's `stored` weight bytes, those a decoded token reads: all but the routed
        experts, and of those the share a token runs (n_expert_used of n_expert)."""
        e = self.expert_bytes[i] if self.expert_bytes else 0
        if not e or not self.n_expert:
            return stored
        share = e * stored // max(1, sum(self.layers[i].values()))  # the experts' bytes as `stored` counts them
        return stored - share + share * self.n_expert_used // self.n_expert


def shape_from_gguf(path: Path) -> ModelShape:
    from dsq.formats.gguf_file import GGUFFile

    g = GGUFFile(path)
    a = g.arch_field
    n_layer = g.n_layers
    layers: list[dict[str, int]] = [dict() for _ in range(n_layer)]
    experts = [0] * n_layer
    embed = output = misc = 0
    out_type = ""
    for t in g.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m and int(m.group(1)) < n_layer:
            d = layers[int(m.group(1))]
            d[t.type_name] = d.get(t.type_name, 0) + t.n_bytes
            if "_exps." in t.name:
                experts[int(m.group(1))] += t.n_bytes
        elif t.name == "token_embd.weight":
            embed = t.n_bytes
            if not out_type:
                out_type = t.type_name
        elif t.name == "output.weight":
            output, out_type = t.n_bytes, t.type_name
        else:
            misc += t.n_bytes
    tied = output == 0
    if tied:  # llama.cpp duplicates the embedding as the output head
        output = embed
    n_embd = int(a("embedding_length", 0))
    n_head = int(a("attention.head_count", 1) or 1)
    if isinstance(a("attention.head_count"), list):
        n_head = max(a("attention.head_count"))
    n_head_kv = a("attention.head_count_kv", n_head)
    n_head_kv = max(n_head_kv) if isinstance(n_head_kv, list) else int(n_head_kv)
    hk = int(a("attention.key_length", n_embd // max(1, n_head)))
    hv = int(a("attention.value_length", hk))
    if a("attention.key_length_mla") is not None:  # MLA caches latent keys only, which are the values too
        hv = 0
    window = int(a("attention.sliding_window", 0) or 0)
    swa = _gguf_sliding_layers(g, window, n_layer)
    tokens = g.field("tokenizer.ggml.tokens")
    ff = a("feed_forward_length", 0)
    return ModelShape(g.name, g.arch, n_layer, int(a("context_length", 4096)), n_embd, n_head, n_head_kv,
                      hk, hv, len(tokens) if tokens else 0, max(ff) if isinstance(ff, list) else int(ff),
                      layers, embed, output, out_type, misc, swa, window, tied, experts if any(experts) else None,
                      int(a("expert_count", 0) or 0), int(a("expert_used_count", 0) or 0))


def _gguf_sliding_layers(g, window: int, n_layer: int) -> list[bool]:
    """Per layer: sliding-window attention? A pattern list says; else the architecture's period."""
    from dsq.models.arch import sliding_from_gguf
    from dsq.models.registry import find_gguf

    pattern = g.arch_field("attention.sliding_window_pattern")
    entry = find_gguf(g.arch)
    period = entry.sliding_period if entry else 0
    if isinstance(pattern, list) or (window and period):
        return sliding_from_gguf(pattern, n_layer, period)[:n_layer]
    return [False] * n_layer


def _hf_sliding_layers(cfg: dict, window: int, n_layer: int) -> list[bool]:
    from dsq.models.registry import find_model_type

    arch = find_model_type(cfg.get("model_type", ""))
    if window and arch and arch.sliding_layers:
        return arch.sliding_layers(cfg)
    return [False] * n_layer


def shape_from_hf(path: Path) -> ModelShape:
    from dsq.formats.hf import HFModelDir

    hf = HFModelDir(path)
    cfg = hf.config
    hf.require("num_hidden_layers", "hidden_size", "num_attention_heads")
    n_layer = cfg["num_hidden_layers"]
    layers: list[dict[str, int]] = [dict() for _ in range(n_layer)]
    experts = [0] * n_layer
    embed = output = misc = 0
    out_type = ""
    for name in hf.tensor_names():
        sl = hf._handle(name).get_slice(name)
        dtype = sl.get_dtype()
        n = 1
        for d in sl.get_shape():
            n *= d
        nbytes = n * {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "I32": 4, "I8": 1, "U8": 1}.get(dtype, 2)
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m and int(m.group(1)) < n_layer:
            d = layers[int(m.group(1))]
            d[dtype] = d.get(dtype, 0) + nbytes
            if ".mlp.experts." in name:
                experts[int(m.group(1))] += nbytes
        elif m:  # layers past num_hidden_layers (DeepSeek-V3's next-token block) are not run
            continue
        elif name.endswith("embed_tokens.weight"):
            embed, out_type = nbytes, out_type or dtype
        elif name == "lm_head.weight":
            output, out_type = nbytes, dtype
        else:
            misc += nbytes
    tied = output == 0
    output = output or embed
    n_kv, hk, hv = _kv_heads(cfg)
    window = int(cfg.get("sliding_window") or 0)
    swa = _hf_sliding_layers(cfg, window, n_layer)
    return ModelShape(path.name, cfg.get("model_type", "?"), n_layer, int(cfg.get("max_position_embeddings", 4096)),
                      cfg["hidden_size"], cfg["num_attention_heads"], n_kv, hk, hv,
                      int(cfg.get("vocab_size", 0)), int(cfg.get("intermediate_size", 0)), layers, embed, output,
                      out_type, misc, swa, window, tied, experts if any(experts) else None,
                      int(cfg.get("n_routed_experts") or 0), int(cfg.get("num_experts_per_tok") or 0))


def _kv_heads(cfg: dict) -> tuple[int, int, int]:
    """(cached heads, key width, value width) per token and layer: MLA caches one latent row
    (kv_lora_rank + rope dims) that is its own value; others their key and value heads."""
    from dsq.models.arch import head_dim

    if cfg.get("kv_lora_rank"):
        return 1, int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0), 0
    hd = head_dim(cfg)
    return cfg.get("num_key_value_heads") or cfg["num_attention_heads"], hd, hd


def load_shape(model: str | Path | ModelShape) -> ModelShape:
    """A ModelShape as it is, or read from a GGUF file or an HF directory."""
    if isinstance(model, ModelShape):
        return model
    p = Path(model)
    return shape_from_hf(p) if p.is_dir() else shape_from_gguf(p)


def n_layer_of(model: str | Path) -> int:
    """The model's repeating layer count, from GGUF metadata or config.json (no tensor is read)."""
    p = Path(model)
    if p.is_dir():
        from dsq.formats.hf import HFModelDir

        return int(HFModelDir(p).config["num_hidden_layers"])
    from dsq.formats.gguf_file import GGUFFile

    return GGUFFile(p).n_layers
