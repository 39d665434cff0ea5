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


class LoopGuard:
    """Spots a reply stuck in a loop: its last tokens are one cycle of up to `max_period` tokens
    repeated at least `repeats` times, over at least `min_span` tokens."""

    def __init__(self, max_period: int = 64, min_span: int = 64, repeats: int = 3):
        self.max_period, self.min_span, self.repeats = max_period, min_span, repeats
        self.ids: list[int] = []

    def feed(self, token: int) -> bool:
        """Take the next token; True when the reply now loops."""
        ids = self.ids
        ids.append(token)
        n = len(ids)
        for p in range(1, min(self.max_period, n // self.repeats) + 1):
            span = max(self.min_span, self.repeats * p)
            if span <= n and ids[-1] == ids[-1 - p] and ids[n - span + p:] == ids[n - span:n - p]:
                return True
        return False


class LineGuard:
    """Spots a greedy reply repeating a line: the same non-blank line said, then repeated twice
    (blank lines between them do not count). Greedy decoding that has repeated a line twice does
    not leave it."""

    def __init__(self, repeats: int = 3):
        self.repeats, self.partial, self.lines = repeats, "", []

    def feed(self, text: str) -> bool:
        """Take the next piece of text; True when a line has now come `repeats` times in a row."""
        *done, self.partial = (self.partial + text).split("\n")
        self.lines += [line.strip() for line in done if line.strip()]
        tail = self.lines[-self.repeats:]
        return len(tail) == self.repeats and len(set(tail)) == 1


class Conversation:
    def __init__(self, model: Backend, system: str | None = None, sampling: SamplingParams | None = None,
                 max_tokens: int = 1024, stop_loops: bool = True, template: str | None = None):
        if max_tokens < 1:
            raise DsqError(f"--max-tokens must be >= 1, got {max_tokens}")
        self.model = model
        self.system = system
        self.sampling = (sampling or SamplingParams()).validate()
        self.max_tokens = max_tokens
        self.stop_loops = stop_loops  # end a reply that repeats one cycle of tokens (LoopGuard) or, greedy, a line
        self.template = chat_template_for(model, template)  # template: Jinja text replacing the model's
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

        A reply that loops ends there (last_stats.finish_reason "loop"). A KeyboardInterrupt stops
        the reply (finish_reason "interrupted"); what was generated so far stays in the history.
        """
        self.last_stats = None
        self.messages.append({"role": "user", "content": text})
        ids, thinking = self._prompt_ids()
        splitter = ThinkSplitter(start_thinking=thinking)
        stats = GenStats()
        parts: list[str] = ["<think>\n"] if thinking else []
        guard = LoopGuard() if self.stop_loops else None
        lines = LineGuard() if self.stop_loops and self.sampling.temperature == 0 else None
        events = self.model.stream(ids, self.sampling, self.max_tokens, stats)
        try:
            for ev in events:
                parts.append(ev.text)
                _emit(splitter.feed(ev.text), on_part)
                if (guard is not None and ev.token_id >= 0 and guard.feed(ev.token_id)
                        or lines is not None and lines.feed(ev.text)):
                    stats.finish_reason = "loop"
                    break
            _emit(splitter.flush(), on_part)
        except KeyboardInterrupt:
            stats.finish_reason = "interrupted"
            raise
        finally:
            events.close()
            self.last_stats = stats
            reply = "".join(parts)
            self.messages.append({"role": "assistant", "content": strip_think(reply)})
        return reply


def _emit(parts: list[tuple[str, str]], on_part: OnPart | None) -> None:
    if on_part:
        for kind, text in parts:
            on_part(kind, text)
