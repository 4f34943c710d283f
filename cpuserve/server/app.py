"""The OpenAI-compatible API over the async engine.

Handlers turn requests into engine requests (one per prompt, n sequences each), then shape the
engine's outputs as OpenAI JSON or server-sent events. Every error is an OpenAI-style body.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cpuserve import __version__
from cpuserve.engine.async_engine import AsyncEngine, EngineDeadError, RequestCancelled, RequestFailed
from cpuserve.engine.outputs import RequestOutput
from cpuserve.engine.sampling_params import InvalidRequest
from cpuserve.engine.sequence import TokenLogprobs
from cpuserve.server.body_limit import BodySizeLimit
from cpuserve.server.metrics import Metrics
from cpuserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from cpuserve.tokenizer import ChatTemplateError

log = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    served_model_names: list[str]
    api_key: str | None = None
    chat_template: str | None = None
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # from generation_config.json
    max_waiting_requests: int = 256
    max_request_bytes: int = 16 * 1024 * 1024


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "BadRequestError",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_response(status: int, message: str, type_: str, param: str | None = None, code: Any = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code if code is not None else status}}
    return JSONResponse(body, status_code=status)


def api_error(exc: Exception) -> APIError:
    """The OpenAI-style error for an exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequest):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, RequestFailed):
        return APIError(500, f"The request failed inside the engine: {exc}", "InternalServerError")
    if isinstance(exc, RequestCancelled):
        return APIError(503, f"The request was stopped: {exc}.", "ServiceUnavailableError", code="shutting_down")
    if isinstance(exc, EngineDeadError):
        return APIError(503, "The engine has stopped; the server is restarting.", "ServiceUnavailableError")
    return APIError(500, "Internal server error (logged).", "InternalServerError")


