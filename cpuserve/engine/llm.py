"""Offline batch generation in the spirit of vLLM's `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

import itertools

from cpuserve.engine.llm_engine import EngineConfig, LLMEngine
from cpuserve.engine.outputs import RequestOutput
from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.model.resolve import resolve_model


class LLM:
    def __init__(  # type: ignore[no-untyped-def]
        self,
        model: str | None = None,
        dtype: str = "auto",
        cache_dir: str | None = None,
        quantize_lm_head: str | None = None,
        **config,
    ) -> None:
        """quantize_lm_head: as serve's --quantize-lm-head (int8 by default, "none" keeps the head)."""
        self.engine = LLMEngine.from_model_dir(
            resolve_model(model, cache_dir), EngineConfig(**config), dtype, quantize_lm_head=quantize_lm_head
        )
        self._ids = itertools.count()

    @property
    def tokenizer(self):  # type: ignore[no-untyped-def]
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion together; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        return run_to_completion(self.engine, dict(zip(ids, prompts, strict=True)), sampling_params)


def run_to_completion(
    engine: LLMEngine,
    prompts: dict[str, str | list[int]],
    sampling_params: SamplingParams | list[SamplingParams] | None = None,
) -> list[RequestOutput]:
    """Add every request (request id -> prompt), step until all finish; outputs in the given order."""
    params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
    for (request_id, prompt), p in zip(prompts.items(), params, strict=True):
        engine.add_request(request_id, prompt, p or SamplingParams())
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[i] for i in prompts]
