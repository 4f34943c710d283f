"""`cpuserve bench itl`: how much one long prompt arriving stalls the streams already decoding.

A real server on 127.0.0.1 gets N streaming completions (temperature 0, ignore_eos, more
max_tokens than the run needs); once every stream is decoding and `before` seconds have passed,
one request with a ~2,000-token text prompt and max_tokens 1 is sent. Per stream: the median gap
between streamed tokens before it was sent, and the longest gap in the window from its sending to
`margin` seconds after its answer; and the long request's own latency. The streams are closed
`after` seconds past the answer (the server aborts them).

The server can be any checkout (`checkout`): its `cpuserve` is imported ahead of everything else,
and the log records which one was, so old and new code are measured by the same client.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from cpuserve.bench.server_process import running_server

PROMPTS = [
    "Count slowly from one to one thousand:",
    "Write a very long story about a lighthouse keeper.",
    "List every country you know, one per line:",
    "Explain, step by step and at length, how a compiler works.",
    "Describe a walk through a forest in great detail.",
    "Write the history of the bicycle as a long essay.",
    "Tell a long tale of two ships crossing an ocean.",
    "Recite an endless poem about the sea.",
]
WORDS = (
    "river stone cloud paper window garden silver engine harbor lantern meadow copper orchard "
    "thunder violet canyon marble pepper saddle timber walnut glacier pillow quartz ribbon"
).split()


@dataclass
class StreamTimes:
    arrivals: list[float] = field(default_factory=list)  # monotonic time of each token event

    def gaps(self, start: float, end: float) -> list[float]:
        """Gaps between consecutive events whose later event falls in [start, end)."""
        a = self.arrivals
        return [a[i] - a[i - 1] for i in range(1, len(a)) if start <= a[i] < end and a[i - 1] >= start]

    def longest_overlapping(self, start: float, end: float) -> float:
        """The longest gap that overlaps [start, end] (it may begin before the window opens)."""
        a = self.arrivals
        return max((a[i] - a[i - 1] for i in range(1, len(a)) if a[i] >= start and a[i - 1] <= end), default=0.0)


@dataclass
class ItlResult:
    server_cpuserve: str
    long_prompt_tokens: int
    long_latency: float
    median_before: list[float]  # per stream, seconds
    longest_in_window: list[float]
    tokens: list[int]


def long_prompt(tokenizer, tokens: int, seed: int) -> str:  # type: ignore[no-untyped-def]
    """Random words (no prefix shared with anything cached) encoding to about `tokens` tokens."""
    rng = random.Random(seed)
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words))) < tokens:
        words += [rng.choice(WORDS) + str(rng.randint(0, 99)) for _ in range(50)]
    while len(words) > 1 and len(tokenizer.encode(" ".join(words[:-1]))) >= tokens:
        words.pop()
    return " ".join(words)


def server_entry(checkout: Path) -> list[str]:
    """`python -m cpuserve`, except that `checkout`'s package wins over the caller's working
    directory and the installed one; the first log line names the package imported."""
    code = (
        f"import sys; sys.path.insert(0, {str(checkout)!r}); import cpuserve, cpuserve.cli; "
        "print('[itl] server cpuserve:', cpuserve.__file__, flush=True); sys.exit(cpuserve.cli.main(sys.argv[1:]))"
    )
    return [sys.executable, "-c", code]


async def _stream(client, i: int, max_tokens: int, times: StreamTimes, stop: asyncio.Event) -> None:  # type: ignore[no-untyped-def]
    body = {
        "prompt": PROMPTS[i % len(PROMPTS)],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"stream {i}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.arrivals.append(time.monotonic())
                if stop.is_set():
                    return  # leaving the block closes the connection: the server aborts the request


async def _drive(
    base: str, prompt: str, clients: int, max_tokens: int, before: float, after: float, margin: float
) -> tuple[int, float, list[float], list[float], list[int]]:
    import logging

    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    times = [StreamTimes() for _ in range(clients)]
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        tasks = [asyncio.ensure_future(_stream(client, i, max_tokens, times[i], stop)) for i in range(clients)]
        deadline = time.monotonic() + 300
        while not all(t.arrivals for t in times):
            if any(task.done() for task in tasks) or time.monotonic() > deadline:
                stop.set()
                await asyncio.gather(*tasks)
                raise RuntimeError("the streams did not all start decoding")
            await asyncio.sleep(0.01)
        decoding = time.monotonic()
        await asyncio.sleep(before)
        sent = time.monotonic()
        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
        answered = time.monotonic()
        if r.status_code != 200:
            raise RuntimeError(f"long request: HTTP {r.status_code}: {r.text[:300]}")
        await asyncio.sleep(after)
        stop.set()
        await asyncio.gather(*tasks)
    if any(t.arrivals[-1] < answered + margin for t in times):
        raise RuntimeError("a stream ended inside the window: raise max_tokens")
    median_before = [statistics.median(t.gaps(decoding, sent)) for t in times]
    longest = [t.longest_overlapping(sent, answered + margin) for t in times]
    return r.json()["usage"]["prompt_tokens"], answered - sent, median_before, longest, [len(t.arrivals) for t in times]


def run_itl_bench(
    model_dir: Path,
    serve_args: list[str],
    env: dict[str, str],
    checkout: Path,
    log: Path,
    clients: int = 8,
    long_tokens: int = 2000,
    max_tokens: int = 2000,
    before: float = 4.0,
    after: float = 2.0,
    margin: float = 1.0,
    seed: int = 0,
) -> ItlResult:
    from cpuserve.tokenizer import Tokenizer

    prompt = long_prompt(Tokenizer(model_dir), long_tokens, seed)
    with running_server(serve_args, env, log, entry=server_entry(checkout)) as base:
        n, latency, median_before, longest, tokens = asyncio.run(
            _drive(base, prompt, clients, max_tokens, before, after, margin)
        )
    first = log.read_text().splitlines()[0] if log.is_file() else ""
    return ItlResult(first.removeprefix("[itl] server cpuserve: "), n, latency, median_before, longest, tokens)


def render(result: ItlResult, command: str) -> str:
    ms = 1000.0
    lines = [
        f"server: {command}",
        f"server's cpuserve: {result.server_cpuserve}",
        f"long request: {result.long_prompt_tokens} prompt tokens, max_tokens 1: {result.long_latency * ms:.0f} ms",
        "",
        "| stream | tokens | median gap before (ms) | longest gap around the long prompt (ms) |",
        "|---:|---:|---:|---:|",
    ]
    for i, (med, top, n) in enumerate(zip(result.median_before, result.longest_in_window, result.tokens, strict=True)):
        lines.append(f"| {i} | {n} | {med * ms:.1f} | {top * ms:.0f} |")
    lines.append(
        f"| all | {sum(result.tokens)} | {statistics.median(result.median_before) * ms:.1f} (median) "
        f"| {max(result.longest_in_window) * ms:.0f} (max) |"
    )
    return "\n".join(lines)