def _logprob_entry(tokenizer, token_id: int, logprob: float) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    raw = tokenizer.token_bytes(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


class Server:
    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.llm = engine.engine
        self.tokenizer = self.llm.tokenizer
        self.config = config
        self.model_name = config.served_model_names[0]
        self.metrics = Metrics(self.model_name)
        self.created = int(time.time())
        self.draining = False  # set on SIGTERM/SIGINT: running requests finish, new ones get 503

    # ---- request checks -------------------------------------------------------------------------

    def check_auth(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise APIError(401, "Invalid or missing API key.", "AuthenticationError", code="invalid_api_key")

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.config.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model", "model_not_found")

    def check_capacity(self, extra: int) -> None:
        if self.draining:
            raise APIError(503, "The server is shutting down.", "ServiceUnavailableError", code="shutting_down")
        if self.llm.num_waiting + extra > self.config.max_waiting_requests:
            raise APIError(
                503, "The server is at capacity; retry shortly.", "ServiceUnavailableError", code="server_overloaded"
            )

    # ---- generation -------------------------------------------------------------------------------

    async def _stream(self, request_id: str, prompt: str | list[int], params) -> AsyncIterator[RequestOutput]:  # type: ignore[no-untyped-def]
        start = time.monotonic()
        last_time, last_count = None, 0
        async for out in self.engine.generate(request_id, prompt, params):
            now = time.monotonic()
            count = sum(len(o.token_ids) for o in out.outputs)
            if last_time is None and count:
                self.metrics.ttft.observe(now - start)
            elif last_time is not None and count > last_count:
                self.metrics.itl.observe((now - last_time) / (count - last_count))
            if count:
                last_time = now
            self.metrics.generation_tokens.inc(count - last_count)
            last_count = count
            if out.finished:
                self.metrics.prompt_tokens.inc(len(out.prompt_token_ids))
                for o in out.outputs:
                    self.metrics.requests.labels(model_name=self.model_name, finished_reason=o.finish_reason).inc()
            yield out

    async def _start(self, jobs) -> tuple[list[str], list, list[RequestOutput]]:  # type: ignore[no-untyped-def]
        """Start every engine request and wait for its first output, so that a rejected request
        (InvalidRequest) becomes an error response before any byte of a stream is sent."""
        ids = [j for j, _, _ in jobs]
        streams = [self._stream(j, prompt, p) for j, prompt, p in jobs]
        firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
        errors = [f for f in firsts if isinstance(f, BaseException)]
        if errors:
            for request_id in ids:
                self.engine.abort(request_id)
            raise errors[0]
        return ids, streams, firsts  # type: ignore[return-value]

    async def _merge(self, started) -> AsyncIterator[tuple[int, RequestOutput]]:  # type: ignore[no-untyped-def]
        """Outputs of several engine requests as they come, tagged with the prompt index. However
        it ends (done, client gone, cancelled), every request still running is aborted."""
        ids, streams, firsts = started
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream) -> None:  # type: ignore[no-untyped-def]
            try:
                async for out in stream:
                    await queue.put((i, out))
            except Exception as exc:
                await queue.put((i, exc))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            for i, first in enumerate(firsts):
                yield i, first
            closed = 0
            while closed < len(streams):
                i, item = await queue.get()
                if item is None:
                    closed += 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            # No awaiting here: this may run inside a cancelled scope. Cancelling the pumps ends
            # their streams; abort() is synchronous and idempotent.
            for t in tasks:
                t.cancel()
            for request_id in ids:
                self.engine.abort(request_id)

    async def _collect(self, request: Request, jobs) -> list[RequestOutput] | None:  # type: ignore[no-untyped-def]
        """Run jobs to completion; None when the client went away (its requests are aborted)."""
        merged = self._merge(await self._start(jobs))
        finals: dict[int, RequestOutput] = {}

        async def consume() -> None:
            async for i, out in merged:
                finals[i] = out

        task = asyncio.ensure_future(consume())
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done and await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await merged.aclose()
                return None
        task.result()
        return [finals[i] for i in range(len(jobs))]

    # ---- completions --------------------------------------------------------------------------------

    def _prompts(self, req: CompletionRequest) -> list[str | list[int]]:
        p = req.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        if all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
            return list(p)  # type: ignore[arg-type]
        raise APIError(
            400, "prompt must be a string, a list of strings, token ids or lists of token ids", param="prompt"
        )

    def _completion_logprobs(self, entries: list[TokenLogprobs | None], offset: int) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        pos = offset
        for e in entries:
            if e is None:
                continue
            text = self.tokenizer.token_bytes(e.token_id).decode("utf-8", errors="replace")
            tokens.append(text)
            token_lps.append(e.logprob)
            top = {self.tokenizer.token_bytes(t).decode("utf-8", errors="replace"): lp for t, lp in e.top.items()}
            tops.append(top)
            offsets.append(pos)
            pos += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _max_tokens(self, fields: SamplingFields, requested: int | None, prompt_len: int, default: int | None) -> int:
        if requested is not None:
            return requested
        room = self.llm.max_model_len - prompt_len
        return max(1, min(default, room) if default is not None else room)

    async def completions(self, request: Request, req: CompletionRequest) -> Response:
        self.check_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompts = self._prompts(req)
        self.check_capacity(len(prompts))
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        jobs = []
        for i, prompt in enumerate(prompts):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            params = req.sampling_params(
                req.logprobs, self.config.sampling_defaults, self._max_tokens(req, req.max_tokens, len(ids), 16)
            )
            if req.echo and req.logprobs is not None and params.prompt_logprobs is None:
                params.prompt_logprobs = req.logprobs
            jobs.append((f"{rid}-{i}", ids, params))
        if req.stream:
            return self._sse(self._completion_events(rid, created, req, self._merge(await self._start(jobs))))
        finals = await self._collect(request, jobs)
        if finals is None:
            return Response(status_code=499)
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i, out in enumerate(finals):
            prompt_tokens += len(out.prompt_token_ids)
            prompt_text = self.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False) if req.echo else ""
            for o in out.outputs:
                completion_tokens += len(o.token_ids)
                logprobs = None
                if req.logprobs is not None:
                    entries = (list(out.prompt_logprobs or []) if req.echo else []) + list(o.logprobs or [])
                    logprobs = self._completion_logprobs(entries, 0)
                choice = {
                    "index": i * req.n + o.index,
                    "text": prompt_text + o.text,
                    "logprobs": logprobs,
                    "finish_reason": o.finish_reason,
                    "stop_reason": o.stop_reason,
                }
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs_json(out.prompt_logprobs)
                choices.append(choice)
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": choices,
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            }
        )

    def _prompt_logprobs_json(self, entries: list[TokenLogprobs | None] | None) -> list[Any] | None:
        if entries is None:
            return None
        result: list[Any] = []
        for e in entries:
            if e is None:
                result.append(None)
                continue
            item = {
                str(t): {"logprob": lp, "decoded_token": self.tokenizer.decode([t], skip_special_tokens=False)}
                for t, lp in e.top.items()
            }
            item[str(e.token_id)] = {
                "logprob": e.logprob,
                "rank": e.rank,
                "decoded_token": self.tokenizer.decode([e.token_id], skip_special_tokens=False),
            }
            result.append(item)
        return result

    async def _completion_events(self, rid, created, req: CompletionRequest, merged) -> AsyncIterator[dict]:  # type: ignore[no-untyped-def]
        sent: dict[int, tuple[int, int]] = {}  # choice index -> (chars sent, logprob entries sent)
        prompt_tokens: dict[int, int] = {}
        completion_tokens: dict[int, int] = {}
        async for i, out in merged:
            prompt_tokens[i] = len(out.prompt_token_ids)
            for o in out.outputs:
                idx = i * req.n + o.index
                chars, nlp = sent.get(idx, (0, 0))
                prefix = ""
                if req.echo and idx not in sent:
                    prefix = self.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
                delta = o.text[chars:]
                new_lp = (o.logprobs or [])[nlp:]
                completion_tokens[idx] = len(o.token_ids)
                if not (prefix or delta or o.finish_reason or new_lp):
                    continue
                sent[idx] = (len(o.text), len(o.logprobs or []))
                choice = {
                    "index": idx,
                    "text": prefix + delta,
                    "logprobs": self._completion_logprobs(new_lp, chars) if req.logprobs is not None else None,
                    "finish_reason": o.finish_reason,
                    "stop_reason": o.stop_reason,
                }
                yield {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": self.model_name,
                    "choices": [choice],
                }
        if req.stream_options and req.stream_options.include_usage:
            p, c = sum(prompt_tokens.values()), sum(completion_tokens.values())
            yield {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [],
                "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c},
            }

    # ---- chat ---------------------------------------------------------------------------------------

    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        messages = []
        for m in req.messages:
            msg = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                texts = [part.get("text", "") for part in m.content if part.get("type") == "text"]
                if len(texts) != len(m.content):
                    raise APIError(400, "only text content parts are supported", param="messages")
                msg["content"] = "".join(texts)
            messages.append(msg)
        template = req.chat_template or self.config.chat_template
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                template=template,
                **(req.chat_template_kwargs or {}),
            )
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _chat_logprobs(self, entries: list[TokenLogprobs]) -> dict[str, Any]:
        content = []
        for e in entries:
            item = _logprob_entry(self.tokenizer, e.token_id, e.logprob)
            item["top_logprobs"] = [_logprob_entry(self.tokenizer, t, lp) for t, lp in e.top.items()]
            content.append(item)
        return {"content": content}

    async def chat(self, request: Request, req: ChatCompletionRequest) -> Response:
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        self.check_capacity(1)
        ids = self._chat_prompt(req)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = req.sampling_params(
            logprobs, self.config.sampling_defaults, self._max_tokens(req, requested, len(ids), None)
        )
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        jobs = [(rid, ids, params)]
        if req.stream:
            return self._sse(self._chat_events(rid, created, req, len(ids), self._merge(await self._start(jobs))))
        finals = await self._collect(request, jobs)
        if finals is None:
            return Response(status_code=499)
        out = finals[0]
        choices = []
        for o in out.outputs:
            choice: dict[str, Any] = {
                "index": o.index,
                "message": {"role": "assistant", "content": o.text},
                "logprobs": self._chat_logprobs(o.logprobs or []) if req.logprobs else None,
                "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason,
            }
            choices.append(choice)
        completion = sum(len(o.token_ids) for o in out.outputs)
        body = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": completion,
                "total_tokens": len(ids) + completion,
            },
        }
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs_json(out.prompt_logprobs)
        return JSONResponse(body)

    async def _chat_events(
        self, rid, created, req: ChatCompletionRequest, prompt_len: int, merged
    ) -> AsyncIterator[dict]:  # type: ignore[no-untyped-def]
        def chunk(choices: list[dict], usage: dict | None = None) -> dict:
            body = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": choices,
            }
            if usage is not None:
                body["usage"] = usage
            return body

        sent: dict[int, tuple[int, int]] = {}
        last: RequestOutput | None = None
        async for _, out in merged:
            last = out
            for o in out.outputs:
                if o.index not in sent:
                    sent[o.index] = (0, 0)
                    yield chunk(
                        [
                            {
                                "index": o.index,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
                chars, nlp = sent[o.index]
                delta, new_lp = o.text[chars:], (o.logprobs or [])[nlp:]
                if not (delta or new_lp or o.finish_reason):
                    continue
                sent[o.index] = (len(o.text), len(o.logprobs or []))
                yield chunk(
                    [
                        {
                            "index": o.index,
                            "delta": {"content": delta} if delta else {},
                            "logprobs": self._chat_logprobs(new_lp) if req.logprobs else None,
                            "finish_reason": o.finish_reason,
                            "stop_reason": o.stop_reason,
                        }
                    ]
                )
        if req.stream_options and req.stream_options.include_usage and last is not None:
            completion = sum(len(o.token_ids) for o in last.outputs)
            yield chunk(
                [],
                {"prompt_tokens": prompt_len, "completion_tokens": completion, "total_tokens": prompt_len + completion},
            )

    # ---- SSE ----------------------------------------------------------------------------------------

    def _sse(self, events: AsyncIterator[dict]) -> Response:
        async def body() -> AsyncIterator[bytes]:
            try:
                async for event in events:
                    yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode()
            except (InvalidRequest, APIError, RequestFailed, RequestCancelled, EngineDeadError) as exc:
                err = api_error(exc)
                payload = {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.status}}
                yield f"data: {json.dumps(payload)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(
            body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )


def create_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    server = Server(engine, config)
    app = FastAPI(title="cpuserve", version=__version__)
    app.state.server = server
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_bytes)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        response = error_response(exc.status, exc.message, exc.type, exc.param, exc.code)
        if exc.status == 503:
            response.headers["Retry-After"] = "1"
        return response

    @app.exception_handler(InvalidRequest)
    @app.exception_handler(RequestFailed)
    @app.exception_handler(RequestCancelled)
    @app.exception_handler(EngineDeadError)
    async def _engine_error(_: Request, exc: Exception) -> JSONResponse:
        err = api_error(exc)
        return error_response(err.status, err.message, err.type, err.param, err.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestTooLargeError"}
        return error_response(exc.status_code, str(exc.detail), kinds.get(exc.status_code, "BadRequestError"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected error serving %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, "Internal server error (logged).", "InternalServerError")

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", []) if p != "body"]
        param = ".".join(loc) or None
        return error_response(
            400, f"{param or 'body'}: {first.get('msg', 'invalid request')}", "BadRequestError", param
        )

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        server.check_auth(request)
        data = [
            {
                "id": name,
                "object": "model",
                "created": server.created,
                "owned_by": "cpuserve",
                "root": name,
                "max_model_len": server.llm.max_model_len,
            }
            for name in config.served_model_names
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest) -> Response:
        server.check_auth(request)
        return await server.completions(request, req)

    @app.post("/v1/chat/completions")
    async def chat(request: Request, req: ChatCompletionRequest) -> Response:
        server.check_auth(request)
        return await server.chat(request, req)

    @app.post("/tokenize")
    async def tokenize(request: Request, req: TokenizeRequest) -> dict:
        server.check_auth(request)
        server.check_model(req.model)
        if req.messages:
            ids = server._chat_prompt(
                ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt)
            )
        elif req.prompt is not None:
            ids = server.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise APIError(400, "give either prompt or messages", param="prompt")
        return {"count": len(ids), "max_model_len": server.llm.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request, req: DetokenizeRequest) -> dict:
        server.check_auth(request)
        server.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < server.llm.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary", param="tokens")
        return {"prompt": server.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        server.check_auth(request)
        return Response(server.metrics.render(server.llm), media_type="text/plain; version=0.0.4")

    return app
