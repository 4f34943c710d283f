"""The API key check, as ASGI middleware: it runs before a route reads or parses the body.

A request without the right key gets the OpenAI-style 401 however malformed or large its body is:
the middleware answers from the headers alone and never calls receive(). It is deny by default:
every path needs the key except PUBLIC_PATHS, so a new route is protected without anyone
remembering to, and an unknown path answers 401 (not 404) to a client without the key, which
does not learn which routes exist. With the key, an unknown path is the router's 404.

The key is accepted as `Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY`
(Anthropic clients), compared in constant time so response timing does not leak it. A client that
sends `anthropic-version` gets the 401 in Anthropic's error shape.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi.responses import JSONResponse
from starlette._utils import get_route_path  # the path exactly as the router matches it

from cpuserve.server.errors import APIError, error_response

# Probes and the API's own description: no data, no model, nothing a key protects. /metrics is not
# among them (vLLM leaves it open): its request counts, timings and length histograms show the
# traffic, and on a cluster every scrape asks each replica. A Prometheus scrape sends the key as a
# bearer credential.
PUBLIC_PATHS = frozenset({"/health", "/ping", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})

AUTH_ERROR = APIError(401, "Invalid or missing API key.", "AuthenticationError", code="invalid_api_key")


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    return next((value for key, value in headers if key.lower() == name), None)


def key_matches(headers: list[tuple[bytes, bytes]], api_key: str) -> bool:
    """Whether raw ASGI headers carry `api_key` as a Bearer token or as x-api-key."""
    expected = api_key.encode()
    bearer = _header(headers, b"authorization") or b""
    given = bearer[7:] if bearer[:7].lower() == b"bearer " else b""
    x_api_key = _header(headers, b"x-api-key") or b""
    # Both compared every time: which header a client used does not change the timing either.
    by_bearer = hmac.compare_digest(given, expected)
    by_x_api_key = hmac.compare_digest(x_api_key, expected)
    return by_bearer or by_x_api_key


class APIKeyAuth:
    """Answer 401 to any request to a non-public path without the key (no key configured: all pass)."""

    def __init__(self, app: Any, api_key: str | None) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (
            self.api_key is None
            or scope["type"] not in ("http", "websocket")
            or get_route_path(scope) in PUBLIC_PATHS
            or key_matches(scope.get("headers") or [], self.api_key)
        ):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # before accept: the client sees a 403
            return
        err = AUTH_ERROR
        if _header(scope.get("headers") or [], b"anthropic-version") is not None:  # an Anthropic client's shape
            body = {"type": "error", "error": {"type": "authentication_error", "message": err.message}}
            response: JSONResponse = JSONResponse(body, status_code=err.status)
        else:
            response = error_response(err.status, err.message, err.type, err.param, err.code)
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)
