"""Server behaviour under pressure: a full waiting queue answers 503, a client that disconnects
mid-stream has its request aborted."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import httpx
import pytest

from cpuserve.bench.server_process import running_server

LONG = {"prompt": "Count: 1, 2, 3,", "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def server(smol_dir, cache_dir):
    args = [str(smol_dir), "--max-num-seqs", "1", "--max-waiting-requests", "1", "--max-model-len", "1024"]
    with running_server(args, {"CPUSERVE_CACHE_DIR": str(cache_dir), "VLLM_CPU_KVCACHE_SPACE": "1"}) as base:
        yield base


def metric(base: str, name: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_for(predicate, timeout=30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_full_queue_gives_503_with_retry_after(server):
    with httpx.Client(base_url=server, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=LONG) as running:
            lines = running.iter_lines()  # keep the iterator: dropping it closes the connection
            next(lines)  # the first request is running
            waiting = threading.Thread(
                target=lambda: httpx.post(
                    server + "/v1/completions", json={**LONG, "stream": False, "max_tokens": 5}, timeout=120
                ),
                daemon=True,
            )
            waiting.start()
            assert wait_for(lambda: metric(server, "vllm:num_requests_waiting") == 1)
            r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "ServiceUnavailableError"
        waiting.join(timeout=120)
    # Once the queue drains, requests are served again.
    assert wait_for(lambda: metric(server, "vllm:num_requests_waiting") == 0)
    req = urllib.request.Request(
        server + "/v1/completions",
        data=json.dumps({"prompt": "Hi", "max_tokens": 2}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200


def test_disconnect_mid_stream_aborts_and_frees_the_kv_cache(server):
    with httpx.Client(base_url=server, timeout=60) as client, client.stream("POST", "/v1/completions", json=LONG) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert metric(server, "vllm:num_requests_running") == 1
    # The connection is closed with ~395 tokens still to go: the request must stop at once.
    assert wait_for(lambda: metric(server, "vllm:num_requests_running") == 0, timeout=10)
    assert metric(server, "vllm:kv_cache_usage_perc") == 0.0
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(
            urllib.request.Request(
                server + "/v1/completions", data=b"{", method="POST", headers={"Content-Type": "application/json"}
            ),
            timeout=10,
        )
    assert err.value.code == 400


def test_a_client_gone_during_a_long_prefill_is_aborted_before_its_first_token(smol_dir, cache_dir):
    """A streaming request's first event waits for its prefill (here ~125 chunks of 16 tokens): a client
    that gives up meanwhile has the request aborted at the next step, so it never generates a token."""
    args = [str(smol_dir), "--max-num-batched-tokens", "16", "--max-model-len", "2048", "--max-num-seqs", "2"]
    with running_server(args, {"CPUSERVE_CACHE_DIR": str(cache_dir), "VLLM_CPU_KVCACHE_SPACE": "1"}) as base:
        long_prompt = {"prompt": [1000 + (i * 7) % 20000 for i in range(2000)], "max_tokens": 8, "stream": True}
        before = metric(base, "vllm:generation_tokens_total")
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/v1/completions", json=long_prompt, timeout=httpx.Timeout(60, read=0.5))
        assert wait_for(lambda: metric(base, "vllm:num_requests_running") == 0, timeout=20)
        assert metric(base, "vllm:generation_tokens_total") == before  # aborted mid-prefill
        assert metric(base, "vllm:kv_cache_usage_perc") == 0.0
        r = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
