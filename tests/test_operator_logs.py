"""What an operator reads in the server's log: one access line per API request (written when the
response, or the stream, has ended; refusals with their reason; never the key or the text), the
periodic engine stats lines, and `serve --seed` accepted (its meaning is tested in test_engine.py).

The formats and the refused-request lines are checked on the app with a scripted engine (fast);
a real stream's TTFT and the stats lines on a real server of the bundled model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time

import httpx
import pytest
from starlette.requests import ClientDisconnect

from cpuserve.engine import CompletionOutput, EngineStats, RequestFailed, RequestOutput
from cpuserve.server import stats_log
from cpuserve.server.access_log import RecordingEngine
from cpuserve.server.app import ServerConfig, create_app
from cpuserve.server.serve_flags import NO_EFFECT

KEY = "sk-operator-test-key-0042"
SECRET_PROMPT = "SECRET-PROMPT-TEXT"
SECRET_OUTPUT = "SECRET-OUTPUT-TEXT"
AUTH = {"Authorization": f"Bearer {KEY}"}
FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')

# (delay before this output, tokens so far, text so far, finish reason). The first token's text is
# held back (as half a UTF-8 character would be) until the second: TTFT is the first token's time.
# The text comes 1.3 s after it: a busy machine (the suite's other lane) may delay the first token.
SCRIPT = [
    (0.0, 0, "", None),
    (0.2, 1, "", None),
    (1.3, 2, SECRET_OUTPUT, None),
    (0.0, 3, SECRET_OUTPUT + "!", "length"),
]


class _CharTokenizer:
    """One token per character; the chat template is the messages run together."""

    vocab_size = 0x110000

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    encode_off_gil = encode

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        return chr(token_id).encode()

    def apply_chat_template(self, messages, add_generation_prompt=True, template=None, **kwargs) -> str:  # type: ignore[no-untyped-def]
        return "".join(f"<{m['role']}>{m.get('content')}" for m in messages) + "<assistant>"


class _ScriptEngine:
    """AsyncEngine's public surface; every request plays `script` (an exception in it is raised)."""

    max_model_len = 4096
    max_logprobs = 20
    vocab_size = _CharTokenizer.vocab_size
    alive = True

    def __init__(self, script: list | None = None, waiting: int = 0) -> None:
        self.tokenizer = _CharTokenizer()
        self.script = SCRIPT if script is None else script
        self.waiting = waiting
        self.params: list = []
        self.aborted: list[str] = []

    def stats(self) -> EngineStats:
        return EngineStats(0, self.waiting, 0.0, 0, 0, 0, 0, 0, 0)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def generate(self, request_id, prompt, params):  # type: ignore[no-untyped-def]
        self.params.append(params)
        for delay, count, text, finish in self.script:
            await asyncio.sleep(delay)
            if isinstance(text, BaseException):
                raise text
            outs = [CompletionOutput(i, text, [65] * count, None, None, finish) for i in range(params.n)]
            yield RequestOutput(request_id, None, list(prompt), None, outs, finished=finish is not None)


def _app(engine: _ScriptEngine | None = None, **config):  # type: ignore[no-untyped-def]
    config = {"served_model_names": ["m"], "api_key": KEY, "max_request_bytes": 4096, **config}
    return create_app(engine or _ScriptEngine(), ServerConfig(**config))  # type: ignore[arg-type]


def _send(app, requests: list[dict]) -> list[httpx.Response]:  # type: ignore[no-untyped-def]
    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [await client.request(**{"method": "POST", "headers": AUTH, **r}) for r in requests]

    return asyncio.run(main())


def _lines(caplog: pytest.LogCaptureFixture, logger: str = "cpuserve.access") -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger]


def _fields(line: str) -> dict[str, str]:
    return {k: json.loads(v) if v.startswith('"') else v for k, v in FIELD.findall(line)}


