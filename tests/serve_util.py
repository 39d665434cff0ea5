"""What the HTTP tests of `dsq serve` share (test_serve, test_serve_draft, test_serve_deepseek):
starting a server on a free port of 127.0.0.1, reading its JSON, stopping it. No `openai` here, so
a module whose tests need only these (test_serve_deepseek's GPU tests on a machine without the
client) is not skipped with test_serve."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CTX = 512


def int8_x_build() -> bool:
    """Whether the C kernels in use are the avx2 build, whose GGUF row dots round x to int8 per 32
    values: a batch of B rows and B single rows then round differently, and greedy outputs can
    split at near-ties. The equality tests here are about batching, so they keep x in float there
    (DSQ_NO_VNNI=1), as tests/test_native.py's greedy test does."""
    from dsq.kernels import cpu

    return cpu.library()[1] == "avx2"


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if int8_x_build():  # greedy equality across batch shapes is about batching, not x's rounding
        env["DSQ_NO_VNNI"] = "1"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _start(*flags: str, ctx: int = CTX, env: dict | None = None):
    """`dsq serve` on a free port of 127.0.0.1 with `flags` (a model path among them, or the
    built-in model) and `env` beside the tests' environment, once /health answers."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dsq", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--ctx", str(ctx), "--max-seqs", "8", *flags], cwd=ROOT, env={**_env(), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"dsq serve exited {proc.returncode}: {proc.stdout.read()}")
        try:
            if _get(base + "/health")["status"] == "ok":
                break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("dsq serve did not come up in 180 s")
    return {"proc": proc, "base": base}


def _stop(server) -> None:
    proc = server["proc"]
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def dsq_run(prompt: str, max_tokens: int, ctx: int = CTX) -> str:
    """What `dsq run --backend native --temperature 0` prints for PROMPT (the built-in model)."""
    out = subprocess.run([sys.executable, "-m", "dsq", "run", "--backend", "native", "-p", prompt, "--max-tokens",
                          str(max_tokens), "--temperature", "0", "--ctx", str(ctx), "--json"],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["text"]


class FakeNative:
    """What the API asks of a model: TEMPLATE as its own chat template, SPECIALS as its special
    tokens, a token a word; a prompt with SLOW in it is tokenized once `release` is set."""

    n_ctx, arch, bos_token, eos_token, add_bos = 64, "qwen2", "", "", False

    def __init__(self, template: str, specials: tuple[str, ...] = ()):
        self.template, self.specials, self.release = template, specials, threading.Event()
        self.tokenized: list[int] = []  # the length of each text tokenized

    def longest_token_bytes(self) -> int:
        return 8

    def has_token(self, t: str) -> bool:
        return t in self.specials

    def chat_template(self) -> str:
        return self.template

    def tokenize(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        self.tokenized.append(len(text))
        if "SLOW" in text:
            self.release.wait(60)
        return list(range(len(text.split())))


class FakeEngine:
    """Replies to every request with PIECES, then stops, from another thread."""

    n_ctx = 64

    def __init__(self, nm: FakeNative, pieces: tuple[str, ...] = ()):
        self.nm, self.pieces = nm, pieces

    def submit(self, req) -> None:
        from dsq.serve.engine import Event

        def go():
            for piece in self.pieces:
                req.emit(Event("text", piece))
            n = len(req.prompt)
            req.emit(Event("done", finish_reason="stop", usage={"prompt_tokens": n, "completion_tokens": len(
                self.pieces), "total_tokens": n + len(self.pieces)}))

        threading.Thread(target=go).start()

    def cancel(self, req) -> None:
        pass


@contextmanager
def serve_in_thread(app):
    """APP (an ASGI app) on uvicorn in a thread of this process, on a free port of 127.0.0.1:
    yields its base URL."""
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        deadline = time.time() + 30
        while not server.started and time.time() < deadline:
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(10)
