"""The access log: one line per API request on the logger `cpuserve.access`, written when the
response has ended (for a stream: when the stream ends, saying how it ended).

An operator needs to see each request's route, status, token counts, time to first token and
duration, and why a refused request was refused, without the log ever holding what a client must
be able to trust stays private: no API key (headers are not logged), no query string, no prompt or
output text (the prompt's first 200 characters only with `--log-prompts`).

How it is measured, and why so:
- `AccessLog` is ASGI middleware outside the key check, so a 401 gets its line too. It never reads
  a body: it passes receive() and send() through, looking only at the status line, the content
  type, whether the last body message went out (a finished stream) and whether the client
  disconnected. Nothing is buffered, so SSE flows as before.
- The numbers come from a per-request `Record` (a context variable the middleware sets, seen by
  every task the request starts) filled where they are known: token counts, finish reasons and the
  first token's time by `RecordingEngine` (the engine's generate, passed through), the refusal
  reason by the app's exception handlers (wrapped here: errors.py stays the one place error bodies
  are made, and the line quotes exactly the body the client got).
- TTFT is request arrival to the first generated token of any of the call's engine requests. Taken
  at the engine, it is the same for JSON and SSE, and not skewed by what the byte stream shows: the
  chat role chunk goes out with the first output whatever it holds, and a token's text may be held
  back (half a UTF-8 character, a tool call or reasoning marker being read, a possible stop string),
  so "the first body chunk after the role chunk" would often be a later token, and means nothing
  for completions (no role chunk) or JSON responses.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette._utils import get_route_path
from starlette.requests import ClientDisconnect

from cpuserve.server.auth import AUTH_ERROR
from cpuserve.server.body_limit import BodyTooLarge
from cpuserve.server.errors import api_error
from cpuserve.server.state import Server

log = logging.getLogger("cpuserve.access")

LOGGED_PREFIXES = ("/v1/",)  # the OpenAI routes (and unknown paths under /v1)
LOGGED_PATHS = frozenset({"/tokenize", "/detokenize"})  # not /health, /metrics: probes and scrapes
MAX_TEXT = 200  # characters of an error message or (with --log-prompts) a prompt


@dataclass
class Record:
    """What one API request did, filled while it runs."""

    start: float
    first_token: float | None = None
    request_ids: list[str] = field(default_factory=list)  # its engine requests
    prompt_tokens: dict[str, int] = field(default_factory=dict)  # per engine request
    output_tokens: dict[str, int] = field(default_factory=dict)  # per engine request, all its sequences
    finish: list[str] = field(default_factory=list)
    prompt: str | list[int] | None = None  # the first engine request's, for --log-prompts
    engine_error: str | None = None  # what ended an engine request, as the client was told
    refusal: dict[str, Any] | None = None  # the error body's fields, from the exception handler


_current: contextvars.ContextVar[Record | None] = contextvars.ContextVar("cpuserve_access_record", default=None)


class RecordingEngine:
    """The engine as the handlers see it: everything passed through, generate() also filling the
    current request's record."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def generate(self, request_id: str, prompt: str | list[int], params: Any) -> AsyncIterator[Any]:
        record = _current.get()
        if record is not None:
            record.request_ids.append(request_id)
            if record.prompt is None:
                record.prompt = prompt
            if not isinstance(prompt, str):
                record.prompt_tokens[request_id] = len(prompt)
        try:
            # aclosing: when the handler drops this stream, the engine's own is closed (and aborted) at once
            async with contextlib.aclosing(self._inner.generate(request_id, prompt, params)) as stream:
                async for out in stream:
                    if record is not None:
                        _note(record, request_id, out)
                    yield out
        except Exception as exc:
            if record is not None and record.engine_error is None:
                record.engine_error = api_error(exc).message
            raise


def _note(record: Record, request_id: str, out: Any) -> None:
    count = sum(len(o.token_ids) for o in out.outputs)
    if count and record.first_token is None:
        record.first_token = time.monotonic()
    record.prompt_tokens[request_id] = len(out.prompt_token_ids)
    record.output_tokens[request_id] = count
    if out.finished:
        record.finish += [o.finish_reason for o in out.outputs if o.finish_reason]


def _noting(handler: Any) -> Any:
    """An exception handler that also puts the error body it made on the current record."""

    async def noted(conn: Any, exc: Exception) -> Any:
        response = await handler(conn, exc)
        record = _current.get()
        if record is not None and getattr(response, "status_code", 0) >= 400:
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                error = json.loads(response.body)["error"]
                record.refusal = {k: error.get(k) for k in ("type", "param", "message")}
        return response

    return noted


