"""One generated sequence (a request with n > 1 has n of them): its tokens, KV blocks and state.

The scheduler owns it: `num_computed`, the block table, the output ids and the finish decision.
Text, stop strings and logprobs live in the output processor, outside the engine core."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from cpuserve.engine.pooling import PoolState
from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.engine.structured import GrammarState


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprobs:
    """The chosen token's logprob and rank, and the top-k alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    rank: int
    top: dict[int, float]


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    first_scheduled: float | None = None  # monotonic time its first step was scheduled (vLLM's queue time ends)
    ended_by_token: bool = False  # finished by drawing EOS or a stop token id (whose text is not output)
    allowed: torch.Tensor | None = None  # bool [V]: the tokens this sequence may draw (None: all)
    grammar: GrammarState | None = None  # its structured-output constraint: a new mask every step
    pool: PoolState | None = None  # an embedding request's pooled hidden states so far (the runner's)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    @property
    def in_prefill(self) -> bool:
        """Still computing prompt tokens (their logprobs, if asked for, are being collected)."""
        return self.num_computed < len(self.prompt_ids)
