"""Random-weight models of named shapes, for benchmarks and tests where no checkpoint can be had.

- `SHAPES`: model shapes by name (ModelArgs fields), from a tiny one to Llama-3-8B and Qwen2-7B
  (qwen2 shapes: q/k/v biases; 1.5B and tiny-qwen2 tie the embeddings).
- `DEEPSEEK_SHAPES`: DeepSeek V2 / V3 shapes as their HF config.json fields (MLA + MoE):
  DeepSeek-V2-Lite's, a slice of DeepSeek-V3 at its real widths, and tiny ones for tests.
- `random_transformer`: a torch model of a shape, built on a device (seconds for 8B on a GPU).
- `write_random_hf`: the same as an HF safetensors directory (what the quantizers read).
- `write_random_awq`: an AWQ directory of a shape with random codes, the twin of the random GGUF of
  that shape (same vocabulary): `python -m dsq.bench.random_models OUT --shape llama3-8b`.
- `random_packed`: one weight in the GPU kernels' packed layout, random codes and sane scales.

Random GGUF files of a shape in a llama.cpp type mix: `dsq.bench.random_gguf`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SHAPES = {
    "tiny": dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
                 max_position_embeddings=2048, rope={"rope_type": "default", "rope_theta": 10000.0}),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                      max_position_embeddings=131072,
                      rope={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "qwen2-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-6,
                       max_position_embeddings=32768, rope={"rope_type": "default", "rope_theta": 1000000.0},
                       attention_bias=True, tie_word_embeddings=True),
    "qwen2-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6,
                     max_position_embeddings=32768, rope={"rope_type": "default", "rope_theta": 1000000.0},
                     attention_bias=True, tie_word_embeddings=False),
    # the qwen2 layout (q/k/v biases, tied embeddings) at the tiny shape's size, for tests
    "tiny-qwen2": dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
                       max_position_embeddings=2048, rope={"rope_type": "default", "rope_theta": 1000000.0},
                       attention_bias=True, tie_word_embeddings=True),
}


# YaRN as DeepSeek's checkpoints set it (4k trained context stretched 40x)
_DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                  "beta_fast": 32, "beta_slow": 1}
_V2 = dict(model_type="deepseek_v2", topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False,
           routed_scaling_factor=1.0, q_lora_rank=None, rope=dict(_DEEPSEEK_YARN, mscale=0.707, mscale_all_dim=0.707))
_V3 = dict(model_type="deepseek_v3", topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=2.5,
           rope=dict(_DEEPSEEK_YARN, mscale=1.0, mscale_all_dim=1.0))
_MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rms_norm_eps=1e-6,
            max_position_embeddings=163840, tie_word_embeddings=False)
DEEPSEEK_SHAPES = {
    # deepseek-ai/DeepSeek-V2-Lite's config.json: 15.7B parameters, 2.4B active
    "deepseek-v2-lite": dict(_V2, **_MLA, vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                             num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
                             n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                             moe_intermediate_size=1408, first_k_dense_replace=1),
    # deepseek-ai/DeepSeek-V3's widths (671B: 61 layers, the first 3 dense), 4 layers: 1 dense, 3 MoE
    "deepseek-v3-slice": dict(_V3, **_MLA, vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                              num_hidden_layers=4, num_attention_heads=128, num_key_value_heads=128,
                              q_lora_rank=1536, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
                              moe_intermediate_size=2048, first_k_dense_replace=1, n_group=8, topk_group=4),
    # the two routing schemes at a size for tests: a dense layer, then MoE layers of 8 experts, 2 a token
    "tiny-deepseek-v2": dict(_V2, **dict(_MLA, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
                                         v_head_dim=64, max_position_embeddings=2048),
                             vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=2,
                             num_experts_per_tok=2, moe_intermediate_size=256, first_k_dense_replace=1),
    "tiny-deepseek-v3": dict(_V3, **dict(_MLA, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
                                         v_head_dim=64, max_position_embeddings=2048),
                             vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=256, n_routed_experts=8,
                             n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=256,
                             first_k_dense_replace=1, n_group=4, topk_group=2),
}


def deepseek_config(shape: str, layers: int | None = None) -> dict:
    """The HF config.json of a DEEPSEEK_SHAPES shape (`layers` overrides its depth)."""
    cfg = dict(DEEPSEEK_SHAPES[shape])
    cfg["rope_parameters"] = cfg.pop("rope")
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    return cfg


def shape_args(shape: str, layers: int | None = None):
    """ModelArgs of a named shape (`layers` overrides its depth)."""
    from dsq.models.base import ModelArgs

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    s = dict(SHAPES[shape])
    if layers is not None:
        s["num_hidden_layers"] = layers
    return ModelArgs(**s)


def _fill(name: str, shape, g: torch.Generator, device) -> torch.Tensor:
    """Norm weights near 1, everything else N(0, 0.02): a trained model's range."""
    t = torch.randn(shape, generator=g, device=device)
    return 1 + 0.05 * t if "norm" in name else 0.02 * t


