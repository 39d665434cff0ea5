"""Small valid inputs the mutators start from, made by dsq itself (cached per directory)."""

from __future__ import annotations

import json
from pathlib import Path

# A template of the kind models ship (ChatML with a system turn and a generation prompt).
TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] not in ['user', 'assistant'] %}{{ raise_exception('unknown role') }}{%- endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def gguf_seeds(root: Path) -> list[Path]:
    """Tiny random GGUFs: Q8_0 (llama layout) and Q4_K_M (qwen2 layout) with SentencePiece
    vocabularies, and F16 (qwen2) with a byte-level BPE one, as the R1-Distill models have."""
    from dsq.bench.random_gguf import write_random_gguf

    out = []
    for shape, mix in (("tiny", "Q8_0"), ("tiny-qwen2", "Q4_K_M")):
        p = root / f"{shape}-{mix}.gguf"
        if not p.is_file():
            write_random_gguf(p, shape, mix, seed=0, vocab_pad="unused")  # the regressions' seeds, byte for byte
        out.append(p)
    return out + [bpe_gguf_seed(root)]


def bpe_gguf_seed(root: Path) -> Path:
    """A qwen2-layout GGUF (F16) whose vocabulary is a byte-level BPE trained here on Python's docs."""
    from dsq.bench.random_models import write_random_hf
    from dsq.convert.hf_to_gguf import hf_to_gguf

    out = root / "tiny-qwen2-bpe-F16.gguf"
    if out.is_file():
        return out
    d = write_random_hf("tiny-qwen2", root / "tiny-qwen2-bpe-hf")
    tok = _bpe(json.loads((d / "config.json").read_text())["vocab_size"])
    tok.save(str(d / "tokenizer.json"))
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
          "chat_template": TEMPLATE}
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    return hf_to_gguf(d, out, "F16")


def _bpe(vocab_size: int):
    from pydoc_data.topics import topics
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from dsq.formats.tokenizer_gguf import _QWEN2_RE

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_QWEN2_RE), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = "\n\n".join(topics[k] for k in sorted(topics))
    tok.train_from_iterator((text[i:i + 5000] for i in range(0, 200_000, 5000)), trainer)
    return tok


def hf_seed(root: Path) -> Path:
    """An HF directory (config.json, one safetensors file, tokenizer files) from the Q8_0 seed."""
    from dsq.convert.gguf_to_hf import gguf_to_hf

    d = root / "tiny-hf"
    if not (d / "config.json").is_file():
        gguf_to_hf(gguf_seeds(root)[0], d, "bfloat16", progress=lambda *_: None)
    return d


def template_seeds() -> list[str]:
    from dsq.runtime.chat_template import CHATML_TEMPLATE, GEMMA_TEMPLATE, LLAMA3_TEMPLATE

    return [TEMPLATE, CHATML_TEMPLATE, GEMMA_TEMPLATE, LLAMA3_TEMPLATE]


def config_seed(root: Path) -> dict:
    return json.loads((hf_seed(root) / "config.json").read_text())
