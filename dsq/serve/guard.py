"""What keeps `dsq serve` up against hostile clients, on uvicorn's own HTTP stack (h11):

- `Guard`, an ASGI middleware: the API key (--api-key) on every path but /health, compared in
  constant time; the request body read whole before the app sees it, refused with 413 once it
  passes --max-body (at once when its Content-Length says so, else while it arrives).
- `protocol()`, uvicorn's h11 protocol with two deadlines a connection: a request's headers and
  body must arrive within --read-timeout of the connection opening (or of the previous reply's
  end), else 408 and the connection closes (slowloris); output the client leaves unread for
  --write-timeout aborts the connection (a reader that never reads), which cancels its request.

A stalled connection holds a socket and its own buffers, never the engine: the loop does not wait
for any client.
"""

from __future__ import annotations

import hmac
import json
import socket
import struct
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol

from dsq.serve.api import error_body

MIB = 2**20
MAX_BODY_MB = 4.0  # a 32k-token prompt as text or token ids is under 1 MiB; room for long chats
READ_TIMEOUT_S = 30.0  # headers and body of one request, from the connection's open (or last reply)
WRITE_TIMEOUT_S = 60.0  # a client that takes none of the pending output this long is gone


@dataclass
class Limits:
    api_key: str | None = None
    max_body: int = int(MAX_BODY_MB * MIB)
    read_timeout: float = READ_TIMEOUT_S
    write_timeout: float = WRITE_TIMEOUT_S
    max_connections: int | None = None  # open connections served at once (None: no limit)


async def _reply(send, status: int, message: str, code: str | None = None, close: bool = False,
                 headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(error_body(message, code=code)).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    if close:  # h11 closes the connection after this reply: the rest of a refused body is not read
        hdrs.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class Guard:
    """The API key and the body cap in front of the app (Api.app())."""

    def __init__(self, app, limits: Limits):
        self.app, self.limits = app, limits
        self.key = limits.api_key.encode() if limits.api_key else None

    def _authorized(self, scope) -> bool:
        got = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                got = value
        scheme, _, token = got.partition(b" ")
        # compare_digest's time depends on the lengths only, never on where the bytes differ
        return hmac.compare_digest(token.strip() if scheme.lower() == b"bearer" else b"", self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.key is not None and scope["path"] != "/health" and not self._authorized(scope):
            return await _reply(send, 401, "a missing or wrong API key: send 'Authorization: Bearer KEY' with the "
                                "key the server was started with (--api-key or DSQ_API_KEY)", "invalid_api_key",
                                headers=[(b"www-authenticate", b"Bearer")])
        cap = self.limits.max_body
        too_big = f"the request body is over {cap} bytes (--max-body)"
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > cap:
                return await _reply(send, 413, too_big, "request_too_large", close=True)
        body = bytearray()
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            if len(body) > cap:
                return await _reply(send, 413, too_big, "request_too_large", close=True)
            if not msg.get("more_body", False):
                break
        first = [{"type": "http.request", "body": bytes(body), "more_body": False}]

        async def replay():
            return first.pop() if first else await receive()

        await self.app(scope, replay, send)


def _unsent(sock) -> int:
    """Bytes the kernel holds for the peer, sent or not, but not yet acknowledged (Linux's
    TIOCOUTQ); 0 where that cannot be read."""
    try:
        import fcntl
        import termios

        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
    except (ImportError, AttributeError, OSError, ValueError):
        return 0


class _Counted:
    """A transport that counts the bytes written to it (the rest passes through)."""

    def __init__(self, transport):
        self._transport, self.written = transport, 0

    def write(self, data) -> None:
        self.written += len(data)
        self._transport.write(data)

    def __getattr__(self, name):
        return getattr(self._transport, name)


_TIMED_OUT = json.dumps(error_body("the request did not arrive within the server's --read-timeout",
                                   code="request_timeout")).encode()
TIMEOUT_REPLY = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(_TIMED_OUT), _TIMED_OUT))


def protocol(read_timeout: float, write_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the read and write deadlines (checked on a tick a connection)."""
    tick = min(1.0, read_timeout / 4, write_timeout / 4)

    class Guarded(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.transport = _Counted(transport)
            self.sock = transport.get_extra_info("socket")
            now = self.loop.time()
            self.read_by, self.acked, self.acked_at = now + read_timeout, 0, now
            self.timer = self.loop.call_later(tick, self._check)

        def connection_lost(self, exc) -> None:
            self.timer.cancel()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            self.read_by = self.loop.time() + read_timeout
            super().on_response_complete()

        def _reading(self) -> bool:
            """Whether a request's headers or body are still due."""
            c = self.cycle
            return c is None or c.response_complete or (c.more_body and not c.response_started)

        def _reset(self) -> None:
            """Drop the connection with a reset: close() would wait for the client to take the
            buffered output, and the kernel would go on offering it what it holds."""
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
            self.transport.abort()

        def _check(self) -> None:
            now, t = self.loop.time(), self.transport
            if t.is_closing() and not t.get_write_buffer_size():
                return
            pending = t.get_write_buffer_size() + _unsent(self.sock)
            acked = t.written - pending
            if not pending or acked > self.acked:
                self.acked, self.acked_at = acked, now
            elif now - self.acked_at > write_timeout:
                self._reset()
                return
            if not t.is_closing() and self._reading() and now > self.read_by:
                if self.cycle is None or self.cycle.response_complete or not self.cycle.response_started:
                    t.write(TIMEOUT_REPLY)
                t.close()
            self.timer = self.loop.call_later(tick, self._check)

    return Guarded
