"""Tokenizers between HF `tokenizer.json` and GGUF `tokenizer.ggml.*` metadata, both ways.

Two families cover the models dsq converts:
- byte-level BPE ("gpt2" in GGUF: Llama 3, Qwen2, DeepSeek): tokens + merges + a pre-tokenizer
  name that selects llama.cpp's split regexes;
- SentencePiece BPE ("llama" in GGUF: Gemma, Llama 2): tokens + scores; llama.cpp merges the
  adjacent pair whose concatenation has the highest score. HF expresses the same as a BPE model
  with byte fallback whose merges are ordered by that score (transformers' SentencePieceExtractor).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsq.errors import UnsupportedModel

# GGUF token types (llama.cpp llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Split regexes of each llama.cpp pre-tokenizer, as HF tokenizer.json writes them.
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DS3_RES = [
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
# pre name -> split regexes (None: ByteLevel's own gpt2 regex)
PRE_REGEXES: dict[str, list[str] | None] = {
    "gpt-2": None,
    "llama-bpe": [_LLAMA3_RE],
    "qwen2": [_QWEN2_RE],
    "deepseek-r1-qwen": [_QWEN2_RE],
    "deepseek-v3": _DS3_RES,
}
_PRE_ALIASES = {"gpt2": "gpt-2", "default": "gpt-2", "llama3": "llama-bpe", "llama-v3": "llama-bpe"}
_IGNORE_MERGES = {"llama-bpe"}


@dataclass
class Vocab:
    """A tokenizer in GGUF's terms; the bridge between both formats."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE)
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    pre: str | None = None
    special: dict[str, int] = field(default_factory=dict)  # bos/eos/unk/pad/eot -> id
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = False
    chat_template: str | None = None

    def token(self, kind: str) -> str | None:
        i = self.special.get(kind)
        return self.tokens[i] if i is not None and 0 <= i < len(self.tokens) else None


# ---------------------------------------------------------------------------------------------
# HF -> Vocab
# ---------------------------------------------------------------------------------------------
def _merge_str(m: Any) -> str:
    return m if isinstance(m, str) else f"{m[0]} {m[1]}"


def _detect_pre(pre_tok: dict | None) -> str:
    if pre_tok is None:
        raise UnsupportedModel("tokenizer.json has a byte-level BPE model but no pre-tokenizer",
                               "this tokenizer is not one llama.cpp can reproduce")
    if pre_tok.get("type") == "ByteLevel" and pre_tok.get("use_regex", True):
        return "gpt-2"
    if pre_tok.get("type") == "Sequence":
        splits = []
        for p in pre_tok.get("pretokenizers", []):
            if p.get("type") == "Split":
                pat = p.get("pattern", {})
                splits.append(pat.get("Regex", pat.get("String")))
            elif p.get("type") == "ByteLevel" and p.get("use_regex", True):
                splits.append(_GPT2_RE)
        for name, regs in PRE_REGEXES.items():
            if regs is not None and splits == regs:
                return name
        if splits == [_GPT2_RE]:
            return "gpt-2"
    raise UnsupportedModel(
        "tokenizer.json uses a pre-tokenizer llama.cpp has no match for",
        f"known: {', '.join(PRE_REGEXES)}",
    )


def _is_spm_style(tj: dict) -> bool:
    m = tj.get("model", {})
    if not m.get("byte_fallback"):
        return False
    blob = json.dumps([tj.get("normalizer"), tj.get("pre_tokenizer"), tj.get("decoder")], ensure_ascii=False)
    return "\u2581" in blob or "Metaspace" in blob


def _add_space_prefix(tj: dict) -> bool:
    norm, pre = tj.get("normalizer") or {}, tj.get("pre_tokenizer") or {}
    parts = norm.get("normalizers", [norm])
    if any(p.get("type") == "Prepend" for p in parts):
        return True
    pres = pre.get("pretokenizers", [pre])
    return any(p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never"
               and p.get("add_prefix_space", True) for p in pres)


