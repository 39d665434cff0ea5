"""Backend-neutral generation pieces: token events, timing statistics, stop strings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class TokenEvent:
    token_id: int
    text: str


@dataclass
class GenStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0  # tokens returned (an end-of-generation token is not counted)
    sampled_tokens: int = 0  # tokens the model produced, end-of-generation included (for rates)
    steps: int = 0  # forward passes that produced them (one a token; one a batch of tokens)
    ttft_s: float = 0.0  # prompt in -> first token out (prefill + first sample)
    decode_s: float = 0.0  # first token -> last token
    finish_reason: str = "length"
    token_ids: list[int] = field(default_factory=list)
    _t0: float = field(default=0.0, repr=False)
    _first: float | None = field(default=None, repr=False)
    _first_n: int = field(default=0, repr=False)  # tokens of the first step (they come with the prefill)
    _last: float = field(default=0.0, repr=False)

    def start(self, prompt_tokens: int) -> None:
        """The prompt goes in now."""
        self.prompt_tokens, self.finish_reason, self._t0 = prompt_tokens, "length", time.perf_counter()

    def take(self, token: int, ends: bool) -> bool:
        """A token came out now. Returns False when it ends generation (it is then not kept)."""
        self.take_step(1, 0)
        if ends:
            self.finish_reason = "stop"
            return False
        self.token_ids.append(token)
        self.generated_tokens += 1
        return True

    def take_step(self, sampled: int, kept: int) -> None:
        """A step of a batch produced `sampled` tokens now (one a sequence), `kept` of them returned."""
        self._last = time.perf_counter()
        if self._first is None:
            self._first, self._first_n = self._last, sampled
        self.sampled_tokens += sampled
        self.generated_tokens += kept
        self.steps += 1

    def finish(self) -> None:
        if self._first is not None:
            self.ttft_s, self.decode_s = self._first - self._t0, self._last - self._first

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s > 0 else 0.0

    @property
    def tpot_ms(self) -> float:
        """Time a step after the first (a token of each sequence)."""
        n = self.steps - 1
        return 1000.0 * self.decode_s / n if n > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first step, over their time: all sequences of a batch together."""
        n = self.sampled_tokens - self._first_n
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "ttft_ms": round(1000 * self.ttft_s, 3),
            "tpot_ms": round(self.tpot_ms, 3),
            "prefill_tok_s": round(self.prefill_tok_s, 2),
            "decode_tok_s": round(self.decode_tok_s, 2),
            "finish_reason": self.finish_reason,
        }


class StopMatcher:
    """Holds back streamed text that could be the start of a stop string.

    feed(text) -> (text safe to emit, stopped?). On a stop, the stop string and anything after
    it are dropped.
    """

    def __init__(self, stops: list[str] | tuple[str, ...] = ()):
        self.stops = [s for s in stops if s]
        self.buf = ""

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        self.buf += text
        cut = min((i for i in (self.buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.buf = self.buf[:cut], ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.buf)), 0, -1):
                if self.buf.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        out = self.buf[: len(self.buf) - hold]
        self.buf = self.buf[len(self.buf) - hold:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out
