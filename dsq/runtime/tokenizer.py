"""Tokenizers for the native runtime.

- HF directories: `tokenizer.json` through the `tokenizers` library, special tokens and chat
  template from tokenizer_config.json / generation_config.json.
- GGUF files: the vocabulary exactly as llama.cpp tokenizes it, through a vocab-only llama.cpp
  load (no weights are read).

Both give token ids, end-of-generation ids, and a streaming detokenizer that only emits complete
UTF-8 text.
"""

from __future__ import annotations

import codecs
from pathlib import Path

from dsq.errors import BadModelFile

# end-of-turn tokens of the chat formats dsq knows; they end generation when present
EOT_TOKENS = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<｜end▁of▁sentence｜>", "<|end_of_text|>", "<|eom_id|>")


class HFTokenizer:
    def __init__(self, path: Path, config: dict):
        from tokenizers import Tokenizer

        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise BadModelFile(f"{path} has no tokenizer.json", "the native runtime needs a fast tokenizer file")
        from dsq.formats.hf import HFModelDir

        hf = HFModelDir(path)
        try:
            self.tok = Tokenizer.from_file(str(tj))
        except Exception as e:  # the tokenizers library's errors for a malformed file
            raise BadModelFile(f"{tj} is not a tokenizer the tokenizers library reads ({str(e)[:120]})",
                               "re-download the tokenizer files") from None
        tc = hf.tokenizer_config()
        self._template = hf.chat_template()

        self.bos_token = _token_text(tc.get("bos_token"))
        self.eos_token = _token_text(tc.get("eos_token"))
        bos_id = self.tok.token_to_id(self.bos_token) if self.bos_token else None
        if bos_id is None and _token_ids(config.get("bos_token_id")) and not isinstance(config["bos_token_id"], list):
            bos_id = config["bos_token_id"]
            if bos_id >= self.tok.get_vocab_size():
                raise BadModelFile(f"{path}/config.json: bos_token_id {bos_id} is outside the tokenizer's "
                                   f"{self.tok.get_vocab_size()} tokens", "fix or re-download the config")
            self.bos_token = self.tok.id_to_token(bos_id) or ""
        self.bos_id = bos_id
        self.add_bos = bool(tc.get("add_bos_token", False)) and bos_id is not None
        eog: set[int] = set()
        for src in (config.get("eos_token_id"), hf.generation_config().get("eos_token_id")):
            eog.update(_token_ids(src))
        for t in (self.eos_token, *EOT_TOKENS):
            i = self.tok.token_to_id(t) if t else None
            if i is not None:
                eog.add(i)
        self.eog_ids = eog
        self.n_vocab = self.tok.get_vocab_size()

    def encode(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def is_eog(self, token: int) -> bool:
        return token in self.eog_ids

    def has(self, token: str) -> bool:
        return self.tok.token_to_id(token) is not None

    def longest_token_bytes(self) -> int:
        """The UTF-8 length of the longest token text in the vocabulary (byte-level and
        SentencePiece spellings are never shorter than the bytes a token stands for)."""
        return max((len(t.encode("utf-8", "surrogatepass")) for t in self.tok.get_vocab(with_added_tokens=True)),
                   default=1)

    def chat_template(self) -> str | None:
        return self._template

    def stream(self) -> "HFStreamDecoder":
        return HFStreamDecoder(self)


def _token_text(v) -> str:
    """A special token from tokenizer_config.json: a string or {"content": string}."""
    v = v.get("content") if isinstance(v, dict) else v
    return v if isinstance(v, str) else ""


def _token_ids(v) -> list[int]:
    """Token ids from a config: one integer or a list; anything else names no token."""
    ids = v if isinstance(v, list) else [v]
    return [x for x in ids if isinstance(x, int) and not isinstance(x, bool) and x >= 0]


class HFStreamDecoder:
    """Emits text only once the tokens so far decode to complete characters (byte fallback)."""

    def __init__(self, tok: HFTokenizer):
        self.tok, self.ids, self.prefix, self.read = tok, [], 0, 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        prev = self.tok.decode(self.ids[self.prefix:self.read])
        new = self.tok.decode(self.ids[self.prefix:])
        if len(new) > len(prev) and not new.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return new[len(prev):]
        return ""

    def flush(self) -> str:
        prev = self.tok.decode(self.ids[self.prefix:self.read])
        new = self.tok.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return new[len(prev):]


class GGUFTokenizer:
    """llama.cpp's tokenizer for a GGUF file (vocab-only load)."""

    def __init__(self, path: Path):
        from dsq.runtime.llama_cpp_backend import LlamaCppModel

        self.vocab = LlamaCppModel(path, vocab_only=True, n_ctx=64)
        self.bos_token, self.eos_token = self.vocab.bos_token, self.vocab.eos_token
        self.add_bos = self.vocab.add_bos
        self._tokens = None

    def encode(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        return self.vocab.tokenize(text, add_bos=add_bos, special=special)

    def decode(self, ids: list[int]) -> str:
        return self.vocab.detokenize(ids)

    def is_eog(self, token: int) -> bool:
        return self.vocab.is_eog(token)

    def has(self, token: str) -> bool:
        return self.vocab.has_token(token)

    def longest_token_bytes(self) -> int:
        return self.vocab.longest_token_bytes()

    def chat_template(self) -> str | None:
        return self.vocab.chat_template()

    def stream(self) -> "PieceStreamDecoder":
        return PieceStreamDecoder(self.vocab.piece)


class PieceStreamDecoder:
    """Token pieces (bytes) through an incremental UTF-8 decoder."""

    def __init__(self, piece):
        self.piece = piece
        self.dec = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token: int) -> str:
        return self.dec.decode(self.piece(token))

    def flush(self) -> str:
        return self.dec.decode(b"", final=True)