def _token_content(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


def vocab_from_hf(model_dir, vocab_size: int, config: dict) -> Vocab:
    """Read tokenizer.json (+ tokenizer_config.json) of an HFModelDir into a Vocab."""
    tj = model_dir.tokenizer_json()
    if tj is None:
        raise UnsupportedModel(f"{model_dir.path} has no tokenizer.json",
                               "dsq needs a fast tokenizer (tokenizer.json) to write the GGUF vocabulary")
    m = tj.get("model", {})
    if m.get("type") != "BPE":
        raise UnsupportedModel(f"tokenizer model {m.get('type')!r} is not supported",
                               "dsq converts BPE tokenizers (byte-level or SentencePiece-style)")
    id_to_tok: dict[int, str] = {i: t for t, i in m["vocab"].items()}
    added = {a["id"]: a for a in tj.get("added_tokens", [])}
    for i, a in added.items():
        id_to_tok[i] = a["content"]
    n = max(vocab_size, max(id_to_tok) + 1)
    spm = _is_spm_style(tj)
    merges = [_merge_str(x) for x in m.get("merges", [])]

    tokens, types = [], []
    for i in range(n):
        t = id_to_tok.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
            continue
        tokens.append(t)
        if i in added:
            types.append(CONTROL if added[i].get("special") else USER_DEFINED)
        elif spm and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            types.append(BYTE)
        elif t == m.get("unk_token"):
            types.append(UNKNOWN)
        else:
            types.append(NORMAL)

    v = Vocab(model="llama" if spm else "gpt2", tokens=tokens, token_types=types)
    if spm:
        # llama.cpp merges by score: the earlier the merge that creates a token, the higher.
        score = {t: 0.0 for t in tokens}
        seen = set()
        for rank, mg in enumerate(merges):
            a, _, b = mg.partition(" ")
            t = a + b
            if t not in seen:
                seen.add(t)
                score[t] = -float(rank + 1)
        v.scores = [score[t] for t in tokens]
        v.pre = "default"
        v.add_space_prefix = _add_space_prefix(tj)
    else:
        v.merges = merges
        v.pre = _detect_pre(tj.get("pre_tokenizer"))

    tc = model_dir.tokenizer_config()
    lookup = {t: i for i, t in enumerate(tokens)}
    for kind in ("bos", "eos", "unk", "pad"):
        name = _token_content(tc.get(f"{kind}_token"))
        if name is not None and name in lookup:
            v.special[kind] = lookup[name]
        elif isinstance(config.get(f"{kind}_token_id"), int):
            v.special[kind] = config[f"{kind}_token_id"]
        elif isinstance(config.get(f"{kind}_token_id"), list) and config[f"{kind}_token_id"]:
            v.special[kind] = config[f"{kind}_token_id"][0]
    for eot in ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end_of_text|>"):
        if eot in lookup and types[lookup[eot]] == CONTROL:
            v.special.setdefault("eot", lookup[eot])
            break
    if "add_bos_token" in tc:
        v.add_bos = bool(tc["add_bos_token"])
    else:
        post = json.dumps(tj.get("post_processor") or {})
        bos = v.token("bos")
        v.add_bos = bool(bos) and "TemplateProcessing" in post and json.dumps(bos) in post
    v.add_eos = bool(tc.get("add_eos_token", False))
    v.chat_template = model_dir.chat_template()
    return v


# ---------------------------------------------------------------------------------------------
# Vocab <-> GGUF
# ---------------------------------------------------------------------------------------------
def write_vocab_gguf(writer, v: Vocab) -> None:
    writer.add_tokenizer_model(v.model)
    if v.pre:
        writer.add_tokenizer_pre(v.pre)
    writer.add_token_list(v.tokens)
    writer.add_token_types(v.token_types)
    if v.scores is not None:
        writer.add_token_scores(v.scores)
    if v.merges is not None:
        writer.add_token_merges(v.merges)
    ids = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id, "unk": writer.add_unk_token_id,
           "pad": writer.add_pad_token_id, "eot": writer.add_eot_token_id}
    for kind, fn in ids.items():
        if kind in v.special:
            fn(int(v.special[kind]))
    writer.add_add_bos_token(v.add_bos)
    writer.add_add_eos_token(v.add_eos)
    if v.model == "llama":
        writer.add_add_space_prefix(v.add_space_prefix)
    if v.chat_template:
        writer.add_chat_template(v.chat_template)


