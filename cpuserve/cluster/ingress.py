"""The cluster's one OpenAI-compatible front door: forwards every route to a replica, retries, reports.

Each request's body is read once (within the same size limit as `cpuserve serve`), its prompt's
prefix hashed for the router, and the request handed whole to a replica, which runs it through
cpuserve's own app; the response (streamed or not) comes back as the replica wrote it. A
replica that answers 503 (full, draining) or dies before the ingress has sent anything is tried
once more on another replica; one that dies mid-stream ends the stream with an error event and
[DONE]. /health and /metrics report every replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.exceptions import RayActorError, RayError
from ray.serve.exceptions import BackPressureError, RayServeException

import cpuserve.cluster.live as live
from cpuserve.cluster import APP_NAME
from cpuserve.cluster.forwarding import ForwardedRequest, ResponseStart
from cpuserve.cluster.metrics import IngressMetrics
from cpuserve.cluster.prefix import request_prefix
from cpuserve.server.auth import APIKeyAuth, key_matches
from cpuserve.server.body_limit import BodySizeLimit
from cpuserve.server.errors import APIError, install_error_handlers

log = logging.getLogger("cpuserve.cluster")

RETRIES = 1  # another replica, once: a second failure is the cluster's, not one replica's
REPLICA_WAIT_S = 60.0  # longest wait for any replica to take a request (all of them restarting)
REPORT_WAIT_S = 5.0  # /health and /metrics: replicas that do not answer within this are left out
SSE_REPLICA_DIED = {
    "error": {
        "message": "The replica serving this request failed; the request was stopped. Retry it.",
        "type": "ServiceUnavailableError",
        "param": None,
        "code": 503,
    }
}


class RelayedResponse(Response):
    """A replica's response sent on as it is: its status, its headers, its body as it comes."""

    def __init__(self, start: ResponseStart, chunks: AsyncIterator[bytes], on_abandon: Any) -> None:
        self.status_code = start.status
        self.raw_headers = list(start.headers)
        self.chunks = chunks
        self.on_abandon = on_abandon  # stops the replica's request if this response never gets going
        self.background = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async with contextlib.aclosing(self.chunks) as chunks:
                async for chunk in chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except BaseException:
            self.on_abandon()
            raise


