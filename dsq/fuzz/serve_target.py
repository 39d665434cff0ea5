"""The server target: `dsq serve` on a tiny model the fuzzer builds (a seed GGUF), in a child
process, and mutated requests thrown at it over raw sockets: JSON bodies damaged as values of
every wrong type, text and bytes, and damaged HTTP around them (methods, paths, lengths that lie,
chunked framing, odd and oversized headers, a wrong API key, clients that leave mid-request).

An input is clean when the server answers it with anything but a 5xx, or closes the connection
(a request h11 cannot parse), and is still up; a finding is a 5xx (internal), no whole answer
within the server's read deadline plus --timeout (hang), or a dead server (crash: it is started
again). Every --progress inputs, and at the end, /health must answer; at the end every KV block
must be free again once no request runs (a leak is an internal error).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from dsq.fuzz import mutate, seeds

KEY = "dsq-fuzz-key"
READ_TIMEOUT_S = 1.0  # the server's --read-timeout: a body shorter than its Content-Length waits this long
MAX_BODY_MIB = 0.25  # the server's --max-body
BODIES = [
    {"prompt": "hi there", "max_tokens": 4},
    {"prompt": "hi", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
    {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0.7, "top_p": 0.9, "seed": 5, "stop": ["x", "\n"]},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "text", "text": "2+2?"}]}], "max_completion_tokens": 3, "stream": True},
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                  {"role": "user", "content": "c"}], "max_tokens": 2, "n": 1, "logprobs": False, "user": "u"},
]
PATHS = ["/v1/completions", "/v1/chat/completions"]
ODD_PATHS = ["/v1/models", "/health", "/metrics", "/metrics?format=json", "/v1/completions/", "//v1/completions",
             "/v1/completions?x=%ff%00", "/v1/chat/completions#x", "/v1/%2e%2e/metrics", "/" + "a" * 9000, "*"]
METHODS = ["GET", "PUT", "DELETE", "OPTIONS", "HEAD", "PATCH", "POST ", "P\x00ST", "CONNECT"]


def request(method: str, path: str, body: bytes, headers: list[tuple[str, str]], version: str = "HTTP/1.1") -> bytes:
    head = f"{method} {path} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
    return head.encode("utf-8", "surrogateescape") + body


def make(rng: random.Random) -> bytes:
    """One request as the bytes a client sends (Connection: close, so its answer ends at EOF)."""
    body_obj = json.loads(json.dumps(rng.choice(BODIES)))
    path = PATHS["messages" in body_obj]
    r = rng.random()
    if r < 0.45:
        body_obj = mutate.json_mutation(rng, body_obj)
        body = json.dumps(body_obj).encode()
    elif r < 0.65:
        body = mutate.json_text_mutation(rng, json.dumps(body_obj)).encode("utf-8", "surrogatepass")
    elif r < 0.8:
        body = mutate.byte_mutation(rng, json.dumps(body_obj).encode())
    else:
        body = json.dumps(body_obj).encode()
    method = "POST"
    headers = [("Host", "127.0.0.1"), ("Content-Type", "application/json"), ("Authorization", f"Bearer {KEY}"),
               ("Connection", "close"), ("Content-Length", str(len(body)))]
    version = "HTTP/1.1"
    for _ in range(rng.choice((0, 0, 1, 1, 2))):
        kind = rng.randrange(12)
        if kind == 0:
            method = rng.choice(METHODS)
        elif kind == 1:
            path = rng.choice(ODD_PATHS)
        elif kind == 2:  # a Content-Length that lies, or is no number
            headers[4] = ("Content-Length", rng.choice([str(max(0, len(body) - rng.randrange(1, 64))),
                                                        str(len(body) + rng.randrange(1, 64)), "-1", "abc",
                                                        "99999999999999999999", f"{len(body)}, {len(body)}"]))
        elif kind == 3:  # chunked framing, well or badly formed
            del headers[4]
            headers.append(("Transfer-Encoding", "chunked"))
            cut = rng.randrange(len(body) + 1)
            parts = [body[:cut], body[cut:]]
            body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts if p) + b"0\r\n\r\n"
            if rng.random() < 0.5:
                body = mutate.byte_mutation(rng, body)
        elif kind == 4:
            headers[2] = ("Authorization", rng.choice(["Bearer wrong", "Basic " + KEY, "Bearer", "", "Bearer " + KEY
                                                       + " x", "bearer " + KEY, "Bearer \udcff" + KEY]))
        elif kind == 5:
            headers[1] = ("Content-Type", rng.choice(["text/plain", "application/json; charset=latin-1", "", "x" * 300,
                                                      "multipart/form-data; boundary=x"]))
        elif kind == 6:
            headers.append(("X-" + "a" * rng.choice((8, 5000)), "v" * rng.choice((1, 20000))))
        elif kind == 7:
            headers.append(("Content-Length", str(len(body) + rng.choice((0, 1)))))
        elif kind == 8:
            headers.append((rng.choice(["X-\udcc3\udca9", "Bad Header", "X:Y", ""]), "\udcff\udcfe v"))
        elif kind == 9:
            version = rng.choice(["HTTP/1.0", "HTTP/2.0", "HTTP/1.1x", "HTTP/0.9"])
        elif kind == 10:
            headers.append(("Expect", "100-continue"))
        else:
            body = body * rng.randrange(2, 6)
    return request(method, path, body, headers, version)


class Server:
    """`dsq serve MODEL` on a free port, started again whenever it is found dead."""

    def __init__(self, model: Path, work: Path):
        self.model, self.work, self.proc, self.port = model, work, None, 0
        self.log = work / "serve.log"

    def start(self, limit: float = 300) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = dict(os.environ, DSQ_QUIET="1", GGML_NO_BACKTRACE="1")
        env.pop("DSQ_API_KEY", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dsq", "serve", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
             "--ctx", "128", "--max-seqs", "4", "--kv-tokens", "512", "--api-key", KEY, "--read-timeout",
             str(READ_TIMEOUT_S), "--write-timeout", "5", "--max-body", str(MAX_BODY_MIB), "--drain", "1"],
            stdout=subprocess.DEVNULL, stderr=self.log.open("ab"), env=env, start_new_session=True)
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dsq serve exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            if self.healthy(2.0):
                return
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"dsq serve did not come up in {limit:.0f} s")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self, timeout: float) -> bool:
        reply = self.send(request("GET", "/health", b"", [("Host", "x"), ("Connection", "close")]), timeout)
        return reply is not None and reply.startswith(b"HTTP/1.1 200")

    def get_json(self, path: str) -> dict | None:
        reply = self.send(request("GET", path, b"", [("Host", "x"), ("Connection", "close"),
                                                     ("Authorization", f"Bearer {KEY}")]), 10)
        try:
            return json.loads(reply.partition(b"\r\n\r\n")[2]) if reply else None
        except ValueError:
            return None

    def send(self, raw: bytes, timeout: float) -> bytes | None:
        """The whole answer to RAW (to EOF), b"" when the server closed or reset the connection
        without one, None when it did not finish within TIMEOUT seconds."""
        deadline = time.monotonic() + timeout
        out = b""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
                try:
                    s.sendall(raw)
                except (BrokenPipeError, ConnectionResetError):  # refused before the request ended
                    pass
                while (left := deadline - time.monotonic()) > 0:
                    s.settimeout(left)
                    chunk = s.recv(65536)
                    if not chunk:
                        return out
                    out += chunk
                return None
        except socket.timeout:
            return None
        except (ConnectionResetError, BrokenPipeError):
            return out
        except ConnectionRefusedError:
            return b""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def status_of(reply: bytes) -> int:
    """The status of an HTTP/1.x answer, 0 for none."""
    if not reply.startswith(b"HTTP/1."):
        return 0
    try:
        return int(reply.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0


def classify(reply: bytes | None, alive: bool) -> tuple[str, str]:
    """(outcome, detail) of one answer: clean, crash (the server is dead), hang (no whole answer
    in time) or internal (a 5xx)."""
    if not alive:
        return "crash", "the server died"
    if reply is None:
        return "hang", "no whole answer in time"
    status = status_of(reply)
    if status >= 500:
        return "internal", reply[:2000].decode("utf-8", "replace")
    return "clean", str(status)


class ServeTarget:
    name = "serve"

    def __init__(self, root: Path, work: Path, timeout: float):
        self.server = Server(seeds.gguf_seeds(root)[0], work)
        self.timeout = timeout

    def __enter__(self) -> "ServeTarget":
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()

    def one(self, raw: bytes) -> tuple[str, str]:
        reply = self.server.send(raw, READ_TIMEOUT_S + self.timeout)
        if reply is None and self.server.alive():  # once more, alone: a busy machine can stall an answer
            reply = self.server.send(raw, READ_TIMEOUT_S + 6 * self.timeout)
        outcome, detail = classify(reply, self.server.alive())
        if outcome == "crash":
            self.server.start()
        return outcome, detail

    def check(self) -> tuple[str, str]:
        """That the server is up and answers /health."""
        if not self.server.alive():
            self.server.start()
            return "crash", "the server died"
        if not self.server.healthy(6 * self.timeout):
            return "hang", "/health did not answer"
        return "clean", ""

    def settled(self, seconds: float = 30) -> tuple[str, str]:
        """That every KV block is free again once no request runs or waits."""
        deadline = time.monotonic() + seconds
        m = None
        while time.monotonic() < deadline:
            m = self.server.get_json("/metrics?format=json")
            if m and m.get("kv_blocks_held") == 0 and m.get("running") == 0 and m.get("waiting") == 0:
                return "clean", ""
            time.sleep(0.2)
        return "internal", f"KV blocks still held with no request running: {m}"


def run_serve(iterations: int, seed: int, timeout: float, tally, work: Path, progress: int,
              target: ServeTarget | None = None) -> None:
    """ITERATIONS mutated requests at a server of its own (or TARGET's, already started)."""
    work.mkdir(parents=True, exist_ok=True)
    if target is None:
        with ServeTarget(work / "seeds", work, timeout) as target:
            return run_serve(iterations, seed, timeout, tally, work, progress, target)
    rng = random.Random(seed)
    for i in range(iterations):
        if tally.out_of_time():
            break
        raw = make(rng)
        t0 = time.monotonic()
        outcome, detail = target.one(raw)
        tally.add(outcome, time.monotonic() - t0, outcome == "clean" and not detail.startswith("2"))
        if outcome != "clean":
            tally.keep("serve", outcome, {"request.http": raw}, detail)
        if progress and (i + 1) % progress == 0:
            _after(target.check(), tally)
            print(tally.line(), flush=True)
    _after(target.check(), tally)
    _after(target.settled(), tally)


def _after(result: tuple[str, str], tally) -> None:
    """A check between inputs, counted only when it finds something (no one input to keep)."""
    outcome, detail = result
    if outcome != "clean":
        tally.add(outcome, 0.0)
        print(f"[{outcome}] serve: {detail[:300]}", flush=True)
