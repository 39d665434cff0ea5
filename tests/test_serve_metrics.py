"""dsq serve's /metrics: Prometheus' text exposition format, read back by prometheus_client's own
parser; each app its own registry."""

from __future__ import annotations

import asyncio

import pytest


@pytest.fixture(scope="module")
def apps(tiny_gguf):
    from dsq.serve.server import build

    built = [build(str(tiny_gguf("llama", "Q8_0")), ctx=128, threads=1, dtype=None, kv_tokens=256, block_size=16,
                   kv_dtype_name=kv, max_seqs=2, prefill_chunk=64, prefix_cache=True) for kv in (None, "fp16")]
    return [api for _, api in built]


def _families(api) -> dict:
    """GET /metrics of the server's API, read by prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families
    from starlette.requests import Request

    r = asyncio.run(api.metrics(Request({"type": "http", "method": "GET", "path": "/metrics", "query_string": b"",
                                         "headers": []})))
    text = r.body.decode()
    assert r.status_code == 200 and r.media_type.startswith("text/plain; version=")
    for line in text.splitlines():  # every family says what it is
        assert not line or line.startswith(("# HELP dsq_", "# TYPE dsq_", "dsq_")), line
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_are_prometheus_text(apps):
    fams = _families(apps[0])
    assert fams["dsq_requests"].type == "counter" and fams["dsq_requests"].samples[0].name == "dsq_requests_total"
    assert fams["dsq_kv_blocks_total"].type == "gauge" and fams["dsq_kv_blocks_total"].samples[0].value > 0
    assert fams["dsq_running"].documentation == "Requests decoding now."
    for f in fams.values():
        for s in f.samples:
            assert isinstance(s.value, float)
    info = fams["dsq_settings_info"]  # an info metric, in the text format a gauge of 1 with labels
    assert info.samples[0].value == 1 and info.samples[0].labels["spec_method"] == "off"
    assert "dsq_kv_dtype" not in fams and "dsq_spec_method" not in fams  # strings are labels, not samples


def test_each_app_has_its_own_registry(apps):
    """Two servers in one process: each /metrics tells its own engine's settings."""
    kv = [_families(api)["dsq_settings_info"].samples[0].labels["kv_dtype"] for api in apps]
    assert kv[1] == "float16" and kv[0] != kv[1]
