"""Refuse request bodies over a size limit before they are buffered (413, OpenAI-style body).

The declared Content-Length is checked first; a chunked body is counted as it arrives, so a client
cannot make the server hold more than the limit in memory by leaving the length out.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.exceptions import HTTPException

Scope = dict[str, Any]
Message = dict[str, Any]


class BodyTooLarge(HTTPException):
    """Raised from receive() mid-body; the app's HTTPException handler shapes the 413."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, _message(max_bytes))


def _message(max_bytes: int) -> str:
    return f"The request body is larger than this server's limit of {max_bytes} bytes."


class BodySizeLimit:
    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def _refuse(self, send: Any) -> None:
        body = json.dumps(
            {
                "error": {
                    "message": _message(self.max_bytes),
                    "type": "RequestTooLargeError",
                    "param": None,
                    "code": 413,
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(send)
