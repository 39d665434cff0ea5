"""Sampling settings shared by every backend."""

from __future__ import annotations

from dataclasses import dataclass

from dsq.errors import DsqError


@dataclass
class SamplingParams:
    temperature: float = 0.8  # 0 = greedy
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1 = off
    min_p: float = 0.0  # 0 = off
    repeat_penalty: float = 1.0  # 1 = off
    seed: int | None = None

    def validate(self) -> "SamplingParams":
        if self.temperature < 0:
            raise DsqError(f"--temperature must be >= 0, got {self.temperature}", "use 0 for greedy decoding")
        if self.top_k < 0:
            raise DsqError(f"--top-k must be >= 0, got {self.top_k}", "use 0 to turn it off")
        if not 0 < self.top_p <= 1:
            raise DsqError(f"--top-p must be in (0, 1], got {self.top_p}", "use 1 to turn it off")
        if not 0 <= self.min_p < 1:
            raise DsqError(f"--min-p must be in [0, 1), got {self.min_p}", "use 0 to turn it off")
        if self.repeat_penalty <= 0:
            raise DsqError(f"--repeat-penalty must be > 0, got {self.repeat_penalty}", "use 1 to turn it off")
        return self
