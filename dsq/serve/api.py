"""The OpenAI-compatible HTTP API of `dsq serve`, on Starlette: /v1/chat/completions and
/v1/completions (SSE streaming and not), /v1/models, /health and /metrics.

Requests become engine Requests; the engine's events come back through an asyncio queue. Bad
requests get a 4xx with OpenAI's error object ({"error": {"message", "type", "param", "code"}}).
DeepSeek-R1 reasoning (<think> ... </think>) is returned as `reasoning_content`, as DeepSeek's API
returns it. A streaming client that goes away cancels its request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import threading
import time
import uuid
from itertools import accumulate

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dsq.errors import DsqError
from dsq.runtime.chat_template import ThinkSplitter, prompt_opens_think
from dsq.runtime.engine import chat_template_for, encode_prompt
from dsq.runtime.sampling import SamplingParams
from dsq.serve.engine import Engine, Event, Request
from dsq.serve.exposition import exposition, registry_for


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.kind, self.param, self.code), status_code=self.status)


def error_body(message: str, kind: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise ApiError(400, f"'{name}' must be {'an integer' if integer else 'a number'}, got {v!r}", name)
    if not lo <= v <= hi:
        raise ApiError(400, f"'{name}' must be between {lo} and {hi}, got {v}", name)
    return v


MAX_DEPTH = 16  # how deep a body's arrays and objects may nest: a chat request needs 5 (content parts)
_BRACKETS = bytes(range(256)).translate(None, b"[]{}")  # every byte but the brackets: translate deletes these
_DELTA = tuple(1 if c in b"[{" else -1 if c in b"]}" else 0 for c in range(256))
_ESCAPE = re.compile(rb"\\.", re.S)


def too_deep(raw: bytes) -> bool:
    """Whether RAW's arrays and objects nest past MAX_DEPTH, outside its strings: found without
    recursion (the parser recurses a level a bracket) and in linear time. Escapes go first, so
    every quote left delimits a string as the parser reads it, up to any error of its."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return False
    outside = b"".join(_ESCAPE.sub(b"", raw).split(b'"')[::2])
    return max(accumulate(map(_DELTA.__getitem__, outside.translate(None, _BRACKETS))), default=0) > MAX_DEPTH


# normalizers (NFKC, whitespace folding) may shorten text before it is split into tokens: the
# quick length check allows twice what the longest token could cover, so it never refuses a fit
NORMALIZE_SLACK = 2


def _constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not UTF-8 (byte {e.start}: {e.reason})",
                       code="invalid_utf8") from None
    if too_deep(raw):
        raise ApiError(400, f"the request body nests arrays and objects more than {MAX_DEPTH} deep",
                       code="too_deep")
    try:
        body = json.loads(text, parse_constant=_constant)
    except ValueError as e:  # (also an integer of more digits than Python converts)
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:  # "\ud800" parses to a lone surrogate, which no tokenizer can encode
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "the request body holds a lone surrogate (\\ud800-\\udfff) that is not a character",
                       code="invalid_unicode") from None
    return body


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false", dict: "an object",
               list: "an array"}
COMMON_FIELDS = {"model": (str,), "max_tokens": (int,), "temperature": (float,), "top_p": (float,), "n": (int,),
                 "stream": (bool,), "stream_options": (dict,), "stop": (str, list), "seed": (int,), "user": (str,),
                 "frequency_penalty": (float,), "presence_penalty": (float,), "logit_bias": (dict,),
                 "ignore_eos": (bool,)}
CHAT_FIELDS = {**COMMON_FIELDS, "messages": (list,), "max_completion_tokens": (int,), "logprobs": (bool,),
               "top_logprobs": (int,)}
COMPLETION_FIELDS = {**COMMON_FIELDS, "prompt": (str, list), "logprobs": (int,), "echo": (bool,), "best_of": (int,),
                     "suffix": (str,)}


def _is(v, t: type) -> bool:
    if t is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if t is int:
        return isinstance(v, int) and not isinstance(v, bool)
    return isinstance(v, t)


def _json_type(v) -> str:
    return next((n for t, n in _TYPE_NAMES.items() if _is(v, t)), type(v).__name__).split()[-1]