def random_transformer(shape: str, device: str = "cuda", dtype=torch.bfloat16, layers: int | None = None,
                       seed: int = 0):
    """(model, args): a Transformer of `shape` with seeded random weights on `device`."""
    from dsq.models.base import Transformer

    args = shape_args(shape, layers)
    with torch.device("meta"):
        m = Transformer(args).to(dtype)
    m = m.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(_fill(n, p.shape, g, device))
    m.tie_weights()
    return m.eval(), args


class _Shards:
    """Tensors into safetensors shards of ~1B values in `out`, then their index."""

    def __init__(self, out: Path):
        self.out, self.shard, self.index = out, {}, {}

    def add(self, name: str, t: torch.Tensor) -> None:
        self.shard[name] = t
        if sum(x.numel() for x in self.shard.values()) > 1_000_000_000:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if self.shard:
            name = f"model-{len(set(self.index.values())):05d}.safetensors"
            save_file(self.shard, str(self.out / name), metadata={"format": "pt"})
            self.index.update({k: name for k in self.shard})
            self.shard = {}

    def close(self) -> None:
        self.flush()
        (self.out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": self.index}))


def write_random_hf(shape: str, out: Path, layers: int | None = None, seed: int = 0) -> Path:
    """A bf16 HF directory of `shape` at `out` (kept if it already holds a config). Shards of ~1B
    weights; random numbers are drawn on a GPU when there is one (seconds for 8B)."""
    from dsq.models.base import Transformer

    if (out / "config.json").is_file():
        return out
    args = shape_args(shape, layers)
    out.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = Transformer(args)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed)
    shards = _Shards(out)
    for name, p in model.named_parameters():
        if name == "lm_head.weight" and args.tie_word_embeddings:
            continue
        shards.add(name, _fill(name, p.shape, g, dev).to(torch.bfloat16).cpu())
    shards.close()
    (out / "config.json").write_text(json.dumps(hf_config(shape, args, "bfloat16"), indent=2))
    return out


def hf_config(shape: str, args, dtype: str) -> dict:
    """config.json of a SHAPES shape (llama, or qwen2 where it has q/k/v biases)."""
    s = SHAPES[shape]
    qwen = bool(s.get("attention_bias"))
    return {"model_type": "qwen2" if qwen else "llama",
            "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
            "hidden_size": args.hidden_size, "intermediate_size": args.intermediate_size,
            "num_hidden_layers": args.num_hidden_layers, "num_attention_heads": args.num_attention_heads,
            "num_key_value_heads": args.num_key_value_heads, "head_dim": args.head_dim, "vocab_size": args.vocab_size,
            "rms_norm_eps": args.rms_norm_eps, "max_position_embeddings": args.max_position_embeddings,
            "rope_scaling": {k: v for k, v in s["rope"].items() if k != "rope_theta"},
            "rope_theta": s["rope"]["rope_theta"], "tie_word_embeddings": args.tie_word_embeddings,
            "torch_dtype": dtype}


