"""A snapshot of the engine's state for the server and its metrics: plain numbers, no engine objects."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    num_running: int  # sequences in the running batch
    num_waiting: int  # sequences waiting to be scheduled
    kv_usage: float  # fraction of KV cache blocks in use
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of which served from it
    num_preemptions: int
    steps: int
    prompt_tokens: int
    generation_tokens: int

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
