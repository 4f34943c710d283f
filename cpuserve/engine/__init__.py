"""The serving engine: requests in, batched forward passes over a paged KV cache, tokens out.

This module is the engine's public facade: the server, the CLI and the benchmarks import from here
only, never from the engine's modules.
"""

from cpuserve.engine.async_engine import AsyncEngine, EngineDeadError, RequestCancelled, RequestFailed
from cpuserve.engine.llm_engine import EngineConfig, LLMEngine
from cpuserve.engine.outputs import CompletionOutput, RequestOutput
from cpuserve.engine.sampling_params import MAX_LOGPROBS, MAX_N, InvalidRequest, SamplingParams
from cpuserve.engine.sequence import TokenLogprobs
from cpuserve.engine.stats import EngineStats
from cpuserve.engine.structured import StructuredOutputs

__all__ = [
    "MAX_LOGPROBS",
    "MAX_N",
    "AsyncEngine",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "EngineStats",
    "InvalidRequest",
    "LLMEngine",
    "RequestCancelled",
    "RequestFailed",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputs",
    "TokenLogprobs",
]