def _head(line: str) -> tuple[str, str, int]:
    method, path, status = line.split()[:3]
    return method, path, int(status)


@pytest.fixture(autouse=True)
def _info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="cpuserve")


def test_a_json_request_gets_one_line_with_its_numbers_and_none_of_its_text(caplog):
    prompt = [{"role": "user", "content": SECRET_PROMPT}]
    (r,) = _send(_app(), [{"url": "/v1/chat/completions", "json": {"messages": prompt}}])
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == SECRET_OUTPUT + "!"
    (line,) = _lines(caplog)
    f = _fields(line)
    assert _head(line) == ("POST", "/v1/chat/completions", 200) and "stream" not in f and "refused" not in line
    assert int(f["prompt_tokens"]) == r.json()["usage"]["prompt_tokens"] and f["output_tokens"] == "3"
    assert f["finish"] == "length" and f["id"] == r.json()["id"] and f["client"].startswith("127.0.0.1:")
    ttft, duration = float(f["ttft"][:-1]), float(f["duration"][:-1])
    assert 0.2 <= ttft < 1.4 <= duration  # the first token's time, not its text's (1.5 s)
    assert KEY not in caplog.text and SECRET_PROMPT not in caplog.text and SECRET_OUTPUT not in caplog.text


def test_a_stream_is_logged_when_it_ends_with_the_first_tokens_time(caplog):
    body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "n": 2}
    (r,) = _send(_app(), [{"url": "/v1/chat/completions", "json": body}])
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    (line,) = _lines(caplog)
    f = _fields(line)
    assert _head(line)[2] == 200 and f["stream"] == "finished"
    assert f["output_tokens"] == "6" and f["prompt_tokens"] == str(len("<user>Hi<assistant>"))
    # The role chunk went out at once and the first text at 1.5 s; the first token came at 0.2 s.
    assert 0.2 <= float(f["ttft"][:-1]) < 1.4 <= float(f["duration"][:-1])


def test_a_stream_the_engine_fails_says_so(caplog):
    script = [*SCRIPT[:3], (0.0, 0, RequestFailed("boom"), None)]
    (r,) = _send(_app(_ScriptEngine(script)), [{"url": "/v1/completions", "json": {"prompt": [1, 2], "stream": True}}])
    assert r.status_code == 200 and '"error"' in r.text
    (line,) = _lines(caplog)
    f = _fields(line)
    assert f["stream"] == "error" and f["error"] == "The request failed inside the engine: boom"
    assert f["prompt_tokens"] == "2" and f["output_tokens"] == "2" and f["id"].startswith("cmpl-")


@pytest.mark.parametrize("spec", ["2.3", "2.4"])  # told by a disconnect message; by send() raising
def test_a_stream_whose_client_goes_away_says_so(caplog, spec):
    engine = _ScriptEngine([(0.05, n, "x" * n, None) for n in range(1, 200)])
    app = _app(engine)
    body = json.dumps({"prompt": [1, 2, 3], "stream": True, "max_tokens": 500}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"authorization", f"Bearer {KEY}".encode())],
        "client": ("127.0.0.1", 5555),
        "server": ("t", 80),
    }

    async def main() -> None:
        chunks = asyncio.Event()
        requested = False

        async def receive() -> dict:
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": body, "more_body": False}
            await chunks.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if chunks.is_set() and spec == "2.4":
                raise OSError("the connection is closed")
            if message["type"] == "http.response.body" and b"choices" in message.get("body", b""):
                chunks.set()

        with contextlib.suppress(ClientDisconnect):
            await asyncio.wait_for(app(scope, receive, send), 5)

    asyncio.run(main())
    (line,) = _lines(caplog)
    f = _fields(line)
    assert _head(line)[2] == 200 and f["stream"] == "client_gone" and 1 <= int(f["output_tokens"]) < 10
    assert engine.aborted  # and the engine was told


