"""What the engine reports: vLLM-shaped RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from cpuserve.engine.sequence import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str  # everything generated so far (stop strings held back while streaming)
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # set when this request alone failed (finished, outputs as far as they got)
    embedding: list[float] | None = None  # an embedding request's vector (pooling params), once finished
