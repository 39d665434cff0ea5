"""`dsq serve` against hostile clients, over real HTTP (http.client, the `openai` client, raw
sockets for what no polite client sends) to a server on 127.0.0.1 with the built-in model, its
API key from DSQ_API_KEY and short deadlines: the key on every endpoint but /health, each limit's
4xx, clients that disconnect, trickle their request or never read, and a soak of 1,000 requests
after which the pool is all free, RSS is flat and a greedy reply still equals `dsq run`'s.

Every wait is bounded."""

from __future__ import annotations

import errno
import http.client
import json
import random
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")
pytest.importorskip("uvicorn")

from serve_util import CTX, FakeEngine, FakeNative, _start, _stop, dsq_run, serve_in_thread  # noqa: E402

KEY = "dsq-test-key-7f3a9c"
READ_S = WRITE_S = 2.0  # the server's --read-timeout and --write-timeout here
MAX_BODY = 256 * 1024  # --max-body 0.25 (MiB)
PROMPT = "The history of the Roman Empire"


@pytest.fixture(scope="module")
def server():
    s = _start("--read-timeout", str(READ_S), "--write-timeout", str(WRITE_S), "--max-body", "0.25",
               env={"DSQ_API_KEY": KEY})
    host, port = s["base"].removeprefix("http://").split(":")
    s["addr"] = (host, int(port))
    yield s
    _stop(s)


def _request(server, method: str, path: str, body=None, key: str | None = KEY, headers: dict | None = None):
    """(status, parsed JSON) of one request on a connection of its own."""
    conn = http.client.HTTPConnection(*server["addr"], timeout=120)
    try:
        h = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key is not None else {}),
             **(headers or {})}
        conn.request(method, path, json.dumps(body).encode() if isinstance(body, (dict, list)) else body, h)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def _metrics(server) -> dict:
    status, m = _request(server, "GET", "/metrics?format=json")
    assert status == 200
    return m


def _settled(server, seconds: float = 30) -> dict:
    """/metrics once no request runs or waits and no KV block is held (or after SECONDS)."""
    deadline = time.time() + seconds
    while True:
        m = _metrics(server)
        if (m["kv_blocks_held"] == 0 and m["running"] == 0 and m["waiting"] == 0) or time.time() > deadline:
            return m
        time.sleep(0.1)


def _http(path: str, body: bytes, key: str | None = KEY, extra: bytes = b"") -> bytes:
    """A whole POST request as bytes (Connection: close, so the reply ends at EOF)."""
    auth = b"Authorization: Bearer " + key.encode() + b"\r\n" if key is not None else b""
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + auth
            + extra + b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def _status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0


def _error(reply: bytes) -> dict:
    return json.loads(reply.partition(b"\r\n\r\n")[2])["error"]


# -- the API key --------------------------------------------------------------------------------------
def test_the_api_key_guards_every_endpoint_but_health(server):
    assert _request(server, "GET", "/health", key=None) == (200, {"status": "ok"})
    ends = [("GET", "/v1/models", None), ("GET", "/metrics", None), ("GET", "/no/such/path", None),
            ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
            ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})]
    wrong = [None, "", KEY[:-1] + "X", KEY + "x", KEY[:4]]
    for method, path, body in ends:
        for key in wrong:
            status, err = _request(server, method, path, body, key=key)
            assert status == 401 and err["error"]["code"] == "invalid_api_key", (path, key)
            assert err["error"]["type"] == "invalid_request_error" and "API key" in err["error"]["message"]
        status, _ = _request(server, method, path, body, key=None, headers={"Authorization": f"Basic {KEY}"})
        assert status == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server["base"] + "/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEY, timeout=120, max_retries=0)
    assert client.models.list().data[0].id == "gemma-3-270m-q4_k_m"
    assert client.completions.create(model="gemma-3-270m-q4_k_m", prompt="hi", max_tokens=1).usage.completion_tokens
    assert _metrics(server)["kv_blocks_total"] > 0


@pytest.mark.parametrize("flags, env, needle", [(["--api-key", " "], {}, "--api-key"),
                                                ([], {"DSQ_API_KEY": " "}, "--api-key"),
                                                (["--max-body", "0"], {}, "--max-body"),
                                                (["--read-timeout", "-1"], {}, "--read-timeout"),
                                                (["--max-connections", "0"], {}, "--max-connections")])
