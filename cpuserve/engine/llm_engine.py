"""LLMEngine: add_request / step / abort over the scheduler, model runner and sampler."""

from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cpuserve import defaults
from cpuserve.engine.block_manager import BlockManager
from cpuserve.engine.model_runner import ModelRunner
from cpuserve.engine.outputs import CompletionOutput, RequestOutput
from cpuserve.engine.sampler import sample, token_logprobs
from cpuserve.engine.sampling_params import InvalidRequest, SamplingParams
from cpuserve.engine.scheduler import Scheduler
from cpuserve.engine.sequence import Sequence
from cpuserve.engine.stats import EngineStats
from cpuserve.engine.text import SequenceText
from cpuserve.errors import ConfigError
from cpuserve.model.decoder import CausalLM
from cpuserve.tokenizer import GenerationDefaults, Tokenizer

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    max_model_len: int | None = None  # default: the model's, or what the KV cache holds if less
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    max_num_batched_tokens: int = defaults.MAX_NUM_BATCHED_TOKENS
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None  # default: sized by the platform memory plan


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    texts: list[SequenceText]
    arrival: float
    first_token_time: float | None = None


class LLMEngine:
    def __init__(
        self, model: CausalLM, tokenizer: Tokenizer, config: EngineConfig, defaults: GenerationDefaults | None = None
    ) -> None:
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
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.max_model_len = max_len
        self.vocab_size = spec.vocab_size
        defaults = defaults or GenerationDefaults()
        self.eos_ids = set(defaults.eos_token_ids) | set(spec.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.blocks = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(model, config.num_kv_blocks, config.block_size)
        self.requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}

    # ---- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        """Validate and queue; an impossible request raises InvalidRequest and queues nothing."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InvalidRequest("request_id", f"{request_id!r} is already running")
        params.validate(self.vocab_size)
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidRequest("prompt", f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
        if not ids:
            raise InvalidRequest("prompt", "is empty")
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(
                "prompt",
                f"is {len(ids)} tokens; this server's max_model_len is {self.max_model_len}, which "
                "leaves no room to generate",
            )
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(
                "max_tokens",
                f"{params.max_tokens} + {len(ids)} prompt tokens exceeds max_model_len "
                f"{self.max_model_len}; ask for at most {self.max_model_len - len(ids)}",
            )
        seqs, texts = [], []
        for index in range(params.n):
            gen = torch.Generator()
            gen.manual_seed((params.seed + index) % 2**63 if params.seed is not None else random.getrandbits(63))
            seq = Sequence(next(self._seq_ids), request_id, index, list(ids), params, gen)
            seqs.append(seq)
            texts.append(SequenceText(self.tokenizer, ids, params))
        self.requests[request_id] = _Request(request_id, text, list(ids), params, seqs, texts, time.monotonic())
        for seq in seqs:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks at once; False if it was not running."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batched forward pass; return outputs of the requests that changed.

        A fault while sampling, detokenizing or shaping one request fails that request alone (its
        output carries `error`, its blocks are freed); a fault in the forward pass is the engine's
        and propagates."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        self.stats["steps"] += 1
        result = self.runner.execute(batch)
        failed: dict[str, BaseException] = {}
        for i, logits in result.prompt_logits.items():
            seq = batch.items[i][0]
            try:
                self._collect_prompt_logprobs(seq, logits)
            except Exception as exc:
                failed.setdefault(seq.request_id, exc)
        touched: dict[str, _Request] = {}
        for seq, n in batch.items:
            self.stats["prompt_tokens"] += max(0, min(n, len(seq.prompt_ids) - seq.num_computed))
            seq.num_computed += n
            self.blocks.register_full_blocks(seq)
        if result.samplers:
            seqs = [batch.items[i][0] for i in result.samplers]
            now = time.monotonic()
            for seq, drawn in zip(seqs, sample(result.sample_logits, seqs, self.eos_ids), strict=True):
                req = self.requests[seq.request_id]
                touched[req.request_id] = req
                if req.request_id in failed:
                    continue
                if isinstance(drawn, Exception):
                    failed[req.request_id] = drawn
                    continue
                req.first_token_time = req.first_token_time or now
                try:
                    self._append(req, seq, *drawn)
                except Exception as exc:
                    failed[req.request_id] = exc
        outputs = []
        for req in touched.values():
            if req.request_id not in failed:
                try:
                    outputs.append(self._output(req))
                except Exception as exc:
                    failed[req.request_id] = exc
        outputs += [self._fail(request_id, exc) for request_id, exc in failed.items()]
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        return outputs

    def _fail(self, request_id: str, exc: BaseException) -> RequestOutput:
        """End one request after a fault of its own: logged, blocks freed, error in its output."""
        log.error("request %s failed (the others go on)", request_id, exc_info=exc)
        req = self.requests[request_id]
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "abort")
        return RequestOutput(
            request_id=request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_ids,
            prompt_logprobs=None,
            outputs=[],
            finished=True,
            error=f"{type(exc).__name__}: {exc}",
        )

    def _collect_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor) -> None:
        if not seq.prompt_logprobs:
            seq.prompt_logprobs.append(None)  # the first prompt token has no prediction
        logprobs = torch.log_softmax(logits, dim=-1)
        for row in range(logprobs.shape[0]):
            target = seq.prompt_ids[seq.num_computed + row + 1]
            seq.prompt_logprobs.append(token_logprobs(logprobs[row], target, seq.params.prompt_logprobs or 0))

    def _append(self, req: _Request, seq: Sequence, token: int, info) -> None:  # type: ignore[no-untyped-def]
        p = seq.params
        seq.output_ids.append(token)
        self.stats["generation_tokens"] += 1
        if info is not None:
            seq.logprobs.append(info)
            seq.cumulative_logprob += info.logprob
        reason, stop = None, None
        if token in self.eos_ids and not p.ignore_eos and len(seq.output_ids) >= p.min_tokens:
            reason = "stop"
        elif token in p.stop_token_ids and len(seq.output_ids) >= p.min_tokens:
            reason, stop = "stop", token
        else:
            found = req.texts[seq.index].add(token)
            if found is not None and len(seq.output_ids) >= p.min_tokens:
                reason, stop = "stop", found
        if reason is None and (
            (p.max_tokens is not None and len(seq.output_ids) >= p.max_tokens) or seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if reason is not None:
            seq.stop_reason = stop
            seq.finish_reason = reason
            self.scheduler.finish(seq, reason)

    def _output(self, req: _Request) -> RequestOutput:
        outs = []
        for seq, text in zip(req.seqs, req.texts, strict=True):
            outs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text.visible(seq.finished),
                    token_ids=list(seq.output_ids),
                    cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None,
                    logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        first = req.seqs[0]
        metrics = {"arrival": req.arrival}
        if req.first_token_time is not None:
            metrics["first_token"] = req.first_token_time
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_ids,
            prompt_logprobs=list(first.prompt_logprobs) if req.params.prompt_logprobs is not None else None,
            outputs=outs,
            finished=all(s.finished for s in req.seqs),
            num_cached_tokens=first.num_cached_tokens,
            metrics=metrics,
        )

    # ---- construction -------------------------------------------------------------------------------

    @classmethod
    def from_model_dir(
        cls,
        model_dir: Path,
        config: EngineConfig,
        dtype: str = "auto",
        machine=None,
        overrides=None,  # type: ignore[no-untyped-def]
    ) -> LLMEngine:
        """Load the model and size the KV cache from the platform memory plan (unless given)."""
        from cpuserve.model.footprint import model_facts, plan_model_memory
        from cpuserve.model.loader import load_model

        spec, _, facts = model_facts(model_dir, dtype)
        if config.num_kv_blocks is None:
            if machine is None or overrides is None:
                import os

                from cpuserve.platform.machine import detect_machine
                from cpuserve.platform.overrides import read_overrides

                machine, overrides = machine or detect_machine(), overrides or read_overrides(os.environ)
            max_len = config.max_model_len or spec.max_position_embeddings
            mem = plan_model_memory(
                machine, overrides, spec, facts, max_len, config.max_num_seqs, config.max_num_batched_tokens
            )
            config.num_kv_blocks = max(1, mem.kv_tokens // config.block_size)
            log.info(
                "KV cache: %.2f GiB, %d blocks of %d tokens (%s)",
                config.num_kv_blocks * config.block_size * facts["kv_bytes_per_token"] / 1024**3,
                config.num_kv_blocks,
                config.block_size,
                mem.reason,
            )
        model = load_model(model_dir, dtype)
        return cls(model, Tokenizer(model_dir), config, GenerationDefaults.load(model_dir))

    def stats_snapshot(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=self.blocks.usage,
            prefix_queries=self.blocks.prefix_queries,
            prefix_hits=self.blocks.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            steps=self.stats["steps"],
            prompt_tokens=self.stats["prompt_tokens"],
            generation_tokens=self.stats["generation_tokens"],
        )

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)
