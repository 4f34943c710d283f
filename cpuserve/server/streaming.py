"""Running engine requests for one API call: start them, merge their outputs, collect or stream them.

An API call becomes one engine request per prompt (each with n sequences). They are started
together and must all be accepted before anything is sent, so a rejected request is a plain error
response rather than a broken stream. However a call ends (done, client gone, cancelled), every
engine request still running is aborted, which frees its KV blocks before the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from cpuserve.engine import RequestOutput, SamplingParams
from cpuserve.server.errors import ENGINE_ERRORS, APIError, api_error
from cpuserve.server.state import Server

Job = tuple[str, list[int], SamplingParams]  # (engine request id, prompt token ids, parameters)
Started = tuple[list[str], list[AsyncIterator[RequestOutput]], list[RequestOutput]]


async def _instrumented(
    server: Server, request_id: str, prompt: list[int], params: SamplingParams
) -> AsyncIterator[RequestOutput]:
    """The engine's outputs for one request, recording TTFT, ITL and token counts as they pass."""
    metrics = server.metrics
    start = time.monotonic()
    last_time, last_count = None, 0
    async for out in server.engine.generate(request_id, prompt, params):
        now = time.monotonic()
        count = sum(len(o.token_ids) for o in out.outputs)
        if last_time is None and count:
            metrics.ttft.observe(now - start)
        elif last_time is not None and count > last_count:
            metrics.itl.observe((now - last_time) / (count - last_count))
        if count:
            last_time = now
        metrics.generation_tokens.inc(count - last_count)
        last_count = count
        if out.finished:
            metrics.finished(out, params, len(prompt), now)
            metrics.prompt_tokens.inc(len(out.prompt_token_ids))
            for o in out.outputs:
                metrics.requests.labels(model_name=server.model_name, finished_reason=o.finish_reason).inc()
        yield out


DISCONNECT_POLL_SECONDS = 0.2  # a prefill chunk takes longer: a client gone mid-prefill is seen within one


async def _client_left(task: asyncio.Future, request: Request | None) -> bool:
    """Wait for `task`; True (task still running) as soon as the client has disconnected."""
    while request is not None and not task.done():
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
        if not done and await request.is_disconnected():
            return True
    return False


async def start(server: Server, jobs: list[Job], request: Request | None = None) -> Started:
    """Start every engine request and wait for its first output, so that a rejected request
    (InvalidRequest) becomes an error response before any byte of a stream is sent. The first
    output comes after the prompt's prefill, which can take long: a client that leaves meanwhile
    has its requests aborted at once (the next step boundary), not after its first token."""
    ids = [j for j, _, _ in jobs]
    streams = [_instrumented(server, j, prompt, p) for j, prompt, p in jobs]
    waiting = asyncio.ensure_future(asyncio.gather(*(anext(s) for s in streams), return_exceptions=True))
    try:
        if await _client_left(waiting, request):
            raise APIError(499, "the client closed the request", "ClientClosedRequest")
        firsts = await waiting
    except BaseException:
        waiting.cancel()
        for request_id in ids:
            server.engine.abort(request_id)
        raise
    errors = [f for f in firsts if isinstance(f, BaseException)]
    if errors:
        for request_id in ids:
            server.engine.abort(request_id)
        raise errors[0]
    return ids, streams, firsts  # type: ignore[return-value]


async def merge(server: Server, started: Started) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several engine requests as they come, tagged with the prompt index. However
    it ends (done, client gone, cancelled), every request still running is aborted."""
    ids, streams, firsts = started
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
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
            server.engine.abort(request_id)


async def collect(server: Server, request: Request, jobs: list[Job]) -> list[RequestOutput] | None:
    """Run jobs to completion; None when the client went away (its requests are aborted)."""
    merged = merge(server, await start(server, jobs, request))
    finals: dict[int, RequestOutput] = {}

    async def consume() -> None:
        async for i, out in merged:
            finals[i] = out

    task = asyncio.ensure_future(consume())
    if await _client_left(task, request):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await merged.aclose()
        return None
    task.result()
    return [finals[i] for i in range(len(jobs))]


def sse(events: AsyncIterator[dict[str, Any]]) -> Response:
    """Server-sent events: one `data:` line per event, an error event if the engine fails the
    request mid-stream (the status line is long sent), and `data: [DONE]` last, always."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode()
        except (*ENGINE_ERRORS, APIError) as exc:
            err = api_error(exc)
            payload = {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.status}}
            yield f"data: {json.dumps(payload)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
