"""`cpuserve bench startup`: seconds from launching `cpuserve serve` to the first answered chat
request (a fresh process each time; the model already converted), median of repeats."""

from __future__ import annotations

import json
import statistics
import time
import urllib.request

from cpuserve.bench.server_process import running_server

QUESTION = {
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 16,
    "temperature": 0,
}


def first_answer_seconds(serve_args: list[str]) -> tuple[float, float, str]:
    """(seconds to healthy, seconds to the first full answer, the answer)."""
    start = time.monotonic()
    with running_server(serve_args, poll=0.05) as base:
        healthy = time.monotonic() - start
        req = urllib.request.Request(
            base + "/v1/chat/completions",
            data=json.dumps(QUESTION).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            answer = json.loads(r.read())["choices"][0]["message"]["content"]
        return healthy, time.monotonic() - start, answer


def run_startup_bench(serve_args: list[str], repeats: int) -> str:
    runs = [first_answer_seconds(serve_args) for _ in range(repeats)]
    healthy = statistics.median(r[0] for r in runs)
    answered = statistics.median(r[1] for r in runs)
    cmd = " ".join(["cpuserve", "serve", *serve_args])
    runs_text = ", ".join(f"{r[1]:.2f}" for r in runs)
    return (
        f"{cmd}: healthy after {healthy:.2f} s, first answer after {answered:.2f} s "
        f"(median of {repeats}; runs: {runs_text}); answer: {runs[-1][2]!r}"
    )
