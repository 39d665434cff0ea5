"""`dsq bench --serve URL`: a load generator for any OpenAI-compatible server (dsq serve,
llama-server, vLLM, SGLang).

At each concurrency C, N streaming /v1/completions requests go out with C in flight at a time;
prompts are spans of varied length (log-uniform over --prompt-tokens' range, in words) of the
held-out text. Per request: TTFT (request sent -> first text), TPOT ((last text - first text) /
(tokens - 1), tokens from the server's `usage` when it sends one, else its chunks), the output
tokens, and whether it failed. Per level: QPS and output tok/s over the wall time of the level,
TTFT and TPOT at P50 and P99, failures, and the cost of 1M output tokens at --gpu-cost-per-hour.
Plain http.client on threads: nothing to install, nothing shared between requests.
"""

from __future__ import annotations

import http.client
import json
import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

from dsq.errors import DsqError


@dataclass
class Sample:
    ok: bool
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    latency_s: float = 0.0
    prompt_words: int = 0
    output_tokens: int = 0
    error: str = ""


@dataclass
class Level:
    concurrency: int
    requests: int
    failures: int
    wall_s: float
    qps: float
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    cost_per_1m_output: float | None
    server: dict | None = None  # what a dsq server's /metrics says of the level (None from other servers)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the closest ranks; 0 for no values."""
    if not values:
        return 0.0
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def prompts(n: int, lo_words: int, hi_words: int, seed: int = 0) -> list[str]:
    """n spans of the held-out text, lengths log-uniform in [lo_words, hi_words]."""
    from dsq.eval.corpus import held_out_text

    words = held_out_text().split()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = int(round(math.exp(rng.uniform(math.log(lo_words), math.log(hi_words)))))
        start = rng.randrange(0, len(words) - k)
        out.append(" ".join(words[start:start + k]))
    return out


class Target:
    def __init__(self, url: str, model: str | None, timeout: float, api_key: str | None = None):
        u = urlsplit(url if "://" in url else "http://" + url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise DsqError(f"--serve {url!r} is not an http(s) URL", "e.g. --serve http://127.0.0.1:8000")
        self.scheme, self.host, self.port = u.scheme, u.hostname, u.port or (443 if u.scheme == "https" else 80)
        self.base = u.path.rstrip("/")
        if not self.base.endswith("/v1"):
            self.base += "/v1"
        self.timeout = timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url
        self.model = model or self._first_model(url)

    def conn(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def _first_model(self, url: str) -> str:
        try:
            c = self.conn()
            c.request("GET", self.base + "/models", headers=self.headers)
            r = c.getresponse()
            raw = r.read()
            self._refused(r.status)
            body = json.loads(raw)
            return body["data"][0]["id"]
        except (OSError, ValueError, KeyError, IndexError, http.client.HTTPException) as e:
            raise DsqError(f"no OpenAI-compatible server answers at {url} ({type(e).__name__}: {e})",
                           "start one (dsq serve) or pass its URL, and --serve-model if /v1/models is missing"
                           ) from None

    def _refused(self, status: int) -> None:
        if status in (401, 403):
            raise DsqError(f"the server at {self.url} refused the request (HTTP {status}): "
                           + ("a wrong API key" if self.headers else "it needs an API key"),
                           "pass the server's key with --api-key (or DSQ_API_KEY)")

    def metrics(self) -> dict | None:
        """A dsq server's counters (/metrics?format=json), or None from a server without them."""
        try:
            c = self.conn()
            c.request("GET", self.base.removesuffix("/v1") + "/metrics?format=json", headers=self.headers)
            r = c.getresponse()
            body = r.read()
            return json.loads(body) if r.status == 200 else None
        except (OSError, ValueError, http.client.HTTPException):
            return None

    def one(self, prompt: str, max_tokens: int) -> Sample:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True})
        t0 = time.perf_counter()
        first = last = None
        chunks, usage_tokens = 0, None
        try:
            c = self.conn()
            c.request("POST", self.base + "/completions", body, {"Content-Type": "application/json", **self.headers})
            r = c.getresponse()
            if r.status != 200:
                return Sample(False, error=f"HTTP {r.status}: {r.read()[:200].decode(errors='replace')}")
            for raw in r:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                if ev.get("usage"):
                    usage_tokens = ev["usage"].get("completion_tokens")
                for ch in ev.get("choices") or []:
                    if ch.get("text"):
                        now = time.perf_counter()
                        first = first if first is not None else now
                        last = now
                        chunks += 1
            c.close()
        except (OSError, ValueError, http.client.HTTPException) as e:
            return Sample(False, error=f"{type(e).__name__}: {e}")
        if first is None:
            return Sample(False, error="no text came back")
        n = usage_tokens or chunks
        return Sample(True, first - t0, (last - first) / (n - 1) if n > 1 else 0.0, last - t0,
                      len(prompt.split()), n)


def run_level(target: Target, concurrency: int, texts: list[str], max_tokens: int,
              cost_per_hour: float | None) -> tuple[Level, list[Sample]]:
    lock = threading.Lock()
    samples: list[Sample] = []

    def go(p: str) -> None:
        s = target.one(p, max_tokens)
        with lock:
            samples.append(s)

    before = target.metrics()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(go, texts))
    wall = time.perf_counter() - t0
    after = target.metrics() if before else None
    ok = [s for s in samples if s.ok]
    out = sum(s.output_tokens for s in ok)
    tok_s = out / wall if wall > 0 else 0.0
    ttft, tpot = [s.ttft_s * 1000 for s in ok], [s.tpot_s * 1000 for s in ok if s.output_tokens > 1]
    cost = cost_per_hour / 3600 / tok_s * 1e6 if cost_per_hour is not None and tok_s > 0 else None
    level = Level(concurrency, len(samples), len(samples) - len(ok), round(wall, 3), round(len(ok) / wall, 3),
                  round(tok_s, 2), round(percentile(ttft, 50), 2), round(percentile(ttft, 99), 2),
                  round(percentile(tpot, 50), 2), round(percentile(tpot, 99), 2),
                  None if cost is None else round(cost, 4), _server_delta(before, after, wall))
    return level, samples