def test_bad_guard_flags_are_one_line_before_loading(runner, flags, env, needle):
    from dsq.cli import app

    r = runner.invoke(app, ["serve", "--port", "0", *flags], env=env)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.output


# -- limits: each gets its 4xx, in OpenAI's error object ----------------------------------------------
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
C, CC = "/v1/completions", "/v1/chat/completions"
BAD = [  # (id, path, body, status, param, code)
    ("bad-utf8", C, b'{"prompt": "caf\xc3 \xff\xfe"}', 400, None, "invalid_utf8"),
    ("deep-arrays", C, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None, "too_deep"),
    ("deep-objects", CC, b'{"messages": [' + b'{"a": ' * 20_000 + b"1" + b"}" * 20_000 + b"]}", 400, None, "too_deep"),
    ("not-json", C, b'{"prompt": ', 400, None, "invalid_json"),
    ("nan", C, b'{"prompt": "hi", "temperature": NaN}', 400, None, "invalid_json"),
    ("5000-digit-int", C, b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", 400, None, "invalid_json"),
    ("lone-surrogate", C, b'{"prompt": "a\\ud800b"}', 400, None, "invalid_unicode"),
    ("not-an-object", C, b'["prompt"]', 400, None, None),
    ("unknown-field", C, {"prompt": "hi", "max_tokens": 1, "best_off": 2}, 400, "best_off", "unknown_parameter"),
    ("unknown-chat-field", CC, {**CHAT, "toolz": []}, 400, "toolz", "unknown_parameter"),
    ("max_tokens-string", C, {"prompt": "hi", "max_tokens": "2"}, 400, "max_tokens", "invalid_type"),
    ("stream-string", C, {"prompt": "hi", "stream": "yes"}, 400, "stream", "invalid_type"),
    ("temperature-bool", C, {"prompt": "hi", "temperature": True}, 400, "temperature", "invalid_type"),
    ("messages-string", CC, {"messages": "hi"}, 400, "messages", "invalid_type"),
    ("text-part-number", CC, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400,
     "messages", None),
    ("stop-number", C, {"prompt": "hi", "stop": 5}, 400, "stop", "invalid_type"),
    ("stream_options-extra", C, {"prompt": "hi", "stream": True, "stream_options": {"x": 1}}, 400,
     "stream_options", None),
    ("n-2", C, {"prompt": "hi", "n": 2}, 400, "n", "unsupported_value"),
    ("n-0", C, {"prompt": "hi", "n": 0}, 400, "n", None),
    ("n-2-chat", CC, {**CHAT, "n": 2}, 400, "n", "unsupported_value"),
    ("logprobs-out-of-range", C, {"prompt": "hi", "logprobs": 9}, 400, "logprobs", None),
    ("logprobs", C, {"prompt": "hi", "logprobs": 2}, 400, "logprobs", "unsupported_value"),
    ("chat-logprobs", CC, {**CHAT, "logprobs": True}, 400, "logprobs", "unsupported_value"),
    ("chat-top_logprobs-out-of-range", CC, {**CHAT, "top_logprobs": 21}, 400, "top_logprobs", None),
    ("chat-top_logprobs", CC, {**CHAT, "top_logprobs": 3}, 400, "top_logprobs", "unsupported_value"),
    ("penalty", C, {"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty", "unsupported_value"),
    ("prompt-past-context", C, {"prompt": "word " * (CTX + 10), "max_tokens": 1}, 400, "prompt",
     "context_length_exceeded"),
    ("prompt-ids-past-context", C, {"prompt": [2] * CTX, "max_tokens": 1}, 400, "prompt", "context_length_exceeded"),
    ("max_tokens-past-context", C, {"prompt": "hi", "max_tokens": CTX}, 400, "max_tokens", "context_length_exceeded"),
    ("max_completion_tokens-past-context", CC, {**CHAT, "max_completion_tokens": CTX}, 400, "max_completion_tokens",
     "context_length_exceeded"),
    ("body-past-max-body", C, {"prompt": "a" * MAX_BODY}, 413, None, "request_too_large"),
]


@pytest.mark.parametrize("path, body, status, param, code", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_each_limit_gets_its_4xx(server, path, body, status, param, code):
    got, reply = _request(server, "POST", path, body)
    assert got == status and set(reply) == {"error"}, reply
    err = reply["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["message"] and err["param"] == param and (code is None or err["code"] == code), err


def test_neutral_openai_fields_are_taken(server):
    """OpenAI's own fields at their neutral values (as SDKs send them) pass; null is a default."""
    body = {"prompt": "hi", "max_tokens": 1, "n": 1, "logprobs": None, "presence_penalty": 0, "frequency_penalty": 0,
            "logit_bias": {}, "user": "u1", "echo": False, "best_of": 1, "seed": None, "stop": None}
    status, reply = _request(server, "POST", C, body)
    assert status == 200 and reply["usage"]["completion_tokens"] == 1
    status, reply = _request(server, "POST", CC, {**CHAT, "logprobs": False, "top_logprobs": 0, "max_tokens": None,
                                                  "max_completion_tokens": 1})
    assert status == 200 and reply["usage"]["completion_tokens"] == 1


def test_the_body_cap_holds_while_the_body_arrives(server):
    """A Content-Length past --max-body gets 413 before any body is sent; a chunked body gets it
    once its bytes pass the cap, before its end."""
    with socket.create_connection(server["addr"], timeout=30) as s:
        s.sendall(_http(C, b"").replace(b"Content-Length: 0", b"Content-Length: 999999999"))
        reply = _read_all(s)
    assert _status(reply) == 413 and _error(reply)["code"] == "request_too_large"
    with socket.create_connection(server["addr"], timeout=30) as s:
        head = _http(C, b"").replace(b"Content-Length: 0\r\n", b"Transfer-Encoding: chunked\r\n")
        s.sendall(head)
        chunk = b"a" * 65536
        try:
            for _ in range(MAX_BODY // len(chunk) + 2):  # past the cap, and no last chunk
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except OSError:  # the server may close its end once it has answered
            pass
        reply = _read_all(s)
    assert _status(reply) == 413 and _error(reply)["code"] == "request_too_large"
    assert _request(server, "POST", C, {"prompt": "hi", "max_tokens": 1})[0] == 200


# -- clients that go away, trickle, or never read ------------------------------------------------------
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_that_disconnects_frees_its_sequence_and_blocks(server, stream):
    before = _settled(server)
    body = json.dumps({"prompt": PROMPT, "max_tokens": CTX - 64, "temperature": 0, "ignore_eos": True,
                       "stream": stream}).encode()
    s = socket.create_connection(server["addr"], timeout=60)
    s.sendall(_http(C, body))
    got = b""
    while stream and b"data: " not in got:  # its first event: it runs
        got += s.recv(4096)
    deadline = time.time() + 60
    while (m := _metrics(server))["running"] == 0 and time.time() < deadline:
        time.sleep(0.05)
    assert m["running"] == 1 and m["kv_blocks_held"] > 0
    s.close()
    m = _settled(server)
    assert m["kv_blocks_held"] == 0 and m["running"] == 0 and m["cancelled"] == before["cancelled"] + 1
    assert m["generated_tokens"] - before["generated_tokens"] < CTX - 64  # stopped, not run to its end


@pytest.mark.parametrize("kind", ["headers", "body", "nothing"])
def test_a_slow_client_is_cut_off_without_stalling_others(server, kind):
    """Slowloris: headers (or a body) a few bytes at a time, or a connection that sends nothing.
    Another client is served meanwhile; the slow one gets 408 once --read-timeout passes."""
    s = socket.create_connection(server["addr"], timeout=60)
    stop = threading.Event()

    def trickle():
        try:
            if kind == "headers":
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            elif kind == "body":
                s.sendall(_http(C, b"").replace(b"Content-Length: 0", b"Content-Length: 4096"))
            while not stop.wait(0.2):
                if kind != "nothing":
                    s.sendall(b"X-Slow: 1\r\n" if kind == "headers" else b" ")
        except OSError:  # cut off
            pass

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        status, reply = _request(server, "POST", C, {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert status == 200 and reply["usage"]["completion_tokens"] >= 1
        got = _read_all(s)  # returns at EOF: the server closed the connection
    finally:
        stop.set()
        t.join(10)
        s.close()
    assert _status(got) == 408 and _error(got)["code"] == "request_timeout", got[:200]


def test_a_client_that_never_reads_is_cut_off(server):
    """A streaming client that reads nothing: once its output sits unacknowledged for
    --write-timeout, the connection is reset and its request cancelled; others are served
    meanwhile."""
    before = _settled(server)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's output backs up
    s.settimeout(60)
    s.connect(server["addr"])
    try:
        s.sendall(_http(C, json.dumps({"prompt": PROMPT, "max_tokens": CTX - 64, "temperature": 0, "stream": True,
                                       "ignore_eos": True}).encode()))
        status, reply = _request(server, "POST", C, {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert status == 200 and reply["usage"]["completion_tokens"] >= 1
        deadline, err = time.time() + 120, 0
        while not err and time.time() < deadline:
            err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            time.sleep(0.1)
        assert err == errno.ECONNRESET
        assert b"data: [DONE]" not in _read_all(s)
    finally:
        s.close()
    m = _settled(server)
    assert m["kv_blocks_held"] == 0 and m["running"] == 0 and m["cancelled"] == before["cancelled"] + 1


# -- the soak -----------------------------------------------------------------------------------------
def _valid(rng: random.Random, stream: bool, max_tokens: int) -> tuple[str, bytes]:
    if rng.random() < 0.5:
        body = {"prompt": rng.choice(["Once upon a time", "def f(x):", "The sky is", "1, 2, 3,"])}
        path = C
    else:
        body = {"messages": [{"role": "user", "content": rng.choice(["Hi", "Name a color.", "Count to 3."])}]}
        path = CC
    body |= {"max_tokens": max_tokens, "temperature": rng.choice([0, 0.8]), "stream": stream}
    return path, json.dumps(body).encode()


def _garbage(rng: random.Random) -> bytes:
    """A request that must get a 4xx: one of BAD's bodies, a wrong key, or random bytes as a body."""
    pick = rng.random()
    if pick < 0.6:
        _, path, body, *_ = rng.choice([b for b in BAD if b[0] not in ("body-past-max-body", "deep-arrays",
                                                                       "deep-objects")])
        return _http(path, body if isinstance(body, bytes) else json.dumps(body).encode())
    if pick < 0.75:
        return _http(C, b'{"prompt": "hi"}', key=rng.choice([None, "nope"]))
    return _http(rng.choice([C, CC]), rng.randbytes(rng.randrange(1, 512)))


def _one(addr, seed: int) -> str:
    """One soak request of a random kind; returns what became of it ('ok', '4xx', 'dropped')."""
    rng = random.Random(seed)
    kind = rng.choices(["bad", "half", "drop-stream", "drop-whole", "ok"], [45, 15, 15, 10, 15])[0]
    with socket.create_connection(addr, timeout=120) as s:
        if kind == "bad":
            s.sendall(_garbage(rng))
            reply = _read_all(s)
            assert 400 <= _status(reply) < 500, reply[:300]
            return "4xx"
        if kind == "half":  # the request cut anywhere, then the connection closed
            req = _http(*_valid(rng, rng.random() < 0.5, 4))
            s.sendall(req[:rng.randrange(1, len(req))])
            return "dropped"
        if kind.startswith("drop"):
            s.sendall(_http(*_valid(rng, kind == "drop-stream", rng.randrange(8, 64))))
            if kind == "drop-stream" and rng.random() < 0.5:
                s.recv(rng.randrange(1, 2048))
            else:
                time.sleep(rng.random() * 0.3)
            if rng.random() < 0.5:  # close with a reset rather than a FIN
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return "dropped"
        stream = rng.random() < 0.5
        s.sendall(_http(*_valid(rng, stream, rng.randrange(1, 4))))
        reply = _read_all(s)
        assert _status(reply) == 200, reply[:300]
        assert (b"data: [DONE]" if stream else b'"completion_tokens"') in reply
        return "ok"


def _soak(server, seeds: range) -> dict[str, int]:
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda i: _one(server["addr"], i), seeds, timeout=300))
    return {k: outcomes.count(k) for k in set(outcomes)}


def test_a_soak_of_1000_hostile_requests_leaves_no_trace(server):
    proc = psutil.Process(server["proc"].pid)
    _soak(server, range(10_000, 10_200))  # warm-up: allocators, caches, the template
    assert _settled(server)["kv_blocks_held"] == 0
    rss0 = proc.memory_info().rss
    counts = _soak(server, range(1000))
    m = _settled(server)
    rss1 = proc.memory_info().rss
    assert sum(counts.values()) == 1000 and min(counts.get(k, 0) for k in ("ok", "4xx", "dropped")) > 50, counts
    assert m["kv_blocks_held"] == 0 and m["running"] == 0 and m["waiting"] == 0 and m["failed"] == 0, m
    assert rss1 - rss0 < 48 * 2**20, f"RSS grew {(rss1 - rss0) / 2**20:.1f} MiB over the soak"
    client = openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEY, timeout=120, max_retries=0)
    got = client.completions.create(model="gemma-3-270m-q4_k_m", prompt=PROMPT, max_tokens=16, temperature=0)
    assert got.choices[0].text == dsq_run(PROMPT, 16)


# -- a chat template that refuses some messages -------------------------------------------------------
STRICT = ("{% for m in messages %}{% if loop.index0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
          "{{ raise_exception('roles must alternate') }}{% endif %}{{ m['content'] }} {% endfor %}")


@pytest.fixture
def fake_server():
    """The API behind the guard, in this process, on a fake engine whose model's own chat template
    refuses two turns of one role in a row (as Gemma's and Llama 2's raise_exception do)."""
    from dsq.serve.api import Api
    from dsq.serve.guard import Guard, Limits

    engine = FakeEngine(FakeNative(STRICT))
    with serve_in_thread(Guard(Api(engine, "strict").app(), Limits())) as base:
        host, port = base.removeprefix("http://").split(":")
        try:
            yield {"addr": (host, int(port)), "engine": engine}
        finally:
            engine.nm.release.set()  # a request still tokenizing ends before the server stops


def test_a_prompt_being_tokenized_holds_up_no_other_client(fake_server):
    """Tokenizing runs off the event loop: while one request's prompt is still being tokenized,
    another request is answered."""
    s = fake_server
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(_request, s, "POST", C, {"prompt": "SLOW " * 8}, key=None)
        time.sleep(0.5)  # (its tokenizing has begun, or begins after the next request: either way it waits)
        status, reply = _request(s, "POST", C, {"prompt": "a b c"}, key=None)
        assert status == 200 and reply["usage"]["prompt_tokens"] == 3 and not slow.done()
        s["engine"].nm.release.set()
        assert slow.result(60)[0] == 200


def test_messages_a_template_refuses_get_400_and_the_template_stays(fake_server):
    """A request whose messages the model's template refuses gets a 400 naming why; the template
    does not give way to the architecture's for every later request."""
    s = fake_server
    bad = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    good = {"messages": [{"role": "user", "content": "a b c"}]}
    for body, status in [(bad, 400), (good, 200), (bad, 400)]:
        got, reply = _request(s, "POST", CC, body, key=None)
        assert got == status, reply
        if status == 400:
            err = reply["error"]
            assert err["code"] == "invalid_messages" and "roles must alternate" in err["message"]
        else:
            assert reply["usage"]["prompt_tokens"] == 3  # the model's template: "a b c "


def test_a_prompt_far_past_the_context_is_refused_before_it_is_tokenized(fake_server):
    """A prompt longer than the context's tokens could spell (each at most the vocabulary's
    longest, 8 bytes for the fake model) gets 400 by its length alone: the tokenizer never sees
    it. One within that length is tokenized and counted."""
    s = fake_server
    nm = s["engine"].nm
    cap = 64 * 8 * 2  # n_ctx x longest token x api.NORMALIZE_SLACK
    for path, body, param in [(C, {"prompt": "a " * cap}, "prompt"),
                              (CC, {"messages": [{"role": "user", "content": "a " * cap}]}, "messages")]:
        status, reply = _request(s, "POST", path, body, key=None)
        err = reply["error"]
        assert status == 400 and err["code"] == "context_length_exceeded" and err["param"] == param, reply
        assert "characters" in err["message"] and "context of 64 tokens" in err["message"], err
    assert not any(n > cap for n in nm.tokenized), nm.tokenized
    status, reply = _request(s, "POST", C, {"prompt": "a " * 100}, key=None)  # 200 characters, 100 tokens
    assert status == 400 and "100 tokens" in reply["error"]["message"] and 200 in nm.tokenized


def test_a_huge_prompt_gets_400_by_its_length_on_the_real_model(server):
    status, reply = _request(server, "POST", C, {"prompt": "x" * (MAX_BODY - 1024), "max_tokens": 1})
    err = reply["error"]
    assert status == 400 and err["code"] == "context_length_exceeded" and "characters" in err["message"], reply
    assert _request(server, "POST", C, {"prompt": "hi", "max_tokens": 1})[0] == 200


def test_a_connection_past_max_connections_gets_503_and_the_others_are_served():
    """--max-connections 2: with two connections open (one mid-request, one idle between
    requests), a request on a third gets 503 and its connection closes; the two go on being
    served, and once one closes a new connection is served."""
    import uvicorn

    from dsq.serve.api import Api
    from dsq.serve.guard import Limits
    from dsq.serve.server import uvicorn_config
    from serve_util import _free_port

    engine = FakeEngine(FakeNative(STRICT), ("ok",))
    port = _free_port()
    server = uvicorn.Server(uvicorn_config(Api(engine, "m").app(), "127.0.0.1", port, Limits(max_connections=2)))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    addr = ("127.0.0.1", port)

    def post(conn, prompt: str):
        conn.request("POST", C, json.dumps({"prompt": prompt}), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read(), r.getheader("connection")

    try:
        deadline = time.time() + 30
        while not server.started and time.time() < deadline:
            time.sleep(0.05)
        busy, idle = http.client.HTTPConnection(*addr, timeout=30), http.client.HTTPConnection(*addr, timeout=30)
        assert post(idle, "a b")[0] == 200
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(post, busy, "SLOW a")
            time.sleep(0.3)
            extra = http.client.HTTPConnection(*addr, timeout=30)
            status, body, connection = post(extra, "a b")
            assert status == 503 and connection == "close", (status, body)
            extra.close()
            assert post(idle, "a b c")[0] == 200 and not slow.done()
            engine.nm.release.set()
            assert slow.result(30)[0] == 200
        idle.close()
        time.sleep(0.3)  # (the server sees the close)
        fresh = http.client.HTTPConnection(*addr, timeout=30)
        assert post(fresh, "a")[0] == 200
        fresh.close()
        busy.close()
    finally:
        engine.nm.release.set()
        server.should_exit = True
        t.join(10)


@pytest.mark.parametrize("how", ["flag", "env", "none", "wrong"])
def test_bench_serve_sends_the_api_key(server, runner, tmp_path, how):
    """dsq bench --serve against a server with a key: --api-key or DSQ_API_KEY gets through;
    none or a wrong one is one line saying to pass it."""
    from dsq.cli import app

    flags = {"flag": ["--api-key", KEY], "wrong": ["--api-key", "nope"]}.get(how, [])
    env = {"DSQ_API_KEY": KEY} if how == "env" else {}
    out = tmp_path / "load.json"
    r = runner.invoke(app, ["bench", "--serve", server["base"], "--concurrency", "1", "--requests", "2",
                            "--max-tokens", "2", "--prompt-tokens", "16", "--out", str(out), *flags], env=env)
    if how in ("flag", "env"):
        assert r.exit_code == 0, r.output
        level = json.loads(out.read_text())["levels"][0]
        assert level["failures"] == 0 and level["server"]["generated_tokens"] == 4, level
    else:
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.exit_code == 1 and len(lines) == 1 and "HTTP 401" in lines[0] and "--api-key" in lines[0], r.output
        assert not out.exists()


def test_sigterm_during_the_warm_up_stops_the_server(monkeypatch, capsys):
    """A SIGTERM while the GPU kernels warm up (minutes on a cold cache) stops `dsq serve` there,
    status 0 and one line, without ever listening; the kernels' guards, which catch a failing
    kernel's Exception and go on, do not swallow it. After the warm-up SIGTERM is uvicorn's drain."""
    import os
    import signal
    import types

    import uvicorn

    from dsq.serve import server as srv

    class WarmingEngine:
        device = types.SimpleNamespace(type="cuda")
        max_seqs, prefill_chunk, ranks = 4, 64, None
        warmed = False

        def warm_up(self):
            try:  # as dispatch._guarded does around a kernel
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            except Exception:  # noqa: BLE001
                pass
            WarmingEngine.warmed = True
            return {"graphs": [], "chunk_graphs": []}

        def start(self):
            raise AssertionError("the engine started after a SIGTERM in its warm-up")

    monkeypatch.setattr(uvicorn.Server, "run", lambda self: (_ for _ in ()).throw(AssertionError("listened")))
    before = signal.getsignal(signal.SIGTERM)
    api = types.SimpleNamespace(app=lambda: None, model_id="m")
    t0 = time.perf_counter()
    try:
        assert srv.run(WarmingEngine(), api, "127.0.0.1", 0) is None
    finally:
        signal.signal(signal.SIGTERM, before)
    assert time.perf_counter() - t0 < 4 and not WarmingEngine.warmed
    assert capsys.readouterr().err.strip().splitlines()[-1] == "dsq serve: stopped during the warm-up"
