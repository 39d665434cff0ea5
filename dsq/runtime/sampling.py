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


class Sampler:
    """Picks next tokens from logits (B, V), in llama.cpp's order: repetition penalty, top-k,
    top-p, min-p, temperature, then a draw from a seeded generator (greedy at temperature 0)."""

    def __init__(self, params: SamplingParams, device="cpu", penalty_last_n: int = 64):
        import torch

        self.p = params.validate()
        self.penalty_last_n = penalty_last_n
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(params.seed if params.seed is not None else torch.seed())

    def __call__(self, logits, recent=None):
        """logits (B, V); recent: (B, n) token ids for the repetition penalty. -> (B,) ids."""
        import torch

        p = self.p
        logits = logits.float()
        if p.repeat_penalty != 1.0 and recent is not None and recent.numel():
            r = recent[:, -self.penalty_last_n:].to(logits.device)
            sel = logits.gather(1, r)
            sel = torch.where(sel > 0, sel / p.repeat_penalty, sel * p.repeat_penalty)
            logits = logits.scatter(1, r, sel)
        if p.temperature == 0:
            return argmax(logits)
        return self.draw(*filtered(p, logits)).squeeze(-1)

    def draw(self, probs, idx):
        """Tokens drawn from filtered()'s (probs, idx) (B, k), one a row, on this sampler's
        generator: (B, 1) ids, left on the device."""
        import torch

        pick = torch.multinomial(probs, 1, generator=self.gen)
        return pick if idx is None else idx.gather(1, pick)


def filtered(p: SamplingParams, logits):
    """top-k, top-p, min-p and temperature over logits (B, V) float, every row alike: the
    probabilities to draw from (B, k) and their token ids (B, k), or (B, V) and None without top-k
    or top-p. Sampler.__call__'s filter apart from its draw, so that rows of one setting filter in
    one call (dsq serve's batched step)."""
    # top-k and top-p keep a prefix of the logits sorted high to low: work on that prefix (k values)
    # and map the draw back through its indices, rather than masking, sorting and drawing over the
    # whole vocabulary (~10 ms a token on the CPU at 262k tokens; the same distribution,
    # docs/benchmarks.md#cpu-decode)
    idx = None
    if 0 < p.top_k < logits.shape[-1]:
        logits, idx = logits.topk(p.top_k, dim=-1)  # sorted
    if p.top_p < 1.0:
        if idx is None:
            logits, idx = logits.sort(dim=-1, descending=True)
        probs = logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.masked_fill(drop, float("-inf"))
    if p.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return (logits / p.temperature).softmax(-1), idx


def argmax(logits, chunk: int = 512):
    """logits.argmax(-1) for (B, V), the same index (the first maximum), ~10x faster for a large
    vocabulary on the CPU: torch's argmax is not vectorized, amax is. The first chunk holding the
    maximum is found from the chunks' maxima, then the first maximum inside it."""
    import torch

    B, V = logits.shape
    if logits.device.type != "cpu" or V % chunk or V < 64 * chunk or not logits.is_contiguous():
        return logits.argmax(-1)
    rows = logits.view(B, V // chunk, chunk)
    first = rows.amax(-1).argmax(-1)  # (B,)
    return first * chunk + rows[torch.arange(B), first].argmax(-1)
