"""Chat templates: render the model's own Jinja template (as transformers does, in a sandbox with
limits: dsq.runtime.template_sandbox), or a fallback chosen by architecture (its registry entry
names one of TEMPLATES) when the model carries none or its own fails; split DeepSeek-R1 `<think>`
sections.

Shared by every backend: the llama.cpp path and the native runtime render prompts here.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dsq.errors import BadModelFile, DsqError, ModelNotFound

# Gemma's turn format (Gemma has no system role: its text joins the first user turn).
# Text is emitted from expressions only, so whitespace control cannot eat the newlines.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for m in loop_messages -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\n'"
    " + ((first_prefix if loop.first else '') + m['content']) | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
CHATML_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for m in messages -%}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif -%}"
)
PLAIN_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for m in messages -%}"
    "{{ m['role'] | capitalize + ': ' + m['content'] | trim + '\n\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Assistant:' }}{%- endif -%}"
)
TEMPLATES = {"gemma": GEMMA_TEMPLATE, "chatml": CHATML_TEMPLATE}  # what registry entries name


def _warn(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


@dataclass(eq=False)
class ChatTemplate:
    """A chat template rendered in the sandbox (dsq.runtime.template_sandbox).

    A template from a model file carries `fallback`, its architecture's template: when the
    model's own fails to compile, fails while rendering or exceeds a limit, the fallback takes
    its place for good, with one warning line. Without a fallback a failure is a DsqError."""

    source: str  # the Jinja text
    origin: str  # "model", "file" (--chat-template) or "fallback:<name>"
    bos_token: str = ""
    eos_token: str = ""
    fallback: "ChatTemplate | None" = None
    warn: Callable[[str], None] = field(default=_warn, repr=False)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        from dsq.runtime.template_sandbox import TemplateProblem, render

        try:
            return render(self.source, messages=messages, add_generation_prompt=add_generation_prompt,
                          bos_token=self.bos_token, eos_token=self.eos_token, tools=None, documents=None)
        except TemplateProblem as e:
            if self.fallback is None:
                raise DsqError(f"the chat template {e}",
                               "fix the template, or give dsq chat another with --chat-template FILE") from None
            whose = "the model's chat template" if self.origin == "model" else "the --chat-template file"
            self.warn(f"warning: {whose} {e}; using the {self.fallback.origin.split(':')[-1]} "
                      "template instead")
        self.source, self.origin, self.fallback = self.fallback.source, self.fallback.origin, None
        return self.render(messages, add_generation_prompt)


def fallback_for(arch: str) -> str | None:
    """The fallback template of a GGUF architecture name, if its registry entry names one."""
    from dsq.models.registry import find_gguf

    entry = find_gguf(arch)
    return TEMPLATES.get(entry.chat_template) if entry and entry.chat_template else None


def _fallback(arch: str, vocab_has: Callable[[str], bool], bos: str, eos: str) -> ChatTemplate:
    fallback = fallback_for(arch)
    if fallback:
        return ChatTemplate(fallback, f"fallback:{arch}", bos, eos)
    if vocab_has("<|start_header_id|>"):
        return ChatTemplate(LLAMA3_TEMPLATE, "fallback:llama3", bos, eos)
    if vocab_has("<|im_start|>"):
        return ChatTemplate(CHATML_TEMPLATE, "fallback:chatml", bos, eos)
    return ChatTemplate(PLAIN_TEMPLATE, "fallback:plain", bos, eos)


def pick_template(template: str | None, arch: str, vocab_has: Callable[[str], bool], bos: str, eos: str,
                  warn: Callable[[str], None] = _warn, origin: str = "model") -> ChatTemplate:
    """The model's template (or a --chat-template file's, origin "file") if there is one, with its
    architecture's as the fallback; else the fallback."""
    fallback = _fallback(arch, vocab_has, bos, eos)
    if not template:
        return fallback
    return ChatTemplate(template, origin, bos, eos, fallback=fallback, warn=warn)


def read_template_file(path: str | Path) -> str:
    """A chat template from a file: Jinja text, or a JSON file (tokenizer_config.json,
    chat_template.json) holding a "chat_template" string. BadModelFile when it holds none."""
    from dsq.formats.hf import read_json, read_text

    path = Path(path)
    if not path.is_file():
        raise ModelNotFound(f"{path} {'is not a file' if path.exists() else 'does not exist'}",
                            "pass a .jinja file or a tokenizer_config.json")
    if path.suffix != ".json":
        text = read_text(path)
        if not text.strip():  # a blank template would silently fall back to the model's own
            raise BadModelFile(f"{path} is empty", "pass a file holding a Jinja chat template")
        return text
    ct = read_json(path, dict).get("chat_template")
    if isinstance(ct, list):
        ct = next((t.get("template") for t in ct if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(ct, str) or not ct:
        raise BadModelFile(f"{path} holds no chat_template string", "pass a .jinja file or a tokenizer_config.json")
    return ct


class ThinkSplitter:
    """Streams text into ("think", s) and ("answer", s) parts at <think> / </think> tags.

    DeepSeek-R1 templates often end the prompt with "<think>\\n", so the reply starts inside the
    thinking section: pass `start_thinking=True` then.
    """

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, start_thinking: bool = False):
        self.thinking = start_thinking
        self.buf = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while True:
            tag = self.CLOSE if self.thinking else self.OPEN
            i = self.buf.find(tag)
            if i >= 0:
                if i:
                    out.append(("think" if self.thinking else "answer", self.buf[:i]))
                self.buf = self.buf[i + len(tag):]
                self.thinking = not self.thinking
                continue
            keep = next((k for k in range(min(len(tag) - 1, len(self.buf)), 0, -1)
                         if self.buf.endswith(tag[:k])), 0)
            emit = self.buf[: len(self.buf) - keep]
            if emit:
                out.append(("think" if self.thinking else "answer", emit))
            self.buf = self.buf[len(self.buf) - keep:]
            return out

    def flush(self) -> list[tuple[str, str]]:
        out = [("think" if self.thinking else "answer", self.buf)] if self.buf else []
        self.buf = ""
        return out


def prompt_opens_think(prompt: str) -> bool:
    tail = prompt.rstrip()
    return tail.endswith("<think>")


def strip_think(text: str) -> str:
    """The answer part of a reply (what R1 templates keep in the history)."""
    return text.split("</think>")[-1].lstrip("\n") if "</think>" in text else text