def check_fields(body: dict, fields: dict) -> None:
    """Refuse a field this endpoint does not know (as OpenAI's API does), one of the wrong JSON
    type, and the OpenAI fields this server does not implement unless they hold their neutral
    value (n = 1, no logprobs, penalties 0, ...); null is every field's default."""
    for k, v in body.items():
        if k not in fields:
            raise ApiError(400, f"unrecognized request argument '{k}'; this endpoint takes "
                           f"{', '.join(sorted(fields))}", k, "unknown_parameter")
        if v is not None and not any(_is(v, t) for t in fields[k]):
            raise ApiError(400, f"'{k}' must be {' or '.join(_TYPE_NAMES[t] for t in fields[k])}, got {_json_type(v)}",
                           k, "invalid_type")

    def unsupported(name: str, what: str):
        return ApiError(400, f"'{name}': {what} is not supported by this server", name, "unsupported_value")

    for name in ("n", "best_of"):
        if _number(body, name, 1, 1, 128, integer=True) != 1:
            raise unsupported(name, f"{name} = {body[name]} (one choice a request)")
    for name in ("frequency_penalty", "presence_penalty"):
        if _number(body, name, 0, -2.0, 2.0):
            raise unsupported(name, "a penalty other than 0")
    if body.get("logit_bias"):
        raise unsupported("logit_bias", "logit_bias")
    if body.get("echo"):
        raise unsupported("echo", "echo")
    if body.get("suffix"):
        raise unsupported("suffix", "suffix (insertion)")
    if "messages" in fields:
        top = _number(body, "top_logprobs", 0, 0, 20, integer=True)
        if body.get("logprobs") or top:
            raise unsupported("logprobs" if body.get("logprobs") else "top_logprobs", "logprobs")
    elif _number(body, "logprobs", None, 0, 5, integer=True) is not None:
        raise unsupported("logprobs", "logprobs")
    opts = body.get("stream_options") or {}
    for k, v in opts.items():
        if k != "include_usage" or not isinstance(v, bool):
            raise ApiError(400, "'stream_options' takes 'include_usage': true or false", "stream_options")