_TIMES = ("step", "prefill", "decode", "sync", "emit")
_GPU = ("prefill", "decode")  # the GPU's own time in prompt chunks and decode steps (engine.GpuClock)


def _server_delta(before: dict | None, after: dict | None, wall: float = 0.0) -> dict | None:
    """The level's share of a dsq server's counters: speculative acceptance, prefix-cache hits,
    preemptions, steps, and where the engine's loop spent them: ms a step in prompt chunks, decode
    steps, sampling (the wait for the GPU) and handing tokens on, and the share of the level's wall
    time inside steps (`busy`; the rest the loop waited: for requests, or for the GIL)."""
    if not before or not after:
        return None
    keys = ("spec_draft_tokens", "spec_accepted_tokens", "prefix_cache_lookup_tokens", "prefix_cache_hit_tokens",
            "preempted", "steps", "generated_tokens", "chunks", "chunk_tokens", "chunk_padded_tokens",
            "packed_prompt_tokens") + tuple(f"time_{k}_s" for k in _TIMES) + tuple(f"gpu_time_{k}_s" for k in _GPU)
    d = {k: after[k] - before[k] for k in keys
         if isinstance(after.get(k), (int, float)) and isinstance(before.get(k), (int, float))}
    if d.get("steps") and "time_step_s" in d:
        d["step_ms"] = {k: round(d.pop(f"time_{k}_s") * 1000 / d["steps"], 2) for k in _TIMES if f"time_{k}_s" in d}
        if wall > 0:
            d["busy"] = round(d["step_ms"]["step"] * d["steps"] / 1000 / wall, 3)
        gpu = {k: round(d.pop(f"gpu_time_{k}_s") * 1000 / d["steps"], 2) for k in _GPU if f"gpu_time_{k}_s" in d}
        if gpu:
            d["gpu_step_ms"] = gpu
        if "chunk_tokens" in d:  # prompt tokens a step through prompt chunks, and what their graphs computed
            d["chunk_tokens_per_step"] = round(d["chunk_tokens"] / d["steps"], 1)
            d["chunk_padded_tokens_per_step"] = round(d.get("chunk_padded_tokens", 0) / d["steps"], 1)
    d = {k: v for k, v in d.items() if not k.startswith(("time_", "gpu_time_"))}
    if d.get("spec_draft_tokens"):
        d["spec_acceptance_rate"] = round(d["spec_accepted_tokens"] / d["spec_draft_tokens"], 4)
    if d.get("prefix_cache_lookup_tokens"):
        d["prefix_cache_hit_rate"] = round(d["prefix_cache_hit_tokens"] / d["prefix_cache_lookup_tokens"], 4)
    if d.get("steps"):
        d["tokens_per_step"] = round(d.get("generated_tokens", 0) / d["steps"], 3)
    return d


def run_load(url: str, concurrency: list[int], requests: int, max_tokens: int = 128, prompt_words: tuple[int, int]
             = (16, 512), model: str | None = None, cost_per_hour: float | None = None, timeout: float = 600,
             seed: int = 0, on_status=None, same_prompts: bool = False, api_key: str | None = None) -> dict:
    """Every concurrency level against the server at `url`; a dict for JSON: the settings, a
    Level per concurrency, and the failed requests' errors (a few). Each level draws prompts of
    its own (seed + its index), so a server's prefix cache finds none of an earlier level's; with
    `same_prompts` every level sends the same ones."""
    if requests < 1 or any(c < 1 for c in concurrency) or max_tokens < 1:
        raise DsqError("--requests, --concurrency and --gen-tokens must be at least 1")
    target = Target(url, model, timeout, api_key)
    levels, errors = [], []
    for i, c in enumerate(concurrency):
        if on_status:
            on_status(f"concurrency {c}: {requests} requests")
        texts = prompts(requests, *prompt_words, seed=seed if same_prompts else seed + i)
        level, samples = run_level(target, c, texts, max_tokens, cost_per_hour)
        levels.append(asdict(level))
        errors += [s.error for s in samples if not s.ok][:5]
    return {"url": url, "model": target.model, "requests": requests, "max_tokens": max_tokens,
            "prompt_words": list(prompt_words), "same_prompts": same_prompts, "gpu_cost_per_hour": cost_per_hour,
            "levels": levels,
            "errors": errors}


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lv = result["levels"]
    c = [x["concurrency"] for x in lv]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(c, [x["output_tok_s"] for x in lv], "o-")
    a.set(xlabel="concurrency", ylabel="output tok/s", title=result["model"], xscale="log")
    b.plot(c, [x["tpot_p50_ms"] for x in lv], "o-", label="TPOT P50")
    b.plot(c, [x["tpot_p99_ms"] for x in lv], "o--", label="TPOT P99")
    b.plot(c, [x["ttft_p99_ms"] for x in lv], "s:", label="TTFT P99")
    b.set(xlabel="concurrency", ylabel="ms", xscale="log", yscale="log")
    b.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
