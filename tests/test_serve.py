"""`dsq serve` over HTTP with the official `openai` client: a server started here on 127.0.0.1
(a free port) with the built-in model and speculative decoding on. Streaming and not, concurrent
greedy requests against `dsq run` (speculative off), prefix-cache hits, the 4xx cases, a client
that disconnects, SIGTERM; a second server with FP8 KV.

Every wait is bounded; the SIGTERM test runs last (it stops the module's server)."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from serve_util import (CTX, ROOT, FakeEngine, FakeNative, _env, _free_port, _get, _start,  # noqa: E402, F401
                        _stop, dsq_run, int8_x_build, serve_in_thread)

PROMPTS = ["The history of the Roman Empire", "Why is the sky blue?", "def fibonacci(n):",
           "Once upon a time, in a land far away", "one two three four five six seven one two three four five"]
N_TOKENS = 16



@pytest.fixture(scope="module")
def server():
    s = _start("--spec-tokens", "4")
    yield s
    _stop(s)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="none", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def _metrics(server) -> dict:
    return _get(server["base"] + "/metrics?format=json")


def test_models_and_health(server, client, model_id):
    assert _get(server["base"] + "/health") == {"status": "ok"}
    assert model_id == "gemma-3-270m-q4_k_m"


def test_completion_streamed_and_whole_agree(client, model_id):
    whole = client.completions.create(model=model_id, prompt=PROMPTS[0], max_tokens=N_TOKENS, temperature=0)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == N_TOKENS and whole.usage.prompt_tokens > 0
    chunks = list(client.completions.create(model=model_id, prompt=PROMPTS[0], max_tokens=N_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text and text.strip()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == N_TOKENS


def test_chat_streamed_and_whole_agree(client, model_id):
    msgs = [{"role": "user", "content": "Name three colors."}]
    whole = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=12, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=12, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content


def test_stop_strings_and_seeded_sampling(client, model_id):
    base = client.completions.create(model=model_id, prompt=PROMPTS[3], max_tokens=N_TOKENS, temperature=0)
    text = base.choices[0].text
    words = text.split()
    stop = words[len(words) // 2]  # a word from the middle of the greedy reply
    cut = client.completions.create(model=model_id, prompt=PROMPTS[3], max_tokens=N_TOKENS, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]
    a, b = (client.completions.create(model=model_id, prompt=PROMPTS[1], max_tokens=8, temperature=1.0, top_p=0.9,
                                      seed=7).choices[0].text for _ in range(2))
    assert a == b


_GENERATE = """
import json, sys
from dsq.runtime.engine import generate, load
m = load(None, backend="native", ctx=int(sys.argv[1]))
print(json.dumps([generate(m, p, max_tokens=int(sys.argv[2]), temperature=0).text for p in json.loads(sys.argv[3])]))
"""


def _dsq_run_all(prompts: list[str]) -> dict[str, str]:
    """What `dsq run --backend native --temperature 0` prints for each prompt: the CLI for the
    first, the function it calls (one model load) for all, which must agree on the first."""
    out = subprocess.run([sys.executable, "-c", _GENERATE, str(CTX), str(N_TOKENS), json.dumps(prompts)],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    texts = json.loads(out.stdout.splitlines()[-1])
    assert texts[0] == dsq_run(prompts[0], N_TOKENS)
    return dict(zip(prompts, texts))


def test_concurrent_greedy_requests_match_dsq_run(server, client, model_id):
    expected = _dsq_run_all(PROMPTS)
    jobs = [PROMPTS[i % len(PROMPTS)] for i in range(16)]

    def one(p: str) -> str:
        return client.completions.create(model=model_id, prompt=p, max_tokens=N_TOKENS,
                                         temperature=0).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, jobs, timeout=300))
    assert got == [expected[p] for p in jobs]  # batched, and speculative on against off
    m = _metrics(server)
    assert m["failed"] == 0 and m["kv_blocks_held"] == 0
    alone = client.completions.create(model=model_id, prompt=PROMPTS[4], max_tokens=N_TOKENS, temperature=0)
    assert alone.choices[0].text == expected[PROMPTS[4]]  # one request decoding: speculative steps
    assert _metrics(server)["spec_accepted_tokens"] > 0
    pytest.expected_greedy = expected


def test_fp8_kv_serves_the_same_first_tokens(server):
    fp8 = _start("--kv-dtype", "fp8", "--kv-memory", "16")
    try:
        m = _metrics(fp8)
        assert m["kv_dtype"] == "float8_e4m3fn" and m["kv_bytes"] <= 16 << 20
        c = openai.OpenAI(base_url=fp8["base"] + "/v1", api_key="none", timeout=120, max_retries=0)
        got = [c.completions.create(model="gemma-3-270m-q4_k_m", prompt=p, max_tokens=N_TOKENS, temperature=0)
               for p in PROMPTS]
        assert all(g.usage.completion_tokens == N_TOKENS for g in got)
        expected = getattr(pytest, "expected_greedy", None) or _dsq_run_all(PROMPTS)
        # fp8 keys/values round differently: most greedy replies still start alike
        same = sum(g.choices[0].text.split()[:1] == expected[p].split()[:1] for g, p in zip(got, PROMPTS))
        assert same >= len(PROMPTS) - 1
    finally:
        _stop(fp8)


def test_prefix_cache_hits_on_a_shared_system_prompt(server, client, model_id):
    system = "You are a patient teacher. Answer every question in one short sentence of plain words. " * 3
    before = _metrics(server)["prefix_cache_hit_tokens"]
    usages = []
    for q in ("What is rain?", "What is snow?"):
        r = client.chat.completions.create(model=model_id, max_tokens=4, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": q}])
        usages.append(r.usage)
    assert usages[0].prompt_tokens > 48
    cached = usages[1].prompt_tokens_details.cached_tokens
    assert cached >= 32 and cached % 16 == 0
    m = _metrics(server)
    assert m["prefix_cache_hit_tokens"] - before >= cached and 0 < m["prefix_cache_hit_rate"] <= 1


def _raw_post(base: str, path: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(base + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, client, model_id):
    status, body = _raw_post(server["base"], "/v1/chat/completions", b'{"messages": [')
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and "JSON" in body["error"]["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_id, prompt="word " * (CTX + 10), max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=-3)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_id, prompt="hi", max_tokens=2, temperature=-1)
    ok = client.completions.create(model=model_id, prompt="hi", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_a_client_that_disconnects_frees_its_blocks(server):
    host, port = server["base"].removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"prompt": PROMPTS[2], "max_tokens": CTX - 64, "temperature": 0, "stream": True,
                       "ignore_eos": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    for _ in range(3):  # a few events: the request is running and holds blocks
        assert resp.fp.readline()
    held = _metrics(server)["kv_blocks_held"]
    cancelled = _metrics(server)["cancelled"]
    assert held > 0
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.time() + 60
    while time.time() < deadline:
        m = _metrics(server)
        if m["kv_blocks_held"] == 0 and m["cancelled"] > cancelled:
            break
        time.sleep(0.2)
    assert m["kv_blocks_held"] == 0 and m["cancelled"] > cancelled and m["running"] == 0


@pytest.mark.parametrize("flags, needle", [(["--kv-dtype", "fp7"], "is not a KV cache dtype"),
                                           (["--block-size", "12"], "power of two"),
                                           (["--spec-tokens", "-1"], "--spec-tokens"),
                                           (["--kv-tokens", "64", "--kv-memory", "8"], "both size the KV cache")])
def test_bad_flags_are_one_line_before_loading(runner, flags, needle):
    from dsq.cli import app

    r = runner.invoke(app, ["serve", "--port", "0", *flags])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.output


def test_a_port_in_use_is_one_line(runner):
    from dsq.cli import app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        r = runner.invoke(app, ["serve", "--port", str(s.getsockname()[1])])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 1 and len(lines) == 1 and "cannot listen" in lines[0], r.output


def test_load_levels_draw_their_own_prompts_unless_asked(monkeypatch):
    """dsq bench --serve: each concurrency level sends prompts of its own (a prefix cache would
    otherwise serve a later level from an earlier one's), the same ones with --same-prompts."""
    from dsq.bench import serve_load

    sent = []
    monkeypatch.setattr(serve_load, "Target", lambda *a: type("T", (), {"model": "m"})())
    monkeypatch.setattr(serve_load, "run_level", lambda t, c, texts, *a: sent.append(texts) or (
        serve_load.Level(c, len(texts), 0, 1.0, 0, 0, 0, 0, 0, 0, None), []))
    for same in (False, True):
        sent.clear()
        r = serve_load.run_load("http://x", [1, 8, 32], 6, prompt_words=(16, 64), same_prompts=same)
        assert len(sent) == 3 and all(len(t) == 6 for t in sent) and r["same_prompts"] is same
        assert (sent[0] == sent[1] == sent[2]) is same and (len({t for ts in sent for t in ts}) == 18) is not same


def test_bench_serve_load_generator(server, runner, tmp_path):
    from dsq.cli import app

    out, png = tmp_path / "load.json", tmp_path / "load.png"
    r = runner.invoke(app, ["bench", "--serve", server["base"], "--concurrency", "1,4", "--requests", "4",
                            "--max-tokens", "4", "--prompt-tokens", "24", "--gpu-cost-per-hour", "3",
                            "--out", str(out), "--plot", str(png)])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in res["levels"]] == [1, 4] and res["model"] == "gemma-3-270m-q4_k_m"
    for lv in res["levels"]:
        assert lv["requests"] == 4 and lv["failures"] == 0 and lv["output_tok_s"] > 0
        assert 0 < lv["ttft_p50_ms"] <= lv["ttft_p99_ms"] and 0 < lv["tpot_p50_ms"] <= lv["tpot_p99_ms"]
        assert lv["cost_per_1m_output"] == pytest.approx(3 / 3600 / lv["output_tok_s"] * 1e6, rel=1e-3)
    assert png.stat().st_size > 0 and "output tok/s" in r.stdout
    s = res["levels"][0]["server"]  # dsq serve's counters over the level: 4 requests, 4 tokens each
    assert s["generated_tokens"] == 16 and s["steps"] > 0 and s["prefix_cache_lookup_tokens"] > 0
    ms = s["step_ms"]  # where the engine's loop spent the level: parts of a step within the whole
    assert ms["step"] > 0 and ms["prefill"] > 0 and ms["decode"] > 0 and ms["prefill"] + ms["decode"] <= ms["step"]
    assert ms["sync"] + ms["emit"] <= ms["decode"] and 0 < s["busy"] <= 1.05 and "ms a step" in r.stderr
    # prompts ran as eager chunks (no graphs on the CPU: nothing padded), and no GPU clock ran
    assert s["chunk_tokens"] > 0 and s["chunk_padded_tokens"] == s["chunk_tokens"] and s["chunks"] >= 4
    assert s["chunk_tokens_per_step"] > 0 and "gpu_step_ms" not in s and "GPU ms a step" not in r.stderr
    bad = runner.invoke(app, ["bench", "--serve", "http://127.0.0.1:1", "--requests", "1"])
    lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
    assert bad.exit_code == 1 and len(lines) == 1 and "no OpenAI-compatible server" in lines[0], bad.output