def write_random_awq(shape: str, out: Path, layers: int | None = None, seed: int = 0, force: bool = False) -> Path:
    """An AWQ (GEMM, 4-bit, g128) HF directory of `shape` at `out`, random codes and sane scales,
    with the synthetic SentencePiece vocabulary of `dsq.bench.random_gguf` as its tokenizer.json, so
    it is the random GGUF's twin: same shape, same vocabulary, prompts tokenize alike. Written to a
    temp directory and renamed. Packed words are drawn whole (any int32 holds 8 valid codes), zero
    points 7 and 8 by turns (the codes' mean, 7.5), scales ~2.7e-3: weights within +-0.03 around
    0, a trained model's range."""
    import shutil

    from dsq.bench.random_gguf import synthetic_vocab
    from dsq.formats.awq_gptq import awq_config
    from dsq.formats.tokenizer_gguf import write_hf_tokenizer
    from dsq.models.base import Transformer

    if (out / "config.json").is_file() and not force:
        return out
    args = shape_args(shape, layers)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with torch.device("meta"):
        model = Transformer(args)
    g = torch.Generator().manual_seed(seed)
    G = 128
    shards = _Shards(tmp)
    for name, p in model.named_parameters():
        if name == "lm_head.weight" and args.tie_word_embeddings:
            continue
        if ".layers." in name and name.endswith("proj.weight"):
            N, K = p.shape
            stem = name.removesuffix(".weight")
            shards.add(stem + ".qweight", torch.randint(-2**31, 2**31, (K, N // 8), generator=g, dtype=torch.int32))
            shards.add(stem + ".qzeros", torch.full((K // G, N // 8), 0x78787878, dtype=torch.int32))
            shards.add(stem + ".scales", (0.02 / 7.5 * (0.5 + torch.rand(K // G, N, generator=g))).half())
        else:
            shards.add(name, _fill(name, p.shape, g, "cpu").half())
    shards.close()
    cfg = hf_config(shape, args, "float16")
    cfg["quantization_config"] = awq_config(G, None)
    cfg.update(bos_token_id=1, eos_token_id=2)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    write_hf_tokenizer(synthetic_vocab(args.vocab_size), tmp, model_max_length=args.max_position_embeddings)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main(argv=None) -> None:
    """python -m dsq.bench.random_models OUT --shape llama3-8b: a random AWQ twin of the GGUF that
    `python -m dsq.bench.random_gguf` writes of the same shape."""
    import argparse

    ap = argparse.ArgumentParser(description="Write a random-weight AWQ (4-bit, g128) HF directory of a shape.")
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, help="override the shape's number of layers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="replace an existing directory")
    a = ap.parse_args(argv)
    out = write_random_awq(a.shape, a.out, a.layers, a.seed, a.force)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{out}: {size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()


def random_packed(fmt: str, N: int, K: int, device: str = "cuda"):
    """A Packed weight (N, K) of `fmt` (int4-g128[-actorder], int8-channel, fp8-channel, fp8-block,
    or a GGUF block type) with random codes and sane scales, built on the device."""
    from dsq.kernels import gguf_ref, packed

    g = torch.Generator(device=device).manual_seed(N * 31 + K)
    if fmt.startswith("int"):
        bits = 4 if fmt.startswith("int4") else 8
        G = K // 128 if "g128" in fmt else 1
        q = torch.randint(0, 2**bits, (N, K), generator=g, device=device)
        qw = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8) if bits == 4 else q.to(torch.uint8)
        sc = (torch.rand(N, G, generator=g, device=device) * 1e-3).half()
        zp = torch.randint(0, 2**bits, (N, G), generator=g, device=device).to(torch.uint8)
        perm = torch.randperm(K, generator=g, device=device) if "actorder" in fmt else None
        return packed.from_int(qw, sc, zp, bits, perm)
    if fmt.startswith("fp8"):
        w = (torch.randn(N, K, generator=g, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        s = torch.rand(N, 1, generator=g, device=device) if fmt == "fp8-channel" else \
            torch.rand(-(-N // 128), -(-K // 128), generator=g, device=device)
        return packed.from_fp8(w, s * 1e-4)
    per, nbytes = gguf_ref.BLOCKS[fmt]
    raw = torch.randint(0, 256, (N, K // per, nbytes), generator=g, device=device, dtype=torch.uint8)
    f16 = {"Q4_0": [0], "Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}[fmt]
    for off in f16:
        raw[..., off:off + 2] = (torch.rand(N, K // per, generator=g, device=device) * 1e-4).half() \
            .view(torch.uint8).reshape(N, K // per, 2)
    return packed.from_gguf(raw.reshape(N, -1), fmt, K)
