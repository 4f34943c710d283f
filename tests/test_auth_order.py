"""The API key is checked before the body is read: a request without the right key gets the
OpenAI-style 401 on every protected route, however malformed or oversized its body.

Routes are enumerated from the app itself, so a route added later is covered without editing this
file; a route is either in PUBLIC (answers without a key) or must answer 401 without one.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
from fastapi.routing import APIRoute
from starlette.routing import Route

from cpuserve.engine import EngineStats
from cpuserve.server import auth
from cpuserve.server.app import ServerConfig, create_app

KEY = "right-key"
LIMIT = 4096
MALFORMED = b'{"messages": [{"role": "user", "content": "Hi"'
UNAUTHORIZED = {
    "error": {
        "message": "Invalid or missing API key.",
        "type": "AuthenticationError",
        "param": None,
        "code": "invalid_api_key",
    }
}
# Deliberately spelled out here rather than read from auth.PUBLIC_PATHS: making a path public is a
# decision this test has to be edited for.
PUBLIC = {"/health", "/ping", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}


class _StubEngine:
    """AsyncEngine's public surface, enough for the routes that answer without generating."""

    max_model_len = 2048
    vocab_size = 100
    alive = True
    tokenizer = None

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, 0)

    def abort(self, request_id: str) -> None:
        pass

    async def generate(self, request_id, prompt, params):  # type: ignore[no-untyped-def]
        raise AssertionError("no request in this module reaches the engine")
        yield


def _app(api_key: str | None = KEY):
    config = ServerConfig(served_model_names=["m"], api_key=api_key, max_request_bytes=LIMIT)
    return create_app(_StubEngine(), config)  # type: ignore[arg-type]


