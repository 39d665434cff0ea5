"""/metrics in Prometheus' text exposition format: the engine's numbers as counters (what only
grows) and gauges, its string settings as labels of one info metric. Each server has its own
registry, so several apps in one process (tests) do not collide."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

PREFIX = "dsq_"
# the cumulative numbers that are not in the engine's or the draft's `counters`
CUMULATIVE = ("prefix_cache_lookup_tokens", "prefix_cache_hit_tokens", "draft_prefix_cache_hit_tokens")
HELP = {
    "requests": "Requests admitted.", "finished": "Requests finished.", "cancelled": "Requests cancelled.",
    "preempted": "Requests preempted for KV blocks.", "failed": "Requests failed.",
    "prompt_tokens": "Prompt tokens admitted.", "generated_tokens": "Tokens generated.",
    "steps": "Engine steps.", "running": "Requests decoding now.", "waiting": "Requests waiting for admission.",
    "kv_blocks_total": "KV cache blocks.", "kv_blocks_held": "KV cache blocks held by sequences.",
    "kv_blocks_cached": "KV cache blocks kept for prefix reuse.", "kv_block_size": "Tokens per KV block.",
    "kv_bytes": "Bytes of the paged KV cache.", "prefix_cache_hit_rate": "Prompt tokens found in the prefix cache, "
    "as a share of those looked up.", "spec_acceptance_rate": "Draft tokens accepted, as a share of those proposed.",
}


def _help(name: str) -> str:
    return HELP.get(name) or f"dsq serve: {name.replace('_', ' ')}."


class EngineCollector:
    """The engine's metrics() at each scrape."""

    def __init__(self, engine):
        self.engine = engine

    def _counter_names(self) -> set[str]:
        drafter = getattr(self.engine, "drafter", None)
        return {*self.engine.counters, *(drafter.counters if drafter else ()), *CUMULATIVE}

    def collect(self):
        counters = self._counter_names()
        labels = {}
        for name, value in self.engine.metrics().items():
            if isinstance(value, str):
                labels[name] = value
            elif name in counters or name.startswith(("time_", "gpu_time_")):
                yield CounterMetricFamily(PREFIX + name, _help(name), value=float(value))
            else:
                yield GaugeMetricFamily(PREFIX + name, _help(name), value=float(value))
        if labels:
            yield InfoMetricFamily(PREFIX + "settings", "dsq serve's settings (KV cache dtype, speculative "
                                   "decoding).", value=labels)


def registry_for(engine) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    return registry


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """(the text, its content type)."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
