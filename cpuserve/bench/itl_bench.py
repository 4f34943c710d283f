"""`cpuserve bench itl`: how much one long prompt arriving stalls the streams already decoding.

A real server on 127.0.0.1 gets N streaming completions (temperature 0, ignore_eos, more
max_tokens than the run needs); once every stream is decoding and `before` seconds have passed,
one request with a ~2,000-token text prompt and max_tokens 1 is sent. Per stream: the median gap
between streamed tokens before it was sent, and the longest gap in the window from its sending to
`margin` seconds after its answer; and the long request's own latency. `repeats` long prompts
(different texts) are sent in turn, each after `before` seconds of undisturbed decoding; the
streams are closed `after` seconds past the last answer (the server aborts them).

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
class LongRun:
    """One long prompt: its answer, and what the streams saw before and around it."""

    prompt_tokens: int
    latency: float  # sent to answered, seconds
    median_before: list[float]  # per stream: the median gap in the `before` seconds preceding it
    longest_around: list[float]  # per stream: the longest gap from its sending to `margin` after its answer


@dataclass
class ItlResult:
    server_cpuserve: str  # the package the server imported (from its log)
    tokens: list[int]  # per stream, over the whole run
    runs: list[LongRun]


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
    base: str,
    prompts: list[str],
    clients: int,
    max_tokens: int,
    before: float,
    after: float,
    margin: float,
) -> tuple[list[int], list[LongRun]]:
    import logging

    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    times = [StreamTimes() for _ in range(clients)]
    stop = asyncio.Event()
    windows: list[tuple[float, float, float, int]] = []  # (quiet since, sent, answered, prompt tokens)
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        tasks = [asyncio.ensure_future(_stream(client, i, max_tokens, times[i], stop)) for i in range(clients)]
        deadline = time.monotonic() + 300
        while not all(t.arrivals for t in times):
            if any(task.done() for task in tasks) or time.monotonic() > deadline:
                stop.set()
                await asyncio.gather(*tasks)
                raise RuntimeError("the streams did not all start decoding")
            await asyncio.sleep(0.01)
        quiet = time.monotonic()
        for prompt in prompts:
            await asyncio.sleep(before)
            sent = time.monotonic()
            r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
            answered = time.monotonic()
            if r.status_code != 200:
                stop.set()
                raise RuntimeError(f"long request: HTTP {r.status_code}: {r.text[:300]}")
            windows.append((quiet, sent, answered, r.json()["usage"]["prompt_tokens"]))
            await asyncio.sleep(after)
            quiet = time.monotonic()
        stop.set()
        await asyncio.gather(*tasks)
    if any(t.arrivals[-1] < windows[-1][2] + margin for t in times):
        raise RuntimeError("a stream ended inside a window: raise max_tokens")
    runs = [
        LongRun(
            n,
            answered - sent,
            [statistics.median(t.gaps(quiet, sent)) for t in times],
            [t.longest_overlapping(sent, answered + margin) for t in times],
        )
        for quiet, sent, answered, n in windows
    ]
    return [len(t.arrivals) for t in times], runs


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
    repeats: int = 3,
    seed: int = 0,
) -> ItlResult:
    """One server, `clients` streams throughout, `repeats` long prompts (different texts) in turn;
    `after` must exceed `margin` so that each window ends before the next quiet period begins."""
    from cpuserve.tokenizer import Tokenizer

    tokenizer = Tokenizer(model_dir)
    prompts = [long_prompt(tokenizer, long_tokens, seed + i) for i in range(repeats)]
    with running_server(serve_args, env, log, entry=server_entry(checkout)) as base:
        tokens, runs = asyncio.run(_drive(base, prompts, clients, max_tokens, before, after, margin))
    first = log.read_text().splitlines()[0] if log.is_file() else ""
    return ItlResult(first.removeprefix("[itl] server cpuserve: "), tokens, runs)


def render(result: ItlResult, command: str) -> str:
    ms = 1000.0
    n = len(result.tokens)
    lines = [
        f"server: {command}",
        f"server's cpuserve: {result.server_cpuserve}",
        f"{n} streams, {sum(result.tokens)} tokens streamed; each long request has max_tokens 1",
        "",
        f"| long prompt | tokens | its latency (ms) | median gap before, median of {n} (ms) "
        f"| longest gap around it, max of {n} (ms) | same, min of {n} (ms) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    rows = [
        (r.prompt_tokens, r.latency, statistics.median(r.median_before), max(r.longest_around), min(r.longest_around))
        for r in result.runs
    ]
    for i, (tokens, latency, before, worst, best) in enumerate(rows, 1):
        lines.append(
            f"| {i} | {tokens} | {latency * ms:.0f} | {before * ms:.1f} | {worst * ms:.0f} | {best * ms:.0f} |"
        )
    if len(rows) > 1:
        med = [statistics.median(col) for col in list(zip(*rows, strict=True))[1:]]
        lines.append(f"| median | | {med[0] * ms:.0f} | {med[1] * ms:.1f} | {med[2] * ms:.0f} | {med[3] * ms:.0f} |")
    return "\n".join(lines)
