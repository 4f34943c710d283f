"""`cpuserve bench serving`'s arithmetic and report (the servers themselves are exercised elsewhere)."""

from __future__ import annotations

import asyncio
import json
import random

import httpx

from cpuserve.bench.serving_bench import WORKLOADS, Point, ServingResult, _one, prompt_ids, render_table


def test_tok_s_ttft_percentiles_and_the_ratio_column():
    ours = Point(4, requests=8, tokens=512, seconds=4.0, ttft=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])
    peer = Point(4, requests=8, tokens=512, seconds=8.0, ttft=[1.0] * 10)
    assert ours.tok_s == 128.0 and peer.tok_s == 64.0
    assert ours.ttft_pct(0.5) == 0.5 and ours.ttft_pct(0.9) == 0.9  # nearest rank (round half even) over 10
    table = render_table([ServingResult("m", {"decode-heavy": [ours]}, {"decode-heavy": [peer]})])
    assert "| m | decode-heavy | 4 | 128.0 | 64.0 | 2.00x | 0.50 / 0.90 s | 1.00 / 1.00 s |" in table
    alone = render_table([ServingResult("m", {"decode-heavy": [Point(1, errors=["HTTP 500: x"])]}, None)])
    assert "| - | - |" in alone and "error: cpuserve, m, decode-heavy, 1 streams: HTTP 500: x" in alone


def test_prompts_avoid_both_ends_of_the_vocabulary_and_repeat_per_seed():
    ids = prompt_ids(random.Random(3), 256, 49152)
    assert len(ids) == 256 and min(ids) >= 256 and max(ids) < 49152 - 512
    assert ids == prompt_ids(random.Random(3), 256, 49152)


def test_eight_streams_over_one_is_reported_per_server():
    ours = [Point(1, tokens=100, seconds=1.0), Point(8, tokens=600, seconds=1.5)]
    peer = [Point(1, tokens=60, seconds=1.0), Point(8, tokens=150, seconds=1.0)]
    table = render_table([ServingResult("m", {"decode-heavy": ours}, {"decode-heavy": peer})])
    assert "- m, decode-heavy: 8 streams / 1 stream = cpuserve **4.00x**, llama-server 2.50x" in table
    alone = render_table([ServingResult("m", {"decode-heavy": [Point(1, tokens=10, seconds=1.0)]}, None)])
    assert "streams / 1 stream" not in alone  # no 8-stream point measured: no line


def _closing_then_answering(closes: int) -> httpx.MockTransport:
    """A server that drops the first `closes` requests' connections unanswered, then streams 128 tokens."""
    calls = []

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) <= closes:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        events = [{"choices": [{"text": "a"}]}, {"choices": [], "usage": {"completion_tokens": 128}}]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=body.encode(), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handle)


def _send(transport: httpx.MockTransport) -> Point:
    point = Point(1)

    async def go() -> None:
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            await _one(client, WORKLOADS["decode-heavy"], [300, 301], point)

    asyncio.run(go())
    return point


def test_a_connection_closed_unanswered_is_sent_once_more_and_reported():
    once = _send(_closing_then_answering(1))
    assert (once.requests, once.tokens, once.resent, once.errors) == (1, 128, 1, [])
    table = render_table([ServingResult("m", {"decode-heavy": [Point(1)]}, {"decode-heavy": [once]})])
    assert "resent: llama-server, m, decode-heavy, 1 streams: 1 request(s) sent again" in table
    twice = _send(_closing_then_answering(2))  # closed again: an error, not a third try
    assert (twice.requests, twice.tokens, twice.resent) == (0, 0, 1)
    assert twice.errors == ["RemoteProtocolError: Server disconnected without sending a response."]
    assert "resent:" not in render_table(
        [ServingResult("m", {"decode-heavy": [_send(_closing_then_answering(0))]}, None)]
    )
