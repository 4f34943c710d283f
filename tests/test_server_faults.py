"""Faults, shutdown and limits of a real server process: one request failing does not disturb
another, a fatal engine error exits non-zero, SIGTERM drains, oversized bodies get 413, keys stay
out of the logs."""

from __future__ import annotations

import json
import signal
import sys
import time

import httpx
import pytest

from cpuserve.bench.server_process import PROCESSES, running_server
from tests import faults

KEY = "s3cret-key-never-logged"
FAULTY = [sys.executable, "-m", "tests.faulty_serve"]
AUTH = {"Authorization": f"Bearer {KEY}"}


def base_args(smol_dir, *extra: str) -> list[str]:
    # float32: batched and alone compute the same logits, so "undisturbed" can mean identical tokens
    return [
        str(smol_dir),
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "8",
        "--api-key",
        KEY,
        *extra,
    ]


def env(cache_dir) -> dict[str, str]:
    return {"CPUSERVE_CACHE_DIR": str(cache_dir), "VLLM_CPU_KVCACHE_SPACE": "1"}


def sse_events(response: httpx.Response) -> list:
    """Every `data:` payload of an event stream, JSON-decoded ([DONE] kept as the string)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[6:]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def completion(seed: int, max_tokens: int = 24, **extra) -> dict:
    return {
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": seed,
        "ignore_eos": True,
        **extra,
    }


@pytest.fixture(scope="module")
def faulty(smol_dir, cache_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("faulty") / "server.log"
    with running_server(base_args(smol_dir), env(cache_dir), log, entry=FAULTY) as base:
        yield base, log


def test_a_failing_request_gets_500_and_a_concurrent_one_is_undisturbed(faulty):
    base, _ = faulty
    with httpx.Client(base_url=base, headers=AUTH, timeout=120) as client:
        alone = client.post("/v1/completions", json=completion(11)).json()["choices"][0]["text"]
        with client.stream("POST", "/v1/completions", json=completion(11, stream=True)) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            for seed in (faults.SEED_DETOKENIZE_FAULT, faults.SEED_SAMPLE_FAULT):
                bad = client.post("/v1/completions", json=completion(seed))
                assert bad.status_code == 500, bad.text
                error = bad.json()["error"]
                assert error["type"] == "InternalServerError" and "injected" in error["message"]
            rest = [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]
        texts = [json.loads(first[6:]), *rest]
        assert "".join(e["choices"][0]["text"] for e in texts) == alone
        # A streamed request that fails ends with an error event and [DONE].
        with client.stream("POST", "/v1/completions", json=completion(faults.SEED_DETOKENIZE_FAULT, stream=True)) as s:
            events = sse_events(s)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 500
        # Still serving.
        assert client.post("/v1/completions", json=completion(11)).json()["choices"][0]["text"] == alone


def test_oversized_bodies_get_413_declared_or_chunked(smol_dir, cache_dir):
    with running_server(base_args(smol_dir, "--max-request-bytes", "4096"), env(cache_dir)) as base:
        big = {"prompt": "word " * 2000, "max_tokens": 1}
        r = httpx.post(base + "/v1/completions", json=big, headers=AUTH, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["type"] == "RequestTooLargeError"

        def chunks():
            data = json.dumps(big).encode()
            for i in range(0, len(data), 1000):
                yield data[i : i + 1000]

        r = httpx.post(base + "/v1/completions", content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == 413
        ok = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=AUTH, timeout=60)
        assert ok.status_code == 200


def test_unknown_routes_and_methods_get_openai_errors(faulty):
    base, _ = faulty
    r = httpx.get(base + "/v1/nothing-here", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    r = httpx.get(base + "/v1/completions", headers=AUTH)
    assert r.status_code == 405 and "error" in r.json()


def test_api_key_never_appears_in_the_log(faulty):
    base, log = faulty
    for headers in (AUTH, {"Authorization": "Bearer wrong-" + KEY}, {}):
        httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers=headers, timeout=60)
    text = log.read_text()
    assert "listening on" in text and KEY not in text


def test_fatal_engine_error_fails_requests_and_exits_non_zero(smol_dir, cache_dir, tmp_path):
    log = tmp_path / "server.log"
    with running_server(base_args(smol_dir), env(cache_dir), log, entry=FAULTY) as base:
        proc = PROCESSES[base]
        r = httpx.post(base + "/v1/completions", json=completion(faults.SEED_FATAL), headers=AUTH, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
        assert proc.wait(timeout=30) == 1
    assert "exiting after a fatal engine error" in log.read_text()


def listener_closes(base: str, within: float) -> bool:
    """True once a new connection is not served (the server stopped accepting), polling. Refused, or
    reset: a connection that sat in the backlog when the listener closed is reset, never answered
    (seen once in a fresh-clone CI run)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            httpx.get(base + "/health", timeout=2)
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            return True
        time.sleep(0.1)
    return False


def stream_then_sigterm(base: str, body: dict, chunks_before: int) -> tuple[list, int]:
    """Start a stream, read a few chunks, SIGTERM the server, read the rest; (events, exit code)."""
    proc = PROCESSES[base]
    with (
        httpx.Client(base_url=base, headers=AUTH, timeout=120) as client,
        client.stream("POST", "/v1/completions", json=body) as stream,
    ):
        lines = stream.iter_lines()
        head = []
        while len(head) < chunks_before:
            line = next(lines)
            if line.startswith("data: "):
                head.append(json.loads(line[6:]))
        proc.send_signal(signal.SIGTERM)
        assert listener_closes(base, within=5.0)  # uvicorn checks for the signal every 0.1 s
        tail = [x[6:] for x in lines if x.startswith("data: ")]
    events = head + [x if x == "[DONE]" else json.loads(x) for x in tail]
    return events, proc.wait(timeout=60)


def test_sigterm_lets_a_running_stream_finish_then_exits_zero(smol_dir, cache_dir):
    with running_server(base_args(smol_dir, "--shutdown-timeout", "60"), env(cache_dir)) as base:
        events, code = stream_then_sigterm(base, completion(3, max_tokens=40, stream=True), 2)
    assert code == 0
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for e in events[:-1] if e["choices"][0]["text"]) >= 30  # all 40 tokens arrived


def test_sigterm_stops_what_does_not_finish_in_time_with_a_proper_error(smol_dir, cache_dir):
    with running_server(base_args(smol_dir, "--shutdown-timeout", "1"), env(cache_dir)) as base:
        events, code = stream_then_sigterm(base, completion(3, max_tokens=900, stream=True), 2)
    assert code == 0
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 503
    assert "shutting down" in events[-2]["error"]["message"]
