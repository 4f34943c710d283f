"""Periodic engine stats lines on the logger `cpuserve.stats`, as vLLM writes them: every 10 s while
the engine has work, and one more when it becomes idle, so a quiet server's log stays quiet.

An operator watching the log (not a Prometheus scrape) sees throughput, queue depth, KV-cache
pressure, prefix-cache effect and preemptions at a glance. Everything is read from
`AsyncEngine.stats()` (a snapshot of plain counters, cheap and safe on the event loop); rates are
over the interval since the previous line, from the differences of the engine's running totals.
The task runs in the app's lifespan and is cancelled at shutdown (off: --disable-log-stats).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from cpuserve.engine import EngineStats

log = logging.getLogger("cpuserve.stats")

INTERVAL = 10.0  # seconds, vLLM's default


class StatsLogger:
    """Turns successive EngineStats snapshots into log lines; `tick()` is one interval."""

    def __init__(self, engine: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.engine, self.clock = engine, clock
        self.last: EngineStats = engine.stats()
        self.last_time = clock()
        self.busy = False  # whether the previous interval had work: its end gets one idle line

    def tick(self) -> str | None:
        """Log (and return) the line for the interval just ended, or None when idle before and now."""
        now, stats = self.clock(), self.engine.stats()
        last, elapsed = self.last, max(now - self.last_time, 1e-9)
        self.last, self.last_time = stats, now
        prompt = stats.prompt_tokens - last.prompt_tokens
        generated = stats.generation_tokens - last.generation_tokens
        busy = bool(prompt or generated or stats.num_running or stats.num_waiting)
        was_busy, self.busy = self.busy, busy
        if not (busy or was_busy):
            return None
        queries = stats.prefix_queries - last.prefix_queries
        hit_rate = (stats.prefix_hits - last.prefix_hits) / queries if queries else 0.0
        preempted = stats.num_preemptions - last.num_preemptions
        line = (
            f"Engine: Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {generated / elapsed:.1f} tokens/s, "
            f"Running: {stats.num_running} seqs, Waiting: {stats.num_waiting} seqs, "
            f"KV cache usage: {100 * stats.kv_usage:.1f}%, Prefix cache hit rate: {100 * hit_rate:.1f}%, "
            f"Preemptions: {preempted} ({stats.num_preemptions} total)"
        )
        log.info("%s", line)
        return line

    async def run(self, interval: float = INTERVAL) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                self.tick()
            except Exception:  # a stats line is not worth stopping the server for; try again next time
                log.exception("engine stats could not be read")


def start_stats_log(engine: Any, enabled: bool) -> asyncio.Task | None:
    """Start the stats task on the running loop (None when disabled); a line every INTERVAL seconds."""
    if not enabled:
        return None
    return asyncio.get_running_loop().create_task(StatsLogger(engine).run(INTERVAL), name="cpuserve-stats-log")


def stop_stats_log(task: asyncio.Task | None) -> None:
    """Cancel it (it holds nothing: no awaiting needed, none wanted in a lifespan being shut down)."""
    if task is not None:
        task.cancel()
