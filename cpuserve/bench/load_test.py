"""`cpuserve bench load`: many concurrent streaming clients against a real server for a fixed time.

Every response is checked as it arrives (JSON events, one id, the role first, exactly one
finish_reason, usage consistent with max_tokens, [DONE] last); any HTTP error, malformed event or
transport failure counts as an error. The server's resident memory is sampled once a second, so a
leak shows as growth after warm-up.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from cpuserve.bench.server_process import PROCESSES, running_server

PROMPTS = [
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Explain photosynthesis in one paragraph.",
    "List three prime numbers and say why they are prime.",
    "Tell me a short story about a robot who learns to paint.",
    "How do I reverse a list in Python?",
    "Summarize the plot of Romeo and Juliet.",
    "Give me two tips for learning a new language.",
]


@dataclass
class LoadResult:
    clients: int
    seconds: float
    completed: int = 0
    errors: list[str] = field(default_factory=list)
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    rss_mib: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, MiB)

    def rss_growth_after(self, fraction: float) -> float:
        """MiB gained from the sample at `fraction` of the run to the largest sample after it."""
        later = [m for t, m in self.rss_mib if t >= fraction * self.seconds]
        return max(later) - later[0] if later else 0.0


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def check_stream(events: list, max_tokens: int) -> str | None:
    """What is wrong with one streamed chat completion, or None when it is well formed."""
    if not events or events[-1] != "[DONE]":
        return "stream did not end with [DONE]"
    body = events[:-1]
    if any(not isinstance(e, dict) for e in body):
        return "an event is not a JSON object"
    errors = [e for e in body if "error" in e]
    if errors:
        return f"error event: {errors[0]['error'].get('message')}"
    if len({e.get("id") for e in body}) != 1:
        return "events carry different ids"
    if body[0]["choices"][0]["delta"].get("role") != "assistant":
        return "the first event does not carry the role"
    finishes = [c["finish_reason"] for e in body for c in e["choices"] if c.get("finish_reason")]
    if len(finishes) != 1 or finishes[0] not in ("stop", "length"):
        return f"finish reasons {finishes}"
    usage = body[-1].get("usage")
    if not usage or usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]:
        return f"bad usage {usage}"
    done = usage["completion_tokens"]
    if (finishes[0] == "length" and done != max_tokens) or not 0 < done <= max_tokens:
        return f"{done} completion tokens for max_tokens {max_tokens} ({finishes[0]})"
    return None


async def _client(httpx, base: str, deadline: float, rng: random.Random, result: LoadResult) -> None:  # type: ignore[no-untyped-def]
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        while time.monotonic() < deadline:
            max_tokens = rng.randint(8, 96)
            body = {
                "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
                "max_tokens": max_tokens,
                "temperature": 0.8,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            start = time.monotonic()
            first = None
            events: list = []
            try:
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        result.errors.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                        continue
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        payload = line[6:]
                        first = first or time.monotonic()
                        events.append(payload if payload == "[DONE]" else json.loads(payload))
            except Exception as exc:
                result.errors.append(f"{type(exc).__name__}: {exc}")
                continue
            problem = check_stream(events, max_tokens)
            if problem:
                result.errors.append(problem)
                continue
            result.completed += 1
            result.tokens += events[-2]["usage"]["completion_tokens"]
            result.ttft.append((first or start) - start)


async def _drive(base: str, pid: int, clients: int, seconds: float, seed: int) -> LoadResult:
    import logging

    import httpx  # a dev dependency (./run setup installs it)

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request

    result = LoadResult(clients, seconds)
    start = time.monotonic()
    deadline = start + seconds

    async def sample_memory() -> None:
        while time.monotonic() < deadline:
            result.rss_mib.append((time.monotonic() - start, rss_mib(pid)))
            await asyncio.sleep(1.0)

    sampler = asyncio.ensure_future(sample_memory())
    await asyncio.gather(*(_client(httpx, base, deadline, random.Random(seed + i), result) for i in range(clients)))
    sampler.cancel()
    result.seconds = time.monotonic() - start  # includes the requests still finishing at the deadline
    return result


def run_load(serve_args: list[str], env: dict[str, str], clients: int, seconds: float, seed: int = 0) -> LoadResult:
    with running_server(serve_args, env) as base:
        return asyncio.run(_drive(base, PROCESSES[base].pid, clients, seconds, seed))


def render(result: LoadResult, command: str) -> str:
    ttft = sorted(result.ttft) or [0.0]
    rss = [m for _, m in result.rss_mib]
    warm = next((m for t, m in result.rss_mib if t >= 0.25 * result.seconds), rss[0] if rss else 0.0)
    lines = [
        f"command: {command}",
        f"clients: {result.clients}, run: {result.seconds:.1f} s",
        f"completed: {result.completed}, errors: {len(result.errors)}",
        f"generated tokens: {result.tokens} ({result.tokens / result.seconds:.1f} tok/s aggregate)",
        f"time to first token: median {statistics.median(ttft):.2f} s, p90 {ttft[int(0.9 * (len(ttft) - 1))]:.2f} s",
        f"server RSS: start {rss[0] if rss else 0:.0f} MiB, after warm-up (25%) {warm:.0f} MiB, "
        f"max {max(rss, default=0):.0f} MiB, end {rss[-1] if rss else 0:.0f} MiB; "
        f"growth after warm-up {result.rss_growth_after(0.25):.0f} MiB, over the second half "
        f"{result.rss_growth_after(0.5):.0f} MiB",
    ]
    step = max(1, len(result.rss_mib) // 10)
    lines.append("server RSS over time: " + ", ".join(f"{t:.0f}s {m:.0f}" for t, m in result.rss_mib[::step]))
    lines += [f"  error: {e}" for e in result.errors[:10]]
    return "\n".join(lines)