def _quoted(text: str) -> str:
    return json.dumps(text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + "…", ensure_ascii=False)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


class AccessLog:
    """ASGI middleware writing one access line per logged request when its response has ended."""

    def __init__(self, app: Any, server: Server) -> None:
        self.app, self.server = app, server
        limit = BodyTooLarge(server.config.max_request_bytes).detail
        # Refusals made before the app runs (by the outer middlewares), so no handler notes them.
        self.outer = {
            401: {"type": AUTH_ERROR.type, "param": None, "message": AUTH_ERROR.message},
            413: {"type": "RequestTooLargeError", "param": None, "message": limit},
        }

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = get_route_path(scope) if scope["type"] == "http" else ""
        if not (path.startswith(LOGGED_PREFIXES) or path in LOGGED_PATHS):
            await self.app(scope, receive, send)
            return
        record = Record(time.monotonic())
        token = _current.set(record)
        seen: dict[str, Any] = {"status": None, "stream": False, "complete": False, "disconnected": False}

        async def watching_receive() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.disconnect":
                seen["disconnected"] = True
            return message

        async def watching_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                kind = dict(message.get("headers") or []).get(b"content-type", b"")
                seen["stream"] = kind.startswith(b"text/event-stream")
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                seen["complete"] = True

        failure: BaseException | None = None
        try:
            await self.app(scope, watching_receive, watching_send)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            _current.reset(token)
            prompt = None
            if self.server.config.log_prompts and failure is None:
                prompt = await self._prompt_text(record)
            log.info("%s", self.line(scope, path, record, seen, failure, prompt))

    async def _prompt_text(self, record: Record) -> str | None:
        if isinstance(record.prompt, str) or record.prompt is None:
            return record.prompt
        with contextlib.suppress(Exception):  # a log line is not worth failing over
            return await self.server.tokens.decode(record.prompt[: MAX_TEXT + 1], skip_special_tokens=False)
        return None

    def line(
        self,
        scope: dict[str, Any],
        path: str,
        record: Record,
        seen: dict[str, Any],
        failure: BaseException | None,
        prompt: str | None,
    ) -> str:
        # A client gone shows as a disconnect message (ASGI < 2.4) or as send() raising (2.4).
        gone = seen["disconnected"] or isinstance(failure, OSError | ClientDisconnect)
        failed = f"{type(failure).__name__} (logged)" if failure is not None and not gone else None
        status = seen["status"] if seen["status"] is not None else (500 if failed else 499)
        parts = [scope.get("method", "-"), path, str(status)]
        if seen["stream"] and seen["status"] is not None and seen["status"] < 400:
            if seen["complete"]:  # an engine failure mid-stream ends it with an error event
                ended, error = ("error", record.engine_error) if record.engine_error else ("finished", None)
            else:
                ended, error = ("error", failed) if failed else ("client_gone", None)
            parts.append(f"stream={ended}")
            if error:
                parts.append(f"error={_quoted(error)}")
        elif status == 499:
            parts.append("ended=client_gone")
        elif status >= 400:
            why = record.refusal or self.outer.get(status) or ({"type": "InternalServerError"} if failed else {})
            message = failed or why.get("message") or "-"
            parts += ["refused", f"type={why.get('type') or '-'}", f"param={why.get('param') or '-'}"]
            parts.append(f"error={_quoted(str(message))}")
        parts += [
            f"prompt_tokens={sum(record.prompt_tokens.values())}",
            f"output_tokens={sum(record.output_tokens.values())}",
            f"ttft={_seconds(record.first_token - record.start if record.first_token is not None else None)}",
            f"duration={_seconds(time.monotonic() - record.start)}",
        ]
        if record.finish:
            parts.append("finish=" + ",".join(dict.fromkeys(record.finish)))
        if record.request_ids:
            parts.append("id=" + re.sub(r"-\d+$", "", record.request_ids[0]))  # cmpl-…-0: the response's id
        client = scope.get("client")
        if client:
            parts.append(f"client={client[0]}:{client[1]}")
        if prompt is not None:
            more = len(record.request_ids) - 1
            parts.append(f"prompt={_quoted(prompt)}" + (f" (+{more} more)" if more > 0 else ""))
        return " ".join(parts)


def install_access_log(app: Any, server: Server) -> None:
    """Log each API request (unless --disable-log-requests). Call it after every other
    add_middleware, so the log is outermost and sees the requests the key check refuses."""
    if not server.config.log_requests:
        return
    server.engine = RecordingEngine(server.engine)  # type: ignore[assignment]
    for kind, handler in list(app.exception_handlers.items()):
        app.exception_handlers[kind] = _noting(handler)
    app.add_middleware(AccessLog, server=server)
