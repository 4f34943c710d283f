"""LLMEngine: the synchronous engine, input processor -> engine core -> output processor on one
thread (the offline LLM, the benchmarks and the tests drive it; the server drives the same three
pieces split over threads, async_engine.py)."""

from __future__ import annotations

import logging
from pathlib import Path

from cpuserve.engine.core import EngineConfig, EngineCore
from cpuserve.engine.input_processor import InputProcessor
from cpuserve.engine.output_processor import RequestState
from cpuserve.engine.outputs import RequestOutput
from cpuserve.engine.pooling import PoolingConfig
from cpuserve.engine.sampling_params import InvalidRequest, SamplingParams
from cpuserve.engine.stats import EngineStats
from cpuserve.engine.structured import GrammarCompiler
from cpuserve.errors import ConfigError
from cpuserve.model.decoder import CausalLM
from cpuserve.tokenizer import GenerationDefaults, Tokenizer

log = logging.getLogger(__name__)

__all__ = ["EngineConfig", "LLMEngine"]


def eos_token_ids(model: CausalLM, tokenizer: Tokenizer, defaults: GenerationDefaults) -> frozenset[int]:
    """Every id that ends a sequence: generation_config.json's, config.json's and the tokenizer's."""
    ids = set(defaults.eos_token_ids) | set(model.spec.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def check_max_model_len(model: CausalLM, config: EngineConfig) -> int:
    """The context length this engine serves: asked for, else the model's (capped by the KV cache)."""
    spec = model.spec
    if config.num_kv_blocks is None:
        raise ConfigError("num_kv_blocks is not set (LLMEngine.from_model_dir sizes it from memory)")
    capacity = config.num_kv_blocks * config.block_size
    max_len = config.max_model_len or min(spec.max_position_embeddings, capacity)
    if max_len > spec.max_position_embeddings:
        raise ConfigError(
            f"--max-model-len {max_len} is longer than the model's {spec.max_position_embeddings} positions"
        )
    if max_len > capacity:
        raise ConfigError(
            f"--max-model-len {max_len} needs {max_len} tokens of KV cache but it holds {capacity}; "
            "lower --max-model-len or give the KV cache more memory (VLLM_CPU_KVCACHE_SPACE)"
        )
    return max_len


class LLMEngine:
    def __init__(
        self, model: CausalLM, tokenizer: Tokenizer, config: EngineConfig, defaults: GenerationDefaults | None = None
    ) -> None:
        max_len = check_max_model_len(model, config)
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.max_model_len = max_len
        self.vocab_size = model.spec.vocab_size
        self.eos_ids = eos_token_ids(model, tokenizer, defaults or GenerationDefaults())
        self.core = EngineCore(model, config, max_len, self.eos_ids)
        self.grammars = GrammarCompiler(tokenizer.to_json(), self.vocab_size, self.eos_ids)
        self.max_logprobs = self.vocab_size if config.max_logprobs == -1 else config.max_logprobs
        self.inputs = InputProcessor(tokenizer, self.vocab_size, max_len, self.grammars, self.max_logprobs)
        self.states: dict[str, RequestState] = {}
        self.facts: dict | None = None  # the model's footprint facts when built by from_model_dir
        self.pooling = PoolingConfig()  # how embedding requests pool (from_model_dir reads the model's)

    # ---- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        """Validate and queue; an impossible request raises InvalidRequest and queues nothing."""
        if request_id in self.states:
            raise InvalidRequest("request_id", f"{request_id!r} is already running")
        request = self.inputs.process(request_id, prompt, params or SamplingParams())
        self.states[request_id] = RequestState(self.tokenizer, request)
        self.core.add_request(request)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks at once; False if it was not running."""
        self.states.pop(request_id, None)
        return self.core.abort(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.states) or self.core.has_unfinished()

    # ---- one step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine-core step, its outputs turned into text; the requests that changed.

        A fault while sampling, detokenizing or shaping one request fails that request alone (its
        output carries `error`, its blocks are freed); a fault in the forward pass propagates."""
        outputs = []
        for core_out in self.core.step():
            state = self.states.get(core_out.request_id)
            if state is None:
                continue
            if core_out.error is not None:
                outputs.append(state.failed(core_out.error))
                continue
            try:
                out, stops = state.process(core_out)
            except Exception as exc:
                log.error("request %s failed (the others go on)", core_out.request_id, exc_info=exc)
                self.core.abort(core_out.request_id)
                outputs.append(state.failed(f"{type(exc).__name__}: {exc}"))
                continue
            for index, stop in stops:
                self.core.finish_by_stop_string(core_out.request_id, index, stop)
            if out is not None:
                outputs.append(out)
        for out in outputs:
            if out.finished:
                self.states.pop(out.request_id, None)
        return outputs

    def stats_snapshot(self) -> EngineStats:
        return self.core.stats()

    # ---- what tests and benchmarks look at ---------------------------------------------------------

    @property
    def scheduler(self):  # type: ignore[no-untyped-def]
        return self.core.scheduler

    @property
    def blocks(self):  # type: ignore[no-untyped-def]
        return self.core.blocks

    @property
    def num_running(self) -> int:
        return len(self.core.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.core.scheduler.waiting)

    # ---- construction -------------------------------------------------------------------------------

    @classmethod
    def from_model_dir(
        cls,
        model_dir: Path,
        config: EngineConfig,
        dtype: str = "auto",
        machine=None,  # type: ignore[no-untyped-def]
        overrides=None,  # type: ignore[no-untyped-def]
        quantize_lm_head: str | None = None,
        model: CausalLM | None = None,
        tokenizer_dir: Path | None = None,
    ) -> LLMEngine:
        """Read the model directory once (config, quantization config, headers), size the KV cache
        from the platform memory plan (unless given) and load. Environment settings come from
        `overrides` (read and validated once at start; read here if not given); an explicit
        quantize_lm_head (the --quantize-lm-head flag) wins over CPUSERVE_QUANTIZE_LM_HEAD; with neither,
        the head is int8 (loader.DEFAULT_LM_HEAD), "none" keeps it. `model`: this directory's model,
        already loaded (by another engine: a benchmark's engines with different caches share it).
        `tokenizer_dir`: vLLM's --tokenizer, a local directory whose tokenizer (and chat template)
        replaces the model's own; its vocabulary must fit the model's."""
        from cpuserve.model.footprint import model_facts, plan_model_memory
        from cpuserve.model.loader import lm_head_setting, load_model
        from cpuserve.model.source import ModelSource
        from cpuserve.platform.machine import detect_machine
        from cpuserve.platform.overrides import read_overrides

        if overrides is None:
            import os

            overrides = read_overrides(os.environ)
        source = ModelSource.open(model_dir)
        spec, _, facts = model_facts(source, dtype, config.kv_cache_dtype)
        tokenizer = Tokenizer(tokenizer_dir or model_dir)  # before the weights: a wrong one fails at once
        if tokenizer_dir is not None and tokenizer.vocab_size > spec.vocab_size:
            raise ConfigError(
                f"--tokenizer {tokenizer_dir}: {tokenizer.vocab_size} tokens, more than the model's {spec.vocab_size}"
            )
        if config.kv_cache_dtype == "auto" and facts.get("kv_cache_storage"):
            config.kv_cache_dtype = facts["kv_cache_storage"]  # footprint.auto_kv_storage: the checkpoint's
        if config.num_kv_blocks is None:
            machine = machine or detect_machine()
            max_len = config.max_model_len or spec.max_position_embeddings
            mem = plan_model_memory(
                machine, overrides, spec, facts, max_len, config.max_num_seqs, config.max_num_batched_tokens
            )
            config.num_kv_blocks = max(1, mem.kv_tokens // config.block_size)
            log.info(
                "KV cache: %.2f GiB, %d blocks of %d tokens, %s (%s)",
                config.num_kv_blocks * config.block_size * facts["kv_bytes_per_token"] / 1024**3,
                config.num_kv_blocks,
                config.block_size,
                facts["kv_cache_dtype"],
                mem.reason,
            )
        if model is None:
            head = lm_head_setting(quantize_lm_head, overrides.quantize_lm_head)
            model = load_model(source, dtype, quantize_lm_head=head)
        engine = cls(model, tokenizer, config, GenerationDefaults.load(model_dir))
        engine.pooling = PoolingConfig.load(model_dir)
        engine.facts = facts
        return engine
