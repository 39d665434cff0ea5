"""A conversation with a model: history, template rendering, think-splitting, context trimming.

Each turn re-renders the whole conversation; the backend keeps the KV cache of the longest
common token prefix, so only the new turn is prefilled.
"""

from __future__ import annotations

from typing import Callable

from dsq.errors import DsqError
from dsq.runtime.backend import Backend
from dsq.runtime.chat_template import ThinkSplitter, prompt_opens_think, strip_think
from dsq.runtime.engine import chat_template_for, encode_prompt
from dsq.runtime.generate import GenStats
from dsq.runtime.sampling import SamplingParams

OnPart = Callable[[str, str], None]  # (kind: "think" | "answer", text)


class Conversation:
    def __init__(self, model: Backend, system: str | None = None, sampling: SamplingParams | None = None,
                 max_tokens: int = 1024):
        self.model = model
        self.system = system
        self.sampling = (sampling or SamplingParams()).validate()
        self.max_tokens = max_tokens
        self.template = chat_template_for(model)
        self.messages: list[dict] = []
        self.last_stats: GenStats | None = None

    def reset(self) -> None:
        self.messages = []

    def _conversation(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def _prompt_ids(self) -> tuple[list[int], bool]:
        """Render and tokenize, dropping the oldest turns until the reply has room."""
        while True:
            text = self.template.render(self._conversation(), add_generation_prompt=True)
            ids = encode_prompt(self.model, text, templated=True)
            room = self.model.n_ctx - len(ids)
            if room >= min(self.max_tokens, 64) or len(self.messages) <= 1:
                break
            self.messages = self.messages[2:] if len(self.messages) > 2 else self.messages[1:]
        if len(ids) >= self.model.n_ctx:
            self.messages.pop()
            raise DsqError(f"this message is {len(ids)} tokens with the template; the context holds "
                           f"{self.model.n_ctx}", "restart with a larger --ctx or send a shorter message")
        return ids, prompt_opens_think(text)

    def send(self, text: str, on_part: OnPart | None = None) -> str:
        """Add a user turn, stream the reply through on_part, return the reply's full text.

        A KeyboardInterrupt stops the reply; what was generated so far stays in the history.
        """
        self.messages.append({"role": "user", "content": text})
        ids, thinking = self._prompt_ids()
        splitter = ThinkSplitter(start_thinking=thinking)
        stats = GenStats()
        parts: list[str] = ["<think>\n"] if thinking else []
        events = self.model.stream(ids, self.sampling, self.max_tokens, stats)
        try:
            for ev in events:
                parts.append(ev.text)
                for kind, s in splitter.feed(ev.text):
                    if on_part:
                        on_part(kind, s)
            for kind, s in splitter.flush():
                if on_part:
                    on_part(kind, s)
        finally:
            events.close()
            self.last_stats = stats
            reply = "".join(parts)
            self.messages.append({"role": "assistant", "content": strip_think(reply)})
        return reply
