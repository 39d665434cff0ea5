"""Tiny random llama / qwen2 / gemma3 / deepseek_v2 / deepseek_v3 models saved as real HF
directories, with a small BPE tokenizer trained here on Python's pydoc text (one per
pre-tokenizer family llama.cpp knows).

Sizes are chosen so K-quants apply (every row length a multiple of 256 but DeepSeek's per-head
key rows, which llama.cpp stores in another type), both Gemma 3 layer kinds (sliding and global)
are exercised on sequences longer than the window, and the DeepSeek models have a dense first
layer, MoE layers of 8 routed experts (2 a token) and YaRN rope whose original context (64) the
test sequences pass. V2 is V2-Lite's shape (one q projection, greedy top-k, softmax, mscale 0.707);
V3 has the q LoRA, sigmoid scores with a nonzero e_score_correction_bias and 4 groups of 2.
"""

from __future__ import annotations

import json
from pathlib import Path

from dsq.formats.tokenizer_gguf import _LLAMA3_RE, _QWEN2_RE


def corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def held_out_text(n_chars: int = 4000) -> str:
    text = corpus()
    return text[len(text) // 2: len(text) // 2 + n_chars]


SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>",
            "<think>", "</think>"]


def train_tokenizer(pre: str, vocab_size: int = 512):
    """A byte-level BPE tokenizer; pre in {"gpt2", "llama3", "qwen2"} picks the split regex."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(ignore_merges=pre == "llama3"))
    if pre == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        regex = _LLAMA3_RE if pre == "llama3" else _QWEN2_RE
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = corpus()
    tok.train_from_iterator((text[i:i + 5000] for i in range(0, 200_000, 5000)), trainer)
    return tok


# DeepSeek's YaRN, its original context short enough for the test sequences to pass
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1}
CONFIGS = {
    "llama": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
        # llama3 rope scaling, as DeepSeek-R1-Distill-Llama uses (small original ctx so it matters)
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu", use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "gemma3": dict(
        model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_size=256, intermediate_size=512,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
        query_pre_attn_scalar=64, max_position_embeddings=512, rms_norm_eps=1e-6, sliding_window=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None, attn_logit_softcapping=None,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "deepseek_v2": dict(
        model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", q_lora_rank=None, kv_lora_rank=256,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=8, n_shared_experts=2,
        moe_intermediate_size=256, num_experts_per_tok=2, first_k_dense_replace=1, topk_method="greedy",
        n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0,
        rope_parameters=dict(YARN, mscale=0.707, mscale_all_dim=0.707)),
    "deepseek_v3": dict(
        model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_size=256, intermediate_size=512,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", q_lora_rank=256, kv_lora_rank=256,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=8, n_shared_experts=1,
        moe_intermediate_size=256, num_experts_per_tok=2, first_k_dense_replace=1, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True,
        rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=1.0)),
}
PRE = {"llama": "llama3", "qwen2": "qwen2", "gemma3": "gpt2", "deepseek_v2": "llama3", "deepseek_v3": "llama3"}
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def build_tiny_model(kind: str, out: Path, seed: int = 0, dtype: str = "float32") -> Path:
    """Save a tiny random `kind` model (weights + tokenizer + chat template) under `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(PRE[kind])
    n_vocab = tok.get_vocab_size()
    cfg_dict = dict(CONFIGS[kind], vocab_size=n_vocab, bos_token_id=tok.token_to_id("<s>"),
                    eos_token_id=tok.token_to_id("</s>"), pad_token_id=tok.token_to_id("<pad>"))
    model_type = cfg_dict.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **cfg_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        # O(1) activations: random weights scaled by fan-in, norms around their identity value
        for name, p in model.named_parameters():
            if "norm" in name:
                base = 0.0 if kind == "gemma3" else 1.0
                p.copy_(base + 0.2 * torch.randn_like(p))
            elif p.ndim == 2:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
            else:
                p.copy_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # V3's expert selection bias
                b.copy_(0.1 * torch.randn_like(b))
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)

    if kind == "llama":
        from tokenizers import processors

        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(out / "tokenizer.json"))
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
          "pad_token": "<pad>", "add_bos_token": kind == "llama", "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2))
    return out


def hf_logits(model_dir: Path, ids: list[int]):
    """Reference logits from transformers, fp32, one sequence. numpy (T, V)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def kld_top1(ref, test) -> tuple[float, float, float]:
    """(mean KL(ref || test), top-1 agreement, max abs logit difference)."""
    import numpy as np

    def logsoftmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lr, lt = logsoftmax(ref.astype(np.float64)), logsoftmax(test.astype(np.float64))
    kld = float((np.exp(lr) * (lr - lt)).sum(-1).mean())
    top1 = float((ref.argmax(-1) == test.argmax(-1)).mean())
    return kld, top1, float(np.abs(ref - test).max())


def stand_in_graphs(monkeypatch):
    """Captured steps (dsq serve's PagedKV.capture and capture_chunks, the native prompt graphs)
    without a GPU: each 'graph' reruns the captured function over its static inputs when replayed,
    and counts its replays."""
    import torch

    from dsq.runtime import native

    class Replay:
        def __init__(self, run, out):
            self.run, self.out, self.replays = run, out, 0

        def replay(self):
            self.out.copy_(self.run())
            self.replays += 1

    def graphed(run, pool=None):
        out = run()
        return Replay(run, out), out

    monkeypatch.setattr(native, "_graphed", graphed)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)


def same_greedy_over_chunk_starts(graphs, eager, prompt: list[int]) -> None:
    """Two NativeModels (prompt graphs on, off) give the same greedy tokens for `prompt`, for the
    same prompt again (its chunks replayed) and for one sharing its first 37 tokens, so that its
    chunks start at other slots than a chunk's multiple."""
    from dsq.runtime.sampling import SamplingParams

    other = prompt[:37] + [11, 12, 13] * 13
    greedy = SamplingParams(temperature=0)
    for p, fresh in ((prompt, True), (prompt, True), (other, False)):
        toks = []
        for m in (graphs, eager):
            if fresh:
                m.reset()
            toks.append([e.token_id for e in m.stream(p, greedy, 8, ignore_eos=True)])
        assert toks[0] == toks[1], (len(p), fresh)
