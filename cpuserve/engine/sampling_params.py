"""Per-request sampling parameters (vLLM's names and meanings), validated when a request is added."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cpuserve import defaults
from cpuserve.errors import CpuserveError

if TYPE_CHECKING:
    from cpuserve.engine.structured.spec import StructuredOutputs

MAX_LOGPROBS = defaults.MAX_LOGPROBS
MAX_N = 16


class InvalidRequest(CpuserveError):
    """A request parameter is impossible; the message names the parameter. Nothing is queued."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # 0: score the prompt (prompt_logprobs) and generate nothing
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token (the chosen one always included)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None  # only these may be drawn (vLLM's name): a per-row logits mask
    structured_outputs: StructuredOutputs | None = None  # a grammar the output is held to (a per-step mask)
    pooling: str | None = None  # an embedding request: "mean" / "last" / "cls" of the prompt's hidden states
    normalize: bool = True  # the pooled vector scaled to unit length

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self, vocab_size: int, max_logprobs: int = MAX_LOGPROBS) -> None:
        """Raise InvalidRequest naming the first impossible parameter (logprobs: at most `max_logprobs`)."""
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequest("n", f"must be between 1 and {MAX_N}, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise InvalidRequest("max_tokens", f"must be at least 0, got {self.max_tokens}")
        if self.structured_outputs is not None:
            param = self.structured_outputs.param
            if self.max_tokens == 0:
                raise InvalidRequest("max_tokens", "0 generates nothing: no output to hold to a constraint")
            if self.min_tokens:
                raise InvalidRequest(
                    "min_tokens", f"cannot be honoured with {param}: the grammar decides where the output ends"
                )
            if self.ignore_eos:
                raise InvalidRequest(
                    "ignore_eos", f"cannot be honoured with {param}: the grammar decides where the output ends"
                )
        if self.min_tokens < 0:
            raise InvalidRequest("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k > vocab_size:
            raise InvalidRequest("top_k", f"must be -1, 0 (no limit) or 1..{vocab_size}, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequest("min_p", f"must be in [0, 1], got {self.min_p}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequest("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise InvalidRequest(name, f"must be in [-2, 2], got {value}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= max_logprobs:
                raise InvalidRequest(name, f"must be between 0 and {max_logprobs}, got {value}")
        for token, bias in self.logit_bias.items():
            if not 0 <= int(token) < vocab_size:
                raise InvalidRequest("logit_bias", f"token id {token} is outside the vocabulary (0..{vocab_size - 1})")
            if not math.isfinite(bias) or not -100 <= bias <= 100:
                raise InvalidRequest("logit_bias", f"bias for token {token} must be in [-100, 100], got {bias}")
        for token in self.stop_token_ids:
            if not 0 <= token < vocab_size:
                raise InvalidRequest("stop_token_ids", f"token id {token} is outside the vocabulary")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise InvalidRequest("allowed_token_ids", "must not be empty")
            bad = next((t for t in self.allowed_token_ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise InvalidRequest("allowed_token_ids", f"token id {bad} is outside the vocabulary")
        if self.pooling is not None:
            if self.pooling not in ("mean", "last", "cls"):
                raise InvalidRequest("pooling", f"must be mean, last or cls, got {self.pooling!r}")
            if self.max_tokens != 0 or self.n != 1:
                raise InvalidRequest("pooling", "an embedding request generates nothing (max_tokens 0, n 1)")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop", "stop strings must not be empty")
