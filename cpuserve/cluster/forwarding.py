"""An HTTP request carried from the ingress to a replica, and run there through cpuserve's own app.

The replica does not listen on a port: it calls the same ASGI app `cpuserve serve` runs, in its
own process, with the request the ingress received, and streams the response messages back
through Ray. So validation, errors, the API key and streaming are exactly `cpuserve serve`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None
    prefix: list[bytes] = field(default_factory=list)  # the prompt's block hashes (cluster/prefix.py)
    avoid: tuple[str, ...] = ()  # replicas a retry must not go to


@dataclass(frozen=True)
class ResponseStart:
    """The first item a replica streams back: status, headers and who answered."""

    status: int
    headers: list[tuple[bytes, bytes]]
    replica: str

    def header(self, name: bytes) -> bytes:
        return next((v for k, v in self.headers if k.lower() == name), b"")


async def run_asgi(app: Any, request: ForwardedRequest) -> AsyncIterator[tuple[int, list] | bytes]:
    """Run `request` through `app`: yields (status, headers) once, then the body's chunks.

    If the consumer stops early (the client left; Ray cancels the generator), the app sees
    `http.disconnect`, as it would from a real server, and stops the engine request.
    """
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query_string,
        "root_path": "",
        "headers": request.headers,
        "client": request.client,
        "server": ("cpuserve-replica", 0),
        "state": {},
    }
    messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    left = asyncio.Event()
    body_given = False

    async def receive() -> dict[str, Any]:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await messages.put(message)

    async def call() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await messages.put(None)

    task = asyncio.create_task(call())
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield message["status"], list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        # An exception after a whole response was already answered (a 500) and logged by the app.
        with contextlib.suppress(Exception):
            await task
    finally:
        left.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), timeout=5.0)  # it aborts its engine request
            task.cancel()