@pytest.mark.parametrize(
    "request_, status, kind, param, message",
    [
        (
            {
                "url": "/v1/chat/completions",
                "json": {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
            },
            400,
            "BadRequestError",
            "temperature",
            "temperature: Input should be a valid number, unable to parse string as a number",
        ),
        (
            {"url": "/v1/completions", "json": {"prompt": [1], "model": "other"}},
            404,
            "NotFoundError",
            "model",
            "The model `other` does not exist.",
        ),
        (
            {"url": "/v1/completions", "json": {"prompt": []}},
            400,
            "BadRequestError",
            "prompt",
            "prompt must not be empty",
        ),
        (
            {"url": "/v1/completions", "headers": {"Authorization": "Bearer wrong-key-7731"}, "json": {"prompt": [1]}},
            401,
            "AuthenticationError",
            "-",
            "Invalid or missing API key.",
        ),
        (
            {"url": "/v1/completions", "content": b"{" + b" " * 5000 + b"}"},
            413,
            "RequestTooLargeError",
            "-",
            "The request body is larger than this server's limit of 4096 bytes.",
        ),
        ({"url": "/v1/nothing-here", "json": {}}, 404, "NotFoundError", "-", "Not Found"),
    ],
)
def test_a_refused_request_gets_a_line_saying_why(caplog, request_, status, kind, param, message):
    (r,) = _send(_app(), [request_])
    assert r.status_code == status
    (line,) = _lines(caplog)
    f = _fields(line)
    assert _head(line)[2] == status and " refused " in line
    assert (
        (f["type"], f["param"], f["error"])
        == (kind, param, message)
        == (kind, r.json()["error"]["param"] or "-", r.json()["error"]["message"])
    )
    assert f["prompt_tokens"] == "0" and f["output_tokens"] == "0" and f["ttft"] == "-"
    assert KEY not in caplog.text and "wrong-key-7731" not in caplog.text


def test_capacity_and_engine_refusals_and_unexpected_errors_get_their_reason(caplog):
    full = _send(_app(_ScriptEngine(waiting=1000)), [{"url": "/v1/completions", "json": {"prompt": [1]}}])
    broken = _send(
        _app(_ScriptEngine([(0.0, 0, KeyError("k"), None)])), [{"url": "/v1/completions", "json": {"prompt": [1]}}]
    )
    assert full[0].status_code == 503 and broken[0].status_code == 500
    overloaded, unexpected = (_fields(line) for line in _lines(caplog))
    assert (overloaded["type"], overloaded["error"]) == (
        "ServiceUnavailableError",
        "The server is at capacity; retry shortly.",
    )
    assert (unexpected["type"], unexpected["error"]) == ("InternalServerError", "KeyError (logged)")


def test_only_api_routes_are_logged_and_the_flag_turns_the_log_off(caplog):
    app = _app()
    _send(app, [{"method": "GET", "url": p} for p in ("/health", "/metrics", "/version", "/v1/models")])
    assert [_head(line)[1:] for line in _lines(caplog)] == [("/v1/models", 200)]
    caplog.clear()
    quiet = _app(log_requests=False)
    assert not isinstance(quiet.state.server.engine, RecordingEngine)
    responses = _send(
        quiet, [{"url": "/v1/completions", "json": {"prompt": [1]}}, {"url": "/v1/completions", "json": {}}]
    )
    assert [r.status_code for r in responses] == [200, 400] and not _lines(caplog)


def test_log_prompts_adds_the_prompts_first_200_characters(caplog):
    prompt = SECRET_PROMPT + "y" * 500
    _send(_app(log_prompts=True), [{"url": "/v1/completions", "json": {"prompt": prompt}}])
    f = _fields(_lines(caplog)[0])
    assert f["prompt"] == (prompt[:200] + "…") and SECRET_OUTPUT not in caplog.text


def test_the_flags_are_no_longer_no_effect():
    import argparse

    from cpuserve.server.serve_flags import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    args = p.parse_args(["--disable-log-requests", "--disable-log-stats", "--log-prompts", "--seed", "7"])
    assert (args.disable_log_requests, args.disable_log_stats, args.log_prompts, args.seed) == (True, True, True, 7)
    assert not {"disable_log_requests", "disable_log_stats", "seed"} & set(NO_EFFECT)


class _CountingEngine:
    """Stats snapshots handed out one per call."""

    def __init__(self, snapshots: list[EngineStats]) -> None:
        self.snapshots = snapshots

    def stats(self) -> EngineStats:
        return self.snapshots.pop(0) if len(self.snapshots) > 1 else self.snapshots[0]


def _stats(running=0, waiting=0, kv=0.0, queries=0, hits=0, preemptions=0, prompt=0, generated=0) -> EngineStats:  # type: ignore[no-untyped-def]
    return EngineStats(running, waiting, kv, queries, hits, preemptions, 0, prompt, generated)


def test_stats_lines_every_interval_while_busy_and_one_when_idle(caplog):
    idle = _stats()
    busy = _stats(running=2, waiting=1, kv=0.125, queries=200, hits=50, preemptions=1, prompt=1200, generated=300)
    done = _stats(queries=200, hits=50, preemptions=1, prompt=1200, generated=350)
    times = iter([0.0, 10.0, 20.0, 30.0, 40.0, 50.0])
    logger = stats_log.StatsLogger(_CountingEngine([idle, idle, busy, done, done, done]), clock=lambda: next(times))
    lines = [logger.tick() for _ in range(5)]
    assert lines[0] is None  # idle: nothing
    assert lines[1] == (
        "Engine: Avg prompt throughput: 120.0 tokens/s, Avg generation throughput: 30.0 tokens/s, "
        "Running: 2 seqs, Waiting: 1 seqs, KV cache usage: 12.5%, Prefix cache hit rate: 25.0%, "
        "Preemptions: 1 (1 total)"
    )
    assert lines[2] is not None and "Avg generation throughput: 5.0 tokens/s, Running: 0 seqs" in lines[2]  # idle now
    assert lines[3] == (
        "Engine: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, "
        "Running: 0 seqs, Waiting: 0 seqs, KV cache usage: 0.0%, Prefix cache hit rate: 0.0%, "
        "Preemptions: 0 (1 total)"
    )
    assert lines[4] is None
    assert _lines(caplog, "cpuserve.stats") == [line for line in lines if line]


@pytest.mark.parametrize("enabled", [True, False])
def test_the_stats_task_runs_in_the_apps_lifespan(caplog, monkeypatch, enabled):
    monkeypatch.setattr(stats_log, "INTERVAL", 0.05)
    engine = _ScriptEngine(waiting=1)  # always some work
    app = _app(engine, log_stats=enabled)

    async def main() -> None:
        async with app.router.lifespan_context(app):
            await asyncio.sleep(0.3)

    asyncio.run(main())
    lines = _lines(caplog, "cpuserve.stats")
    assert (len(lines) >= 2 and all("Waiting: 1 seqs" in line for line in lines)) if enabled else not lines


# ---- a real server of the bundled model ---------------------------------------------------------

ACCESS = re.compile(r"^\[cpuserve\] (GET|POST) (/\S+) (\d{3}) (.*)$", re.M)
STATS = "Engine: Avg prompt throughput:"


def _serve_args(smol_dir, *extra: str) -> list[str]:  # type: ignore[no-untyped-def]
    return [str(smol_dir), "--dtype", "float32", "--served-model-name", "smol", "--max-model-len", "1024", *extra]


def _env(cache_dir) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {"CPUSERVE_CACHE_DIR": str(cache_dir), "VLLM_CPU_KVCACHE_SPACE": "1"}


def _wait_for(log, text: str, deadline: float) -> bool:  # type: ignore[no-untyped-def]
    while time.monotonic() < deadline:
        if text in log.read_text():
            return True
        time.sleep(0.2)
    return text in log.read_text()


def test_a_real_server_logs_each_request_and_the_stats(smol_dir, cache_dir, tmp_path):
    log = tmp_path / "server.log"
    from cpuserve.bench.server_process import running_server

    with running_server(_serve_args(smol_dir, "--api-key", KEY, "--seed", "7"), _env(cache_dir), log) as base:
        loaded = time.monotonic()
        body = {"model": "smol", "prompt": SECRET_PROMPT, "max_tokens": 16, "temperature": 1.0, "ignore_eos": True}
        with httpx.Client(base_url=base, headers=AUTH, timeout=120) as c:
            texts = [c.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in (body, body)]
            own = [c.post("/v1/completions", json={**body, "seed": s}).json()["choices"][0]["text"] for s in (7, 8)]
            chat = {"model": "smol", "messages": [{"role": "user", "content": SECRET_PROMPT}], "max_tokens": 12}
            stream = {**chat, "stream": True, "stream_options": {"include_usage": True}}
            sent, first_text, usage = time.monotonic(), None, None
            with c.stream("POST", "/v1/chat/completions", json=stream) as r:
                for raw in r.iter_lines():
                    if not raw.startswith("data: {"):
                        continue
                    event = json.loads(raw[6:])
                    if event.get("usage"):
                        usage = event["usage"]
                    elif first_text is None and event["choices"][0]["delta"].get("content"):
                        first_text = time.monotonic() - sent
            # The stream's line is written once its last byte is sent, which may be after the client
            # has read it: wait for it, so the lines' order is the requests' order.
            assert _wait_for(log, "POST /v1/chat/completions 200", time.monotonic() + 10)
            bad = c.post("/v1/chat/completions", json={**chat, "temperature": "hot"})
            no_key = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong-key-7731"})
        # --seed seeds the generator unseeded requests draw from (vLLM's meaning): they still differ.
        assert texts[0] != texts[1] and own[0] != own[1]
        assert bad.status_code == 400 and no_key.status_code == 401 and usage and first_text is not None
        assert _wait_for(log, STATS, loaded + 12.5), "no engine stats line within 12 s of load"
    text = log.read_text()
    lines = ACCESS.findall(text)
    assert [(p, int(s)) for _, p, s, _ in lines] == [("/v1/completions", 200)] * 4 + [
        ("/v1/chat/completions", 200),
        ("/v1/chat/completions", 400),
        ("/v1/completions", 401),
    ]
    fields = [_fields(rest) for *_, rest in lines]
    assert all(
        f["prompt_tokens"] == fields[0]["prompt_tokens"] != "0" and f["output_tokens"] == "16" for f in fields[:4]
    )
    streamed = fields[4]
    assert streamed["stream"] == "finished" and int(streamed["prompt_tokens"]) == usage["prompt_tokens"]
    assert int(streamed["output_tokens"]) == usage["completion_tokens"]
    ttft = float(streamed["ttft"][:-1])
    assert 0 < ttft <= first_text + 0.05 and ttft < float(streamed["duration"][:-1])
    assert fields[5]["param"] == "temperature" and fields[6]["type"] == "AuthenticationError"
    assert KEY not in text and "wrong-key-7731" not in text and SECRET_PROMPT not in text
    assert re.search(r"Avg generation throughput: [1-9][\d.]* tokens/s", text)


def test_a_real_server_with_logging_turned_off_writes_neither(smol_dir, cache_dir, tmp_path):
    log = tmp_path / "server.log"
    from cpuserve.bench.server_process import running_server

    args = _serve_args(smol_dir, "--disable-log-stats", "--disable-log-requests")
    with running_server(args, _env(cache_dir), log) as base:
        loaded = time.monotonic()
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 8}, timeout=120)
        assert r.status_code == 200
        assert not _wait_for(log, STATS, loaded + 12.5)
    assert not ACCESS.findall(log.read_text())
