"""Single-sequence generation on the reference decoder: the `cpuserve generate` loop.

The batched engine replaces this for serving; this stays as the simplest correct path and the
oracle its tests compare against.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from cpuserve.engine.sampler import distribution
from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.model.decoder import CausalLM


@dataclass(frozen=True)
class SimpleSampling:
    """Greedy when temperature is 0; otherwise temperature (and optional top-p) sampling."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()


def sample_next(logits: torch.Tensor, params: SimpleSampling, generator: torch.Generator | None) -> int:
    """One token id from fp32 logits [V]: argmax, or a draw from the engine sampler's distribution."""
    if params.temperature <= 0.0:
        return int(torch.argmax(logits))
    probs = distribution(logits, SamplingParams(temperature=params.temperature, top_p=params.top_p))
    return int(torch.multinomial(probs, 1, generator=generator))


def generate_ids(
    model: CausalLM, prompt_ids: list[int], params: SimpleSampling, cache_dtype: torch.dtype | None = None
) -> Iterator[int]:
    """Yield generated token ids; stops after a stop token (which is yielded) or max_tokens. The KV
    cache holds cache_dtype (None: the model's dtype)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    generator = None
    if params.temperature > 0.0:
        generator = torch.Generator()
        generator.manual_seed(params.seed if params.seed is not None else int(torch.seed() % 2**63))
    cache = model.new_cache(1, len(prompt_ids) + params.max_tokens, cache_dtype)
    inputs = torch.tensor([prompt_ids])
    for _ in range(params.max_tokens):
        hidden = model.hidden_states(inputs, cache)
        token = sample_next(model.logits(hidden[0, -1]), params, generator)
        yield token
        if token in params.stop_token_ids:
            return
        inputs = torch.tensor([[token]])
