"""The cluster's pure parts: prompt prefixes, the routing order, core claims, flags to replicas, merged metrics."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

pytest.importorskip("ray.serve")

from cpuserve.cluster.app import add_cluster_args, build, engine_options, replica_argv, serve_argv
from cpuserve.cluster.cores import choose_cores, claim_cores, process_start
from cpuserve.cluster.forwarding import ForwardedRequest, run_asgi
from cpuserve.cluster.metrics import IngressMetrics
from cpuserve.cluster.prefix import BLOCK_CHARS, PrefixTable, block_hashes, prompt_text, request_prefix
from cpuserve.cluster.replica import kv_share_gib
from cpuserve.cluster.router import rank_replicas
from cpuserve.server.serve_flags import add_serve_args

SYSTEM = "You are a careful assistant. " * 40  # 1160 characters: four whole blocks


# --- prefixes
def test_block_hashes_are_chained_and_whole_blocks_only() -> None:
    a = "x" * (3 * BLOCK_CHARS + 10)
    ha = block_hashes(a)
    assert len(ha) == 3
    assert len(set(ha)) == 3  # equal blocks, different positions: chained hashes differ
    b = "x" * (2 * BLOCK_CHARS) + "y" + "x" * BLOCK_CHARS
    hb = block_hashes(b)
    assert hb[:2] == ha[:2] and hb[2] != ha[2]
    assert block_hashes("x" * (BLOCK_CHARS - 1)) == []


def test_prompt_text_orders_chat_as_rendered() -> None:
    body = {
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]},
        ],
    }
    text = prompt_text(body)
    assert text == json.dumps(body["tools"], sort_keys=True) + "\x00system\x00S\x00user\x00AB\x00assistant\x00{}"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"prompt": "hello"}, "hello"),
        ({"prompt": ["first", "second"]}, "first"),
        ({"prompt": [1, 2, 3]}, "[1, 2, 3]"),
        ({"prompt": [[1, 2], [3]]}, "[1, 2]"),
        ({"input": "embed me"}, "embed me"),
        ({"instructions": "I", "input": [{"role": "user", "content": "Q"}]}, "\x00system\x00IQ"),
        ({"system": [{"type": "text", "text": "T"}], "messages": []}, "\x00system\x00T"),
    ],
)
def test_prompt_text_of_each_route(body: dict, expected: str) -> None:
    assert prompt_text(body) == expected


def test_conversation_that_grows_keeps_its_prefix() -> None:
    first = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]}
    longer = {
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "More"},
        ]
    }
    h1, h2 = request_prefix(json.dumps(first).encode()), request_prefix(json.dumps(longer).encode())
    assert len(h1) == 4 and h2[: len(h1)] == h1
    assert request_prefix(b"not json") == [] and request_prefix(b"[1, 2]") == []


def test_prefix_table_longest_owner_lru_and_forget() -> None:
    table = PrefixTable(capacity=5)
    a, b = block_hashes(SYSTEM + "a" * 600), block_hashes(SYSTEM + "b" * 600)
    assert len(a) == 6 and a[:4] == b[:4] and a[4] != b[4]
    table.record(a[:4], "r1")
    table.record(b[:5], "r2")  # takes over the shared blocks; capacity 5 evicts the oldest
    assert table.match(a, {"r1", "r2"}) == ("r2", 4)
    assert table.match(b, {"r1", "r2"}) == ("r2", 5)
    assert table.match(b, {"r1"}) == (None, 0)  # r2 not a candidate (dead, avoided)
    assert len(table) == 5
    table.forget("r2")
    assert len(table) == 0 and table.match(b, {"r1", "r2"}) == (None, 0)


# --- routing order
def test_rank_prefers_the_prefix_owner_within_the_imbalance() -> None:
    load, kv = {"a": 0.0, "b": 3.0, "c": 1.0}, {"a": 0.5, "b": 0.0, "c": 0.0}
    assert rank_replicas(load, kv, "b", imbalance=4) == [["b"], ["a"], ["c"]]
    assert rank_replicas(load, kv, "b", imbalance=2) == [["a"], ["c"], ["b"]]  # 3 - 0 > 2: least loaded
    assert rank_replicas(load, kv, None, imbalance=4) == [["a"], ["c"], ["b"]]
    assert rank_replicas(load, kv, "gone", imbalance=4) == [["a"], ["c"], ["b"]]


def test_rank_breaks_load_ties_by_kv_use_then_key() -> None:
    assert rank_replicas({"b": 1, "a": 1, "c": 1}, {"b": 0.1, "a": 0.2, "c": 0.1}, None, 4) == [["b"], ["c"], ["a"]]


# --- cores
def test_choose_cores_free_first_one_node_then_shared() -> None:
    nodes = {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    assert choose_cores(nodes, [], 2) == ([0, 1], "2 free core(s) of NUMA node 0")
    assert choose_cores(nodes, [0, 1, 2], 2) == ([4, 5], "2 free core(s) of NUMA node 1")
    assert choose_cores(nodes, [0, 1, 2, 4, 5], 2) == ([6, 7], "2 free core(s) of NUMA node 1")
    cores, why = choose_cores(nodes, [0, 1, 4, 5, 6], 3)
    assert cores == [2, 3, 7] and "across NUMA nodes" in why
    cores, why = choose_cores({0: [0, 1]}, [0, 1, 0], 2)
    assert cores == [1, 0] and "sharing 2" in why


def test_claims_skip_live_holders_and_drop_dead_or_reused_ones(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "claims.json"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        start = process_start(holder.pid)
        assert start is not None and process_start(dead.pid) is None
        path.write_text(
            json.dumps(
                {
                    str(holder.pid): {"start": start, "cores": [0]},
                    str(dead.pid): {"start": 1, "cores": [1]},
                    str(os.getppid()): {"start": -5, "cores": [2]},  # a live pid, but not the process that claimed
                }
            )
        )
        assert claim_cores({0: [0, 1, 2, 3]}, 2, path) == ([1, 2], "2 free core(s) of this machine")
        claims = json.loads(path.read_text())
        assert claims == {
            str(holder.pid): {"start": start, "cores": [0]},
            str(os.getpid()): {"start": process_start(os.getpid()), "cores": [1, 2]},
        }
        path.write_text("not json")  # unreadable: claimed afresh, not a crash
        assert claim_cores({0: [0, 1]}, 1, path)[0] == [0]
    finally:
        holder.kill()


def test_kv_share_is_the_cores_share_of_half_the_memory() -> None:
    assert kv_share_gib(16 * 1024**3, 1, 4) == pytest.approx(2.0)
    assert kv_share_gib(1024**2, 1, 64) == 0.25


# --- flags
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    add_cluster_args(p)
    return p


def _serve_only(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(argv)


def test_serve_flags_reach_replicas_as_written() -> None:
    argv = [
        "/models/m",
        "--replicas",
        "2",
        "--max-num-seqs",
        "8",
        "--served-model-name",
        "a",
        "b",
        "--no-enable-prefix-caching",
        "--disable-log-stats",
        "--threads-per-replica",
        "1",
        "--quantize-lm-head",
        "none",
        "--max-logprobs",
        "-1",
        "--override-generation-config",
        '{"top_k": 5}',
        "-q",
        "gguf",
        "--enable-chunked-prefill",
        "--allowed-origins",
        '["https://a.example", "https://b.example"]',
    ]
    args = _parser().parse_args(argv)
    replica_argv = serve_argv(args)
    assert "--replicas" not in replica_argv and "--threads-per-replica" not in replica_argv
    parsed, direct = (
        _serve_only(replica_argv),
        _serve_only([a for a in argv if a not in ("--replicas", "--threads-per-replica", "2", "1")]),
    )
    assert vars(parsed) == vars(direct)
    assert serve_argv(_parser().parse_args([])) == []


def test_serve_run_builder_refuses_bad_flags_and_replica_counts() -> None:
    from cpuserve.errors import CpuserveError

    with pytest.raises(CpuserveError, match="max-num-seqs: invalid int value"):
        build({"model": "m", "serve_args": "--max-num-seqs nope"})

    with pytest.raises(CpuserveError, match="min-replicas"):
        build({"replicas": 1, "min_replicas": 2})
    with pytest.raises(CpuserveError, match="tensor-parallel"):
        build({"serve_args": "-tp 2"})
    with pytest.raises(CpuserveError, match="uvicorn-log-level"):  # accepted by serve, meaningless here
        build({"serve_args": "--uvicorn-log-level info"})


def test_deployment_options_fixed_or_autoscaled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "k1")
    monkeypatch.setenv("CPUSERVE_ISA", "avx2")
    monkeypatch.setenv("CPUSERVE_THREADS_BIND", "0-3")  # each replica binds itself: never copied
    args = _parser().parse_args(["m", "--replicas", "2", "--max-num-seqs", "8", "--max-waiting-requests", "10"])
    argv, parsed, key = replica_argv(args)
    assert argv == ["m", "--max-num-seqs", "8", "--max-waiting-requests", "10", "--api-key", "k1"] and key == "k1"
    fixed = engine_options(args, parsed)
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    assert fixed["max_ongoing_requests"] == 18 + 32  # past the engine's own limits: its 503 comes first
    assert fixed["max_queued_requests"] == 10
    assert fixed["ray_actor_options"]["num_cpus"] == 1
    env = fixed["ray_actor_options"]["runtime_env"]["env_vars"]
    assert env["CPUSERVE_ISA"] == "avx2" and "CPUSERVE_THREADS_BIND" not in env and "VLLM_API_KEY" not in env
    assert fixed["request_router_config"].request_router_kwargs == {"imbalance": 4}
    args = _parser().parse_args(
        ["--replicas", "2", "--min-replicas", "1", "--max-replicas", "3", "--threads-per-replica", "2"]
    )
    auto = engine_options(args, replica_argv(args)[1])
    assert "num_replicas" not in auto and auto["ray_actor_options"]["num_cpus"] == 2
    assert auto["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 3,
        "initial_replicas": 2,
        "target_ongoing_requests": 16.0,
    }


# --- metrics
def test_ingress_metrics_label_each_replica() -> None:
    from cpuserve.engine import EngineStats
    from cpuserve.server.metrics import Metrics

    def text(running: int) -> str:
        m = Metrics("m")
        m.prompt_tokens.inc(5)
        return m.render(EngineStats(running, 0, 0.25, 10, 4, 0, 1, 5, 0)).decode()

    out = IngressMetrics().render({"r1": text(1), "r2": text(3)}, live=2, prefix_routed=7).decode()
    assert 'vllm:num_requests_running{model_name="m",replica="r1"} 1.0' in out
    assert 'vllm:num_requests_running{model_name="m",replica="r2"} 3.0' in out
    assert 'vllm:prompt_tokens_total{model_name="m",replica="r2"} 5.0' in out
    assert out.count("# TYPE vllm:num_requests_running gauge") == 1  # one family, two samples
    assert "cpuserve:cluster_replicas 2.0" in out and "cpuserve:cluster_prefix_routed 7.0" in out


# --- the in-process call of the app
def test_run_asgi_streams_and_reports_the_client_leaving() -> None:
    app = FastAPI()
    seen: dict[str, bool] = {}

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"body": (await request.body()).decode(), "q": request.url.query}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def gen():  # type: ignore[no-untyped-def]
            try:
                for i in range(1000):
                    yield f"{i}\n".encode()
                    await asyncio.sleep(0.01)
                seen["finished"] = True
            finally:
                seen["stopped"] = True

        return StreamingResponse(gen(), media_type="text/plain")

    async def main() -> None:
        req = ForwardedRequest("POST", "/echo", b"a=1", [(b"content-type", b"application/json")], b"hi")
        items = [i async for i in run_asgi(app, req)]
        assert items[0][0] == 200 and json.loads(b"".join(items[1:])) == {"body": "hi", "q": "a=1"}
        gen = run_asgi(app, ForwardedRequest("GET", "/stream", b"", [], b""))
        assert (await anext(gen))[0] == 200
        assert await anext(gen) == b"0\n"
        await gen.aclose()  # the consumer leaves
        assert seen.get("stopped") is True and "finished" not in seen  # the app saw the client leave

    asyncio.run(main())


# --- the ingress's retries, with a stand-in for Ray's deployment handle
class _Stream:
    """What `handle.options(stream=True).forward.remote(...)` returns: items, or an exception to raise."""

    def __init__(self, items: list) -> None:
        self.items, self.cancelled = iter(items), False

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self):  # type: ignore[no-untyped-def]
        item = next(self.items, StopAsyncIteration)
        if item is StopAsyncIteration:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class _Handle:
    def __init__(self, *scripts: list) -> None:
        self.scripts, self.sent, self.streams = list(scripts), [], []
        self.forward = self

    def options(self, stream: bool) -> _Handle:
        return self

    def remote(self, request: ForwardedRequest) -> _Stream:
        self.sent.append(request)
        self.streams.append(_Stream(self.scripts.pop(0)))
        return self.streams[-1]


def _ingress_client(handle: _Handle):  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    from cpuserve.cluster.ingress import Ingress, build_ingress_app

    ingress = Ingress(handle, api_key="k", max_request_bytes=4000)
    return TestClient(build_ingress_app(ingress), raise_server_exceptions=False), ingress


JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream")]
KEYED = {"Authorization": "Bearer k"}


def test_ingress_sends_a_503_once_more_elsewhere() -> None:
    from ray.exceptions import ActorDiedError, RayTaskError
    from ray.serve.exceptions import BackPressureError

    from cpuserve.cluster.forwarding import ResponseStart

    full = ["r0", ResponseStart(503, JSON, "r0"), b'{"error": {"code": "server_overloaded"}}']
    ok = ["r1", ResponseStart(200, JSON, "r1"), b'{"ok": true}']
    handle = _Handle(full, ok)
    client, ingress = _ingress_client(handle)
    body = json.dumps({"prompt": SYSTEM}).encode()
    r = client.post("/v1/completions?x=1", content=body, headers=KEYED)
    assert r.status_code == 200 and r.json() == {"ok": True}
    assert [s.avoid for s in handle.sent] == [(), ("r0",)] and handle.streams[0].cancelled
    assert handle.sent[0].prefix == request_prefix(body) and handle.sent[0].query_string == b"x=1"
    assert handle.sent[0].body == body and handle.sent[0].method == "POST"
    # a second 503 is passed on, as the replica wrote it
    client, _ = _ingress_client(handle := _Handle(list(full), list(full)))
    r = client.post("/v1/completions", content=body, headers=KEYED)
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded" and len(handle.sent) == 2
    # every replica and Ray's queue full: serve's own 503, at once
    client, _ = _ingress_client(_Handle([BackPressureError(num_queued_requests=3, max_queued_requests=3)]))
    r = client.post("/v1/completions", content=body, headers=KEYED)
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded" and r.headers["retry-after"]
    # a bug inside the replica is not a replica death: not sent again
    client, _ = _ingress_client(handle := _Handle([RayTaskError("forward", "tb", ValueError("x"))], list(ok)))
    assert client.post("/v1/completions", content=body, headers=KEYED).status_code == 500 and len(handle.sent) == 1
    assert handle.streams[0].cancelled
    # a replica dead before answering: once more elsewhere, then a 503 naming what happened
    client, _ = _ingress_client(handle := _Handle(["r0", ActorDiedError()], list(ok)))
    assert client.post("/v1/completions", content=body, headers=KEYED).json() == {"ok": True}
    assert handle.sent[1].avoid == ("r0",)
    client, ingress = _ingress_client(_Handle([ActorDiedError()], [ActorDiedError()]))
    r = client.post("/v1/completions", content=body, headers=KEYED)
    assert r.status_code == 503 and r.json()["error"]["code"] == "replica_failed"
    assert ingress.metrics.failures._value.get() == 1


def test_ingress_ends_a_stream_whose_replica_died_with_an_error_event() -> None:
    from ray.exceptions import ActorDiedError

    from cpuserve.cluster.forwarding import ResponseStart

    chunk = b'data: {"choices": [{"text": "a"}]}\n\n'
    handle = _Handle(["r0", ResponseStart(200, SSE, "r0"), chunk, chunk, ActorDiedError()])
    client, _ = _ingress_client(handle)
    r = client.post("/v1/completions", json={"prompt": "x", "stream": True}, headers=KEYED)
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[:2] == [chunk.decode()[6:].strip()] * 2 and events[-1] == "[DONE]"
    assert json.loads(events[2])["error"]["code"] == 503 and len(handle.sent) == 1  # never sent again


def test_ingress_checks_the_key_and_size_before_forwarding() -> None:
    handle = _Handle()
    client, _ = _ingress_client(handle)
    assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 401
    assert client.get("/metrics").status_code == 401
    assert client.post("/v1/completions", content=b"x" * 5000, headers=KEYED).status_code == 413
    assert handle.sent == []


def test_serve_run_builder_makes_the_application() -> None:
    from ray.serve import Application

    from cpuserve.errors import CpuserveError

    config = {"model": "m", "replicas": 2, "serve_args": "--max-num-seqs 8", "disable_log_stats": True}
    assert isinstance(build({**config, "enable_prefix_caching": False, "api_key": None}), Application)
    with pytest.raises(CpuserveError, match="unrecognized arguments: --no-such-flag"):
        build({**config, "no_such_flag": 1})


def test_ingress_reports_every_replica_and_hides_them_without_the_key() -> None:
    from cpuserve.engine import EngineStats
    from cpuserve.server.metrics import Metrics

    m = Metrics("m")
    text = m.render(EngineStats(1, 0, 0.25, 10, 4, 0, 1, 5, 0)).decode()
    reports = [
        {"replica": "r1", "node": "a", "pid": 11, "cores": [0], "running": 1, "metrics": text},
        {"replica": "r0", "node": "b", "pid": 12, "cores": [1], "running": 0, "metrics": text},
    ]

    class Broadcast:
        async def results_async(self, **_: object) -> list:
            return [*reports, RuntimeError("a replica that did not answer")]

    handle = _Handle()
    handle.broadcast = lambda method: Broadcast()  # type: ignore[attr-defined]
    client, _ = _ingress_client(handle)
    public = client.get("/health")
    assert public.status_code == 200 and public.json() == {"replicas": 2}
    full = client.get("/health", headers=KEYED).json()
    assert [r["replica"] for r in full["replicas"]] == ["r0", "r1"] and "metrics" not in full["replicas"][0]
    assert full["replicas"][1]["pid"] == 11
    import ray

    assert not ray.is_initialized()  # no Ray started by asking (its driver would outlive the test)
    metrics = client.get("/metrics", headers=KEYED).text
    assert 'replica="r0"' in metrics and 'replica="r1"' in metrics and "cpuserve:cluster_replicas 2.0" in metrics
    reports.clear()
    assert client.get("/health").status_code == 503


def _routes_server(port: int = 0) -> Any:
    """A stand-in for Ray Serve's proxy: 200 on its route table (/-/routes), 404 elsewhere."""
    import http.server

    class Routes(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/-/routes" else 404)
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    return http.server.HTTPServer(("127.0.0.1", port), Routes)


def test_the_proxy_check_asks_where_serve_was_told_to_listen() -> None:
    import threading

    from cpuserve.bench.server_process import free_port
    from cpuserve.cluster.app import _proxy_answers

    server = _routes_server()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        assert _proxy_answers("127.0.0.1", port) and _proxy_answers("0.0.0.0", port)  # 0.0.0.0: asked on loopback
        assert not _proxy_answers("127.0.0.1", free_port(), wait=1.0)  # nothing there: Serve listens elsewhere
    finally:
        server.shutdown()


def test_the_proxy_check_waits_for_a_proxy_ray_is_restarting() -> None:
    """Under load Ray marks its proxy unhealthy and starts a new one (seen: more than 10 s on 2 cores);
    the check must not take that gap for a proxy listening elsewhere and delete the application."""
    import threading

    from cpuserve.bench.server_process import free_port
    from cpuserve.cluster.app import _proxy_answers

    port = free_port()
    servers: list[Any] = []

    def start_late() -> None:
        time.sleep(2.5)
        servers.append(_routes_server(port))
        servers[0].serve_forever()

    threading.Thread(target=start_late, daemon=True).start()
    try:
        assert _proxy_answers("127.0.0.1", port, wait=30.0)
    finally:
        if servers:
            servers[0].shutdown()