class Mailbox:
    """The engine thread's events to one event loop's request queues. The first event since the
    loop last emptied the box schedules one wake-up (call_soon_threadsafe: a write to the loop's
    self-pipe), later ones ride along: a decode step of 32 rows wakes the loop once, not 32 times."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: list[tuple[asyncio.Queue, Event]] = []
        self.lock = threading.Lock()

    def put(self, queue: asyncio.Queue, ev: Event) -> None:
        with self.lock:
            self.items.append((queue, ev))
            if len(self.items) > 1:
                return
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self.lock:
            items, self.items = self.items, []
        for queue, ev in items:
            queue.put_nowait(ev)


class Api:
    def __init__(self, engine: Engine, model_id: str):
        self.engine, self.nm, self.model_id = engine, engine.nm, model_id
        self.created = int(time.time())
        self.template = None
        self.think = self.nm.has_token("<think>") and self.nm.has_token("</think>")
        self.mailbox: Mailbox | None = None
        self.registry = registry_for(engine)
        self.token_bytes = self.nm.longest_token_bytes()
        self.max_prompt_chars = engine.n_ctx * self.token_bytes * NORMALIZE_SLACK

    def _check_length(self, text: str, param: str) -> None:
        """Refuse a prompt too long for the context by its length alone, before it is tokenized
        (a tokenizer takes seconds a megabyte): more characters than the context's tokens could
        spell, each no longer than the vocabulary's longest."""
        if len(text) > self.max_prompt_chars:
            raise ApiError(400, f"the prompt is {len(text)} characters, more than this model's context of "
                           f"{self.engine.n_ctx} tokens can hold (its longest token is {self.token_bytes} bytes); "
                           "shorten it", param, "context_length_exceeded")

    def app(self) -> Starlette:
        routes = [Route("/health", self.health), Route("/v1/models", self.models), Route("/metrics", self.metrics),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"])]
        return Starlette(routes=routes, exception_handlers={404: self._not_found, 405: self._not_allowed})

    async def _not_found(self, request, exc) -> JSONResponse:
        return JSONResponse(error_body(f"no route {request.url.path}", code="not_found"), status_code=404)

    async def _not_allowed(self, request, exc) -> JSONResponse:
        return JSONResponse(error_body(f"{request.method} is not allowed on {request.url.path}"), status_code=405)

    async def health(self, request: HttpRequest) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def models(self, request: HttpRequest) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "dsq",
             "max_model_len": self.engine.n_ctx}]})

    async def metrics(self, request: HttpRequest):
        if request.query_params.get("format") == "json":
            return JSONResponse(self.engine.metrics())
        body, content_type = exposition(self.registry)
        return Response(body, media_type=content_type)

    # -- the two generation endpoints ---------------------------------------------------
    async def completions(self, request: HttpRequest):
        return await self._handle(request, chat=False)

    async def chat(self, request: HttpRequest):
        return await self._handle(request, chat=True)

    async def _handle(self, request: HttpRequest, chat: bool):
        try:
            body = await self._body(request, chat)
            # in a thread: tokenizing runs in llama.cpp without the GIL, and a long prompt (~10 s a
            # million characters) would otherwise hold up every other client's events meanwhile
            ids, think = await asyncio.to_thread(self._prompt, body, chat)
            req, stream, include_usage = self._request(body, ids)
        except ApiError as e:
            return e.response()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        if self.mailbox is None or self.mailbox.loop is not loop:
            self.mailbox = Mailbox(loop)
        box = self.mailbox
        req.emit = lambda ev: box.put(queue, ev)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.engine.submit(req)
        if stream:
            return StreamingResponse(self._stream(req, queue, rid, chat, think, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._whole(request, req, queue, rid, chat, think)

    async def _body(self, request: HttpRequest, chat: bool) -> dict:
        body = parse_body(await request.body())
        check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
        model = body.get("model")
        if model is not None and model != self.model_id:
            raise ApiError(404, f"the model '{model}' does not exist; this server serves '{self.model_id}'",
                           "model", "model_not_found")
        return body

    def _render(self, msgs: list[dict]) -> str:
        """The chat prompt of MSGS. The model's template gives way to its architecture's for good
        only when it fails on a plain one-turn chat, at first use; one that refuses a request's
        messages (raise_exception: roles out of order, ...) refuses that request with a 400, and
        the next request gets the model's template still."""
        if self.template is None:
            self.template = chat_template_for(self.nm)
            self.template.render([{"role": "user", "content": "Hi"}])
        try:
            return dataclasses.replace(self.template, fallback=None).render(msgs)
        except DsqError as e:
            raise ApiError(400, f"the messages do not fit the model's chat template: {e.message}", "messages",
                           "invalid_messages") from None

    def _prompt(self, body: dict, chat: bool) -> tuple[list[int], bool]:
        nm = self.nm
        try:
            if chat:
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise ApiError(400, "'messages' must be a non-empty list", "messages")
                msgs = []
                for m in messages:
                    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                        raise ApiError(400, "each message needs a 'role' and a 'content'", "messages")
                    content = m.get("content") or ""
                    if isinstance(content, list):  # content parts: the text ones
                        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
                        if not all(isinstance(t, str) for t in texts):
                            raise ApiError(400, "a text part's 'text' must be a string", "messages")
                        content = "".join(texts)
                    if not isinstance(content, str):
                        raise ApiError(400, "a message's 'content' must be a string or a list of text parts",
                                       "messages")
                    msgs.append({"role": m["role"], "content": content})
                text = self._render(msgs)
                self._check_length(text, "messages")
                ids = encode_prompt(nm, text, templated=True)
                think = self.think and prompt_opens_think(text)
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                    prompt = prompt[0]
                if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                               for t in prompt):
                    ids = list(prompt)
                    if len(ids) >= self.engine.n_ctx:
                        raise ApiError(400, f"the prompt is {len(ids)} tokens; this model's context holds "
                                       f"{self.engine.n_ctx} (prompt and reply)", "prompt", "context_length_exceeded")
                    if any(not 0 <= t < nm.model.args.vocab_size for t in ids):
                        raise ApiError(400, "a prompt token id is outside the vocabulary", "prompt")
                elif isinstance(prompt, str) and prompt:
                    self._check_length(prompt, "prompt")
                    ids = encode_prompt(nm, prompt)
                else:
                    raise ApiError(400, "'prompt' must be a non-empty string (or one list of token ids)", "prompt")
                think = False
        except DsqError as e:
            raise ApiError(400, e.one_line()) from None
        if not ids:
            raise ApiError(400, "the prompt is empty", "messages" if chat else "prompt")
        if len(ids) >= self.engine.n_ctx:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; this model's context holds {self.engine.n_ctx} "
                           "(prompt and reply)", "messages" if chat else "prompt", "context_length_exceeded")
        return ids, think

    def _request(self, body: dict, ids: list[int]) -> tuple[Request, bool, bool]:
        room = self.engine.n_ctx - len(ids)
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        max_tokens = _number({name: mt}, name, room, 1, 1 << 31, integer=True)
        if max_tokens > room:
            raise ApiError(400, f"'{name}' is {max_tokens}, and the prompt is {len(ids)} tokens: together past this "
                           f"model's context of {self.engine.n_ctx}; ask for at most {room}", name,
                           "context_length_exceeded")
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
        if top_p == 0:
            top_p, temperature = 1.0, 0.0
        seed = _number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True)
        stop = body.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 16:
            raise ApiError(400, "'stop' must be a string or a list of up to 16 strings", "stop")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be true or false", "stream")
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        sp = SamplingParams(temperature=float(temperature), top_k=0, top_p=float(top_p), seed=seed)
        req = Request(ids, sp, max_tokens, emit=None, stop=stop,
                      ignore_eos=bool(body.get("ignore_eos", False)))
        return req, stream, include_usage

    # -- replies --------------------------------------------------------------------------
    def _chunk(self, rid: str, chat: bool, text: str = "", kind: str = "answer", finish=None, first=False) -> dict:
        if chat:
            delta = {"role": "assistant", "content": ""} if first else (
                {"reasoning_content": text} if kind == "think" else {"content": text})
            choice = {"index": 0, "delta": {} if finish else delta, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_id, "choices": [choice]}

    async def _stream(self, req: Request, queue: asyncio.Queue, rid: str, chat: bool, think: bool,
                      include_usage: bool):
        splitter = ThinkSplitter(start_thinking=think) if self.think and chat else None
        answered = splitter is None  # the answer after </think> starts at its first non-newline
        done = False
        try:
            if chat:
                yield _sse(self._chunk(rid, chat, first=True))
            while True:
                ev = await queue.get()
                if ev.kind == "error":
                    done = True
                    yield _sse(error_body(ev.text, "server_error"))
                    break
                parts = ([] if ev.kind == "done" else [("answer", ev.text)]) if splitter is None else (
                    splitter.flush() if ev.kind == "done" else splitter.feed(ev.text))
                for kind, text in parts:
                    if kind == "answer" and not answered:
                        text = text.lstrip("\n")
                        answered = bool(text)
                    if text:
                        yield _sse(self._chunk(rid, chat, text, kind))
                if ev.kind == "done":
                    done = True
                    yield _sse(self._chunk(rid, chat, finish=ev.finish_reason))
                    if include_usage:
                        yield _sse({**self._chunk(rid, chat), "choices": [], "usage": ev.usage})
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away: free the request's blocks
                self.engine.cancel(req)

    async def _gone(self, request: HttpRequest, req: Request, queue: asyncio.Queue) -> None:
        """A client that goes away before its whole reply cancels its request (its blocks go back
        at the engine's next step), as a streaming one does."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.engine.cancel(req)
        queue.put_nowait(Event("gone"))

    async def _whole(self, request: HttpRequest, req: Request, queue: asyncio.Queue, rid: str, chat: bool,
                     think: bool):
        parts: list[str] = []
        watch = asyncio.ensure_future(self._gone(request, req, queue))
        try:
            while True:
                ev = await queue.get()
                if ev.kind == "text":
                    parts.append(ev.text)
                elif ev.kind == "error":
                    return JSONResponse(error_body(ev.text, "server_error"), status_code=500)
                elif ev.kind == "gone":  # a reply no one reads
                    return JSONResponse(error_body("the client went away"), status_code=400)
                else:
                    break
        except asyncio.CancelledError:
            self.engine.cancel(req)
            raise
        finally:
            watch.cancel()
        text = "".join(parts)
        now = int(time.time())
        if not chat:
            return JSONResponse({"id": rid, "object": "text_completion", "created": now, "model": self.model_id,
                                 "choices": [{"index": 0, "text": text, "logprobs": None,
                                              "finish_reason": ev.finish_reason}], "usage": ev.usage})
        message = {"role": "assistant", "content": text}
        if self.think:
            split = ThinkSplitter(start_thinking=think)
            got = split.feed(text) + split.flush()
            reasoning = "".join(s for k, s in got if k == "think")
            message = {"role": "assistant", "content": "".join(s for k, s in got if k == "answer").lstrip("\n")}
            if reasoning:
                message["reasoning_content"] = reasoning
        return JSONResponse({"id": rid, "object": "chat.completion", "created": now, "model": self.model_id,
                             "choices": [{"index": 0, "message": message, "logprobs": None,
                                          "finish_reason": ev.finish_reason}], "usage": ev.usage})


def _sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"
