"""Calibration token ids for the calibrated methods and the importance matrix.

"builtin" is the calibration part of the built-in text (dsq.eval.corpus: `dsq eval` scores only the
held-out part). "builtin-chat" renders calibration text as conversations through the model's
chat template (the format a chat model sees). A user file: `.txt` (one text) or `.jsonl` (one
object per line with "text", or "messages" in chat format).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from dsq.errors import DsqError
from dsq.eval.corpus import calibration_text

if TYPE_CHECKING:
    from dsq.quant.spec import CalibSpec

def _read_user_file(path: Path, render: Callable[[list[dict]], str] | None) -> list[str]:
    if not path.is_file():
        raise DsqError(f"calibration file {path} does not exist", "pass a .txt or .jsonl file")
    if path.suffix == ".jsonl":
        texts = []
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DsqError(f"{path}:{i} is not JSON ({e.msg})", "one JSON object per line") from e
            if isinstance(obj, dict) and isinstance(obj.get("text"), str):
                texts.append(obj["text"])
            elif isinstance(obj, dict) and isinstance(obj.get("messages"), list) and render is not None:
                texts.append(render(obj["messages"]))
            else:
                raise DsqError(f"{path}:{i} has neither \"text\" nor \"messages\"", "see dsq quantize --help")
    else:
        texts = [path.read_text(encoding="utf-8", errors="replace")]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise DsqError(f"calibration file {path} is empty", "give it some text")
    return texts


def calibration_ids(source: str, tokenize: Callable[[str], list[int]], n_samples: int, seq_len: int,
                    render: Callable[[list[dict]], str] | None = None) -> torch.Tensor:
    """(n, seq_len) token ids: `n_samples` windows cut from the calibration text."""
    if n_samples < 1 or seq_len < 8:
        raise DsqError("--calib-samples must be >= 1 and --calib-seq-len >= 8")
    if source in ("builtin", "builtin-chat"):
        text = calibration_text()
        if source == "builtin-chat":
            if render is None:
                raise DsqError("builtin-chat calibration needs a chat template")
            paras = [p for p in text.split("\n\n") if len(p) > 40]
            convs = [render([{"role": "user", "content": a}, {"role": "assistant", "content": b}])
                     for a, b in zip(paras[0::2], paras[1::2])]
            texts = convs
        else:
            texts = [text]
    else:
        texts = _read_user_file(Path(source), render)
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenize(t))
        if len(ids) >= n_samples * seq_len:
            break
    if len(ids) < seq_len:
        raise DsqError(f"the calibration text has {len(ids)} tokens, fewer than one sample of {seq_len}",
                       "give more text or a smaller --calib-seq-len")
    n = min(n_samples, len(ids) // seq_len)
    return torch.tensor(ids[: n * seq_len]).reshape(n, seq_len)


def calibration_for(hf, calib: "CalibSpec") -> torch.Tensor:
    """(n, seq_len) calibration token ids for the HF model `hf`, tokenized by its own tokenizer."""
    if calib.source == "random":
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, hf.config["vocab_size"], (calib.samples, calib.seq_len), generator=g)
    from dsq.runtime.tokenizer import HFTokenizer

    tok = HFTokenizer(hf.path, hf.config)
    render = None
    if tok.chat_template() or calib.source == "builtin-chat":
        from dsq.models.registry import gguf_name
        from dsq.runtime.chat_template import pick_template

        tmpl = pick_template(tok.chat_template(), gguf_name(hf.model_type), tok.has, tok.bos_token, tok.eos_token)
        render = lambda msgs: tmpl.render(msgs, add_generation_prompt=False)  # noqa: E731
    return calibration_ids(calib.source, lambda t: tok.encode(t, add_bos=False), calib.samples, calib.seq_len, render)
