"""What every backend is: the contract NativeModel (dsq's torch engine) and LlamaCppModel
(llama.cpp) both keep, and all that generation, chat and the bench runner use of a model."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Protocol, runtime_checkable

from dsq.runtime.generate import GenStats, TokenEvent
from dsq.runtime.gpu_layers import GpuLayers
from dsq.runtime.model_ref import ModelRef
from dsq.runtime.sampling import SamplingParams


@runtime_checkable
class Backend(Protocol):
    backend: str  # "native" | "llama.cpp"
    ref: ModelRef  # what the user asked for (an HF directory stays one on llama.cpp, which runs its GGUF)
    path: Path  # the weights this backend runs
    arch: str  # the architecture's name, as chat-template fallbacks know it
    n_ctx: int  # tokens the KV cache holds (prompt + reply)
    n_threads: int
    gpu_layers: GpuLayers  # resolved and placed: what sits on the GPU here

    # -- tokens ---------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]: ...

    def detokenize(self, ids: list[int]) -> str: ...

    def is_eog(self, token: int) -> bool: ...

    def has_token(self, text: str) -> bool: ...

    def chat_template(self) -> str | None: ...

    @property
    def bos_token(self) -> str: ...

    @property
    def eos_token(self) -> str: ...

    @property
    def add_bos(self) -> bool: ...

    # -- compute --------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the cached prefix: the next request prefills its whole prompt."""

    def logits(self, tokens: list[int]):
        """Logits for every position of one sequence: numpy (T, V)."""

    def stream(self, prompt_ids: list[int], sampling: SamplingParams, max_tokens: int,
               stats: GenStats | None = None, ignore_eos: bool = False) -> Iterator[TokenEvent]:
        """Up to max_tokens after prompt_ids, text as it becomes valid UTF-8; the KV cache keeps the
        longest common prefix with the previous call (chat turns prefill only what is new)."""


@runtime_checkable
class BatchBackend(Backend, Protocol):
    """A backend that also decodes several prompts together (the native one)."""

    last_prefill_tokens: int  # prompt tokens the last stream() had to run (the rest was cached)

    def generate_batch(self, prompts: list[list[int]], sampling: SamplingParams, max_tokens: int,
                       ignore_eos: bool = False, stats: GenStats | None = None) -> list[list[int]]:
        """The generated ids per prompt; `stats` counts every sequence's tokens."""
