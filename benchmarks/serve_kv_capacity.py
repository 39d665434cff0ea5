"""Tokens dsq serve's paged KV cache holds in a GiB, by model shape: a llama's keys and values
against DeepSeek's latent rows (MLA), and what the same DeepSeek model would take with keys and
values for every head at its head widths (plain multi-head attention). From the pool's own sizing
(PagedKV.bytes_per_block), no weights loaded.

    python -m benchmarks.serve_kv_capacity
"""

from __future__ import annotations

from types import SimpleNamespace

GIB = 1 << 30
BLOCK = 16


def _models():
    from dsq.bench.random_models import deepseek_config, shape_args
    from dsq.models.base import KVCache
    from dsq.models.deepseek import args_from_config
    from dsq.models.deepseek_model import MLACache

    yield "llama3-8b", SimpleNamespace(args=shape_args("llama3-8b"), Cache=KVCache), None
    for name, shape, layers in (("deepseek-v2-lite", "deepseek-v2-lite", None),
                                ("deepseek-v3 (61 layers)", "deepseek-v3-slice", 61)):
        a = args_from_config(deepseek_config(shape, layers))
        mha = a.num_hidden_layers * a.num_attention_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim)
        yield name, SimpleNamespace(args=a, Cache=MLACache), mha


def main() -> None:
    import torch

    from dsq.serve.paged import FP8, PagedKV

    print("| model | bytes a token, bf16 | fp8 | tokens a GiB, bf16 | fp8 | keys + values of every head, bf16 | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, m, mha in _models():
        bf, f8 = (PagedKV.bytes_per_block(m, BLOCK, dt) / BLOCK for dt in (torch.bfloat16, FP8))
        plain = f"{mha * 2:,.0f}" if mha else "-"
        ratio = f"{mha * 2 / bf:.1f}x" if mha else "-"
        print(f"| {name} | {bf:,.0f} | {f8:,.0f} | {GIB / bf:,.0f} | {GIB / f8:,.0f} | {plain} | {ratio} |")


if __name__ == "__main__":
    main()