def test_sigterm_drains_running_requests_and_exits_0(server, client, model_id):
    """Last: stops the module's server."""
    stream = client.completions.create(model=model_id, prompt=PROMPTS[0], max_tokens=24, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    first = next(iter(stream))
    server["proc"].send_signal(signal.SIGTERM)
    rest = list(stream)
    assert rest[-1].usage.completion_tokens == 24  # the running request finished
    assert "".join(c.choices[0].text for c in [first] + rest if c.choices).strip()
    assert server["proc"].wait(60) == 0


def test_percentile_is_linear_between_ranks():
    from dsq.bench.serve_load import percentile

    v = [float(i) for i in range(100, 0, -1)]
    assert percentile(v, 50) == pytest.approx(50.5) and percentile(v, 99) == pytest.approx(99.01)
    assert percentile([], 99) == 0.0 and percentile([7.0], 99) == 7.0


def test_r1_reasoning_comes_back_as_reasoning_content():
    """An R1-style template whose prompt ends inside <think>, and a canned answer in pieces."""
    from dsq.serve.api import Api

    nm = FakeNative("{% for m in messages %}{{ m['content'] }}{% endfor %}<think>\n", ("<think>", "</think>"))
    engine = FakeEngine(nm, ("Two and ", "two.</th", "ink>\n\nIt is ", "4."))
    with serve_in_thread(Api(engine, "r1").app()) as base:
        c = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=30, max_retries=0)
        msgs = [{"role": "user", "content": "2+2?"}]
        whole = c.chat.completions.create(model="r1", messages=msgs).choices[0].message
        # as DeepSeek's API: the reasoning apart, the answer without the newlines after </think>
        assert whole.content == "It is 4." and whole.model_extra["reasoning_content"] == "Two and two."
        thought, said = "", ""
        for ch in c.chat.completions.create(model="r1", messages=msgs, stream=True):
            if ch.choices:
                d = ch.choices[0].delta
                thought += (d.model_extra or {}).get("reasoning_content") or ""
                said += d.content or ""
        assert thought == "Two and two." and said == "It is 4."