def _endpoints(app) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves; a path parameter is filled with `x`."""
    found = []
    for route in app.routes:
        assert isinstance(route, Route), f"{route!r}: not a plain route; teach this test how to reach it"
        path = re.sub(r"\{[^}]*\}", "x", route.path)
        found += [(method, path) for method in sorted(route.methods or {"GET"}) if method != "HEAD"]
    return found


APP = _app()
ENDPOINTS = _endpoints(APP)
PROTECTED = [(m, p) for m, p in ENDPOINTS if p not in PUBLIC]
# Routes that parse a JSON body: a malformed one is a 400 once the key is right.
BODY_ROUTES = [
    (m, r.path)
    for r in APP.routes
    if isinstance(r, APIRoute) and r.body_field is not None and r.path not in PUBLIC
    for m in sorted(r.methods)
]


def _send(app, requests: list[dict]) -> list[httpx.Response]:
    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [await client.request(**r) for r in requests]

    return asyncio.run(main())


def _request(method: str, path: str, headers: dict | None = None, body: bytes = MALFORMED) -> dict:
    return {
        "method": method,
        "url": path,
        "headers": {"content-type": "application/json", **(headers or {})},
        "content": body,
    }


async def _chunks(body: bytes):
    for start in range(0, len(body), 1024):
        yield body[start : start + 1024]


def _assert_401(response: httpx.Response, what: str) -> None:
    assert response.status_code == 401, (what, response.status_code, response.text)
    assert response.json() == UNAUTHORIZED, what
    assert response.headers["content-type"] == "application/json", what


def test_the_routes_are_the_known_ones_and_the_public_list_is_the_servers():
    assert auth.PUBLIC_PATHS == PUBLIC
    paths = {p for _, p in ENDPOINTS}
    assert {"/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/metrics"} <= paths
    assert {"/health", "/version"} <= paths
    assert {p for p in paths if p in PUBLIC} == PUBLIC, "a public path that is not served: drop it from the list"
    assert ("POST", "/v1/chat/completions") in BODY_ROUTES and ("POST", "/tokenize") in BODY_ROUTES


@pytest.mark.parametrize(("method", "path"), PROTECTED)
def test_a_protected_route_answers_401_before_the_body(method, path):
    oversized = b"{" + b" " * (2 * LIMIT) + b"}"
    no_key, wrong, wrong_x, basic, big, big_chunked = _send(
        APP,
        [
            _request(method, path),
            _request(method, path, {"authorization": "Bearer wrong-key"}),
            _request(method, path, {"x-api-key": "wrong-key"}),
            _request(method, path, {"authorization": f"Basic {KEY}"}),
            _request(method, path, {"authorization": "Bearer wrong-key"}, oversized),
            # No Content-Length: a body BodySizeLimit could only refuse by counting it.
            {**_request(method, path, {"authorization": "Bearer wrong-key"}), "content": _chunks(oversized)},
        ],
    )
    _assert_401(no_key, "no key")
    _assert_401(wrong, "wrong bearer key")
    _assert_401(wrong_x, "wrong x-api-key")
    _assert_401(basic, "not a bearer token")
    _assert_401(big, "wrong key, oversized body: 401 wins over 413")
    _assert_401(big_chunked, "wrong key, oversized chunked body")


@pytest.mark.parametrize(("method", "path"), PROTECTED)
def test_a_401_never_reads_the_body(method, path):
    received, sent = [], []

    async def receive() -> dict:
        received.append(1)
        return {"type": "http.request", "body": MALFORMED, "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(MALFORMED)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("t", 80),
    }
    asyncio.run(APP(scope, receive, send))
    assert sent[0]["status"] == 401 and not received
    assert json.loads(sent[1]["body"]) == UNAUTHORIZED


@pytest.mark.parametrize(("method", "path"), BODY_ROUTES)
def test_with_the_right_key_a_malformed_body_is_a_400(method, path):
    bearer, x_api_key, lower, big = _send(
        APP,
        [
            _request(method, path, {"authorization": f"Bearer {KEY}"}),
            _request(method, path, {"x-api-key": KEY}),
            _request(method, path, {"authorization": f"bearer {KEY}"}),
            _request(method, path, {"authorization": f"Bearer {KEY}"}, b"{" + b" " * (2 * LIMIT) + b"}"),
        ],
    )
    for response in (bearer, x_api_key, lower):
        assert response.status_code == 400, (response.status_code, response.text)
        assert response.json()["error"]["type"] == "BadRequestError"
    assert big.status_code == 413 and big.json()["error"]["type"] == "RequestTooLargeError"


def test_with_the_right_key_the_get_routes_answer():
    bearer, x_api_key, metrics = _send(
        APP,
        [
            {"method": "GET", "url": "/v1/models", "headers": {"authorization": f"Bearer {KEY}"}},
            {"method": "GET", "url": "/v1/models", "headers": {"x-api-key": KEY}},
            {"method": "GET", "url": "/metrics", "headers": {"x-api-key": KEY}},
        ],
    )
    assert bearer.status_code == x_api_key.status_code == metrics.status_code == 200
    assert bearer.json()["data"][0]["id"] == "m" and x_api_key.json() == bearer.json()


def test_the_public_routes_answer_without_a_key():
    public = [(m, p) for m, p in ENDPOINTS if p in PUBLIC and p != "/docs/oauth2-redirect"]
    responses = _send(APP, [{"method": m, "url": p} for m, p in public])
    for (method, path), response in zip(public, responses, strict=True):
        assert response.status_code == 200, (method, path, response.status_code)


def test_an_unknown_path_is_401_without_the_key_and_404_with_it():
    no_key, wrong, right = _send(
        APP,
        [
            {"method": "GET", "url": "/v1/unknown"},
            {"method": "POST", "url": "/nope", "headers": {"authorization": "Bearer wrong-key"}},
            {"method": "GET", "url": "/v1/unknown", "headers": {"authorization": f"Bearer {KEY}"}},
        ],
    )
    _assert_401(no_key, "unknown /v1 path")
    _assert_401(wrong, "unknown path")
    assert right.status_code == 404 and right.json()["error"]["type"] == "NotFoundError"


def test_a_public_path_under_a_root_path_is_still_public_and_a_protected_one_still_protected():
    async def run(path: str) -> int:
        sent = []

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "GET",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "/api",
            "query_string": b"",
            "headers": [],
            "client": ("127.0.0.1", 1),
            "server": ("t", 80),
        }
        await APP(scope, receive, send)
        return sent[0]["status"]

    assert asyncio.run(run("/api/health")) == 200
    assert asyncio.run(run("/api/v1/models")) == 401


def test_without_a_configured_key_everything_passes():
    app = _app(api_key=None)
    models, chat = _send(
        app,
        [
            {"method": "GET", "url": "/v1/models"},
            _request("POST", "/v1/chat/completions", {"authorization": "Bearer anything"}),
        ],
    )
    assert models.status_code == 200
    assert chat.status_code == 400 and chat.json()["error"]["type"] == "BadRequestError"