class Ingress:
    """The ingress deployment (wrapped in cluster/app.py): one per cluster, no CPUs of its own."""

    def __init__(self, engines: Any, api_key: str | None, max_request_bytes: int) -> None:
        self.engines = engines
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.metrics = IngressMetrics()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_ingress_app(self)

    # --- what the ingress knows about the replicas (through the router Ray runs in this process)
    def routers(self) -> list[Any]:
        return list(live.ROUTERS)

    # --- forwarding
    async def forward(self, request: Request) -> Response:
        body = await request.body()
        forwarded = ForwardedRequest(
            method=request.method,
            path=request.url.path,
            query_string=request.scope.get("query_string", b""),
            headers=list(request.scope["headers"]),
            body=body,
            client=tuple(request.scope["client"]) if request.scope.get("client") else None,
            prefix=request_prefix(body) if request.method == "POST" else [],
        )
        avoid: list[str] = []
        for attempt in range(RETRIES + 1):
            last = attempt == RETRIES
            stream = self.engines.options(stream=True).forward.remote(replace(forwarded, avoid=tuple(avoid)))
            replica = None
            try:
                replica = await asyncio.wait_for(stream.__anext__(), REPLICA_WAIT_S)
                start: ResponseStart = await stream.__anext__()
                if start.status == 503 and not last:
                    stream.cancel()
                    avoid.append(start.replica)
                    self.metrics.retries.labels("replica_503").inc()
                    continue
                first = await anext(stream, None)  # for a non-streamed answer: all of it
            except TimeoutError:
                stream.cancel()
                raise APIError(
                    503, "No replica is available; retry shortly.", "ServiceUnavailableError", code="no_replica"
                ) from None
            except BackPressureError:
                stream.cancel()  # every replica full and the router's queue too: serve's own answer
                raise APIError(
                    503,
                    "The server is at capacity; retry shortly.",
                    "ServiceUnavailableError",
                    code="server_overloaded",
                ) from None
            except (RayActorError, StopAsyncIteration) as exc:  # the replica died (or ended without answering)
                stream.cancel()
                if replica is not None:
                    avoid.append(replica)
                if not last:
                    log.warning(
                        "replica %s failed before answering (%s); retrying on another", replica, type(exc).__name__
                    )
                    self.metrics.retries.labels("replica_failed").inc()
                    continue
                self.metrics.failures.inc()
                raise APIError(
                    503,
                    "The replica serving this request failed before answering; retry.",
                    "ServiceUnavailableError",
                    code="replica_failed",
                ) from None
            except RayServeException as exc:  # the application is being deployed or deleted
                stream.cancel()
                raise APIError(503, f"The cluster cannot take requests now: {exc}", "ServiceUnavailableError") from None
            except BaseException:  # anything else (a bug in the replica, the client gone): stop the request
                stream.cancel()
                raise
            return RelayedResponse(start, self._relay(start, first, stream), on_abandon=stream.cancel)
        raise AssertionError("unreachable")

    async def _relay(self, start: ResponseStart, first: bytes | None, stream: Any) -> AsyncIterator[bytes]:
        try:
            if first is not None:
                yield first
                async for chunk in stream:
                    yield chunk
        except RayActorError as exc:
            self.metrics.failures.inc()
            log.warning("replica %s failed mid-response (%s)", start.replica, type(exc).__name__)
            if start.header(b"content-type").startswith(b"text/event-stream"):
                yield f"data: {json.dumps(SSE_REPLICA_DIED)}\n\n".encode()
                yield b"data: [DONE]\n\n"
        finally:
            stream.cancel()  # a client gone: the replica's app sees it leave and stops the request

    # --- reports
    async def replica_reports(self) -> list[dict[str, Any]]:
        """Every live replica's own report (EngineReplica.report), asked of each directly."""
        try:
            results = await self.engines.broadcast("report").results_async(
                timeout_s=REPORT_WAIT_S, return_exceptions=True
            )
        except (TimeoutError, RayError, RayServeException, RuntimeError):
            return []
        return sorted((r for r in results if isinstance(r, dict)), key=lambda r: r["replica"])

    async def health(self, request: Request) -> Response:
        replicas = await self.replica_reports()
        view: dict[str, Any] = {"replicas": len(replicas)}
        # Who runs where is for operators: with a key configured, only to those who give it.
        if self.api_key is None or key_matches(list(request.scope["headers"]), self.api_key):
            view["replicas"] = [{k: v for k, v in r.items() if k != "metrics"} for r in replicas]
            view["deployments"] = await asyncio.to_thread(_serve_states)
        return JSONResponse(view, status_code=200 if replicas else 503)

    async def render_metrics(self) -> Response:
        replicas = await self.replica_reports()
        texts = {r["replica"]: r["metrics"] for r in replicas}
        routed = sum(router.prefix_routed for router in self.routers())
        return Response(self.metrics.render(texts, len(replicas), routed), media_type="text/plain; version=0.0.4")


def _serve_states() -> dict[str, dict[str, int]]:
    """This application's replica states per deployment, as Ray Serve's controller sees them
    (starting, running, recovering, ...). A blocking call: run it off the event loop. Outside a Ray
    job (the ingress under test) nothing is asked: serve.status() would start a local Ray whose driver
    then exits the process a minute after that Ray goes away."""
    if not ray.is_initialized():
        return {}
    try:
        status = serve.status()
    except Exception:  # the controller is being restarted: the replicas' own reports stand
        return {}
    app = status.applications.get(APP_NAME)
    if app is None:
        return {}
    return {
        name: {str(state): count for state, count in d.replica_states.items()} for name, d in app.deployments.items()
    }


def build_ingress_app(ingress: Ingress) -> FastAPI:
    app = FastAPI(title="cpuserve cluster", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodySizeLimit, max_bytes=ingress.max_request_bytes)
    app.add_middleware(APIKeyAuth, api_key=ingress.api_key)  # outermost: 401 before any body is read
    install_error_handlers(app)

    @app.get("/health")
    async def health(request: Request) -> Response:
        return await ingress.health(request)

    @app.get("/metrics")
    async def metrics() -> Response:
        return await ingress.render_metrics()

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
    async def forward(request: Request) -> Response:
        return await ingress.forward(request)

    return app