def vocab_from_gguf(g) -> Vocab:
    """Read the tokenizer of a GGUFFile."""
    model = g.field("tokenizer.ggml.model")
    tokens = g.field("tokenizer.ggml.tokens")
    if not model or tokens is None:
        raise UnsupportedModel(f"{g.path} carries no tokenizer", "convert it again with its tokenizer")
    if model not in ("gpt2", "llama"):
        raise UnsupportedModel(f"GGUF tokenizer model {model!r} cannot be exported",
                               "supported: gpt2 (byte-level BPE), llama (SentencePiece)")
    types = g.field("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    v = Vocab(model=model, tokens=list(tokens), token_types=[int(t) for t in types])
    v.scores = g.field("tokenizer.ggml.scores")
    v.merges = g.field("tokenizer.ggml.merges")
    v.pre = g.field("tokenizer.ggml.pre")
    for kind, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                      ("pad", "padding_token_id"), ("eot", "eot_token_id")):
        val = g.field(f"tokenizer.ggml.{key}")
        if val is not None:
            v.special[kind] = int(val)
    v.add_bos = bool(g.field("tokenizer.ggml.add_bos_token", model == "llama"))
    v.add_eos = bool(g.field("tokenizer.ggml.add_eos_token", False))
    v.add_space_prefix = bool(g.field("tokenizer.ggml.add_space_prefix", model == "llama"))
    v.chat_template = g.field("tokenizer.chat_template")
    return v


# ---------------------------------------------------------------------------------------------
# Vocab -> HF tokenizer files
# ---------------------------------------------------------------------------------------------
def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """All (a, b) with a, b, a+b in the vocabulary, ordered by the score of a+b (best first)."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED, UNKNOWN, CONTROL)}
    out = []
    for t, i in ids.items():
        local = []
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in ids and b in ids:
                local.append((ids[a], ids[b], a, b))
        local.sort()
        out.extend((-scores[i], n, a, b) for n, (_, _, a, b) in enumerate(local))
    out.sort(key=lambda x: x[0])  # stable: ties keep vocabulary order, as sentencepiece does
    return [(a, b) for _, _, a, b in out]


def build_hf_tokenizer(v: Vocab):
    """A `tokenizers.Tokenizer` equivalent to llama.cpp's tokenization of this Vocab."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {t: i for i, t in enumerate(v.tokens)}
    if len(vocab) != len(v.tokens):  # duplicate strings: keep the first id
        vocab = {}
        for i, t in enumerate(v.tokens):
            vocab.setdefault(t, i)
    if v.model == "gpt2":
        pre = _PRE_ALIASES.get(v.pre or "gpt-2", v.pre or "gpt-2")
        if pre not in PRE_REGEXES:
            raise UnsupportedModel(f"GGUF pre-tokenizer {v.pre!r} cannot be exported to HF yet",
                                   f"supported: {', '.join(PRE_REGEXES)}")
        merges = [tuple(m.split(" ", 1)) for m in (v.merges or [])]
        tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES))
        regs = PRE_REGEXES[pre]
        if regs is None:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regs]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
    else:
        if v.scores is None:
            raise UnsupportedModel("SentencePiece GGUF vocabulary without scores", "convert the model again")
        unk = v.token("unk")
        merges = _spm_merges(v.tokens, list(v.scores), v.token_types)
        tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
        norms = [normalizers.Replace(" ", "\u2581")]
        if v.add_space_prefix:
            norms.insert(0, normalizers.Prepend("\u2581"))
        tok.normalizer = normalizers.Sequence(norms)
        decs = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if v.add_space_prefix:
            decs.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(decs)

    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(v.tokens, v.token_types) if ty == CONTROL]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(v.tokens, v.token_types) if ty == USER_DEFINED]
    tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    bos = v.token("bos")
    if v.add_bos and bos:
        from tokenizers import processors

        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, v.special["bos"])])
    return tok


def write_hf_tokenizer(v: Vocab, out_dir: Path, model_max_length: int | None = None,
                       chat_template: str | None = None) -> None:
    from dsq.formats.hf import write_json

    out_dir = Path(out_dir)
    build_hf_tokenizer(v).save(str(out_dir / "tokenizer.json"))
    tc: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": v.add_bos,
        "add_eos_token": v.add_eos,
        "clean_up_tokenization_spaces": False,
    }
    for kind in ("bos", "eos", "unk", "pad"):
        t = v.token(kind)
        if t is not None:
            tc[f"{kind}_token"] = t
    if model_max_length:
        tc["model_max_length"] = int(model_max_length)
    template = v.chat_template or chat_template
    if template:
        tc["chat_template"] = template
    write_json(out_dir / "tokenizer_config.json", tc)
