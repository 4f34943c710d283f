"""The plain records that cross the engine core's boundary: a request ready to run (tokenized and
validated by the input processor) and what one step did to it (for the output processor)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.engine.sequence import TokenLogprobs
from cpuserve.engine.structured import CompiledGrammar


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None = None  # the text, when the request came as text (echoed back in outputs)
    grammar: CompiledGrammar | None = None  # params.structured_outputs, compiled by the input processor
    arrival: float = field(default_factory=time.monotonic)


@dataclass
class SequenceDelta:
    """One sequence's news from one step: tokens drawn (with their logprobs when asked for), and
    the finish the core decided (EOS, a stop token id, a length limit)."""

    index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    ended_by_token: bool = False  # the last token is the EOS or stop token id that ended it: it has no text
    first_scheduled: float | None = None  # monotonic time the sequence's first step was scheduled


@dataclass
class EngineCoreOutput:
    """One request's news from one step. `error` set: the request failed alone and is gone."""

    request_id: str
    deltas: list[SequenceDelta]
    prompt_logprobs: tuple[int, list[TokenLogprobs]] | None = None  # (first position, entries)
    error: str | None = None
    embedding: list[float] | None = None  # an embedding request's pooled vector (with its finish)
    time: float = field(default_factory=time.monotonic)
