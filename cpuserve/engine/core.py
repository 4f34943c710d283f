"""EngineCore: the loop that owns the model, the KV cache and the sequences.

One step is `schedule()` -> `execute_model()` -> `update_from_output()`: the scheduler says what
to run, the runner runs it (forward pass and sampling), the scheduler advances the sequences with
what came out. The core takes requests already tokenized and validated (input_processor.py) and
returns token ids (requests.py); text is made outside it (output_processor.py), so nothing here
waits for a tokenizer.
"""

from __future__ import annotations

import itertools
import logging
import random
from dataclasses import dataclass

import torch

from cpuserve import defaults
from cpuserve.engine.block_manager import BlockManager
from cpuserve.engine.model_runner import ModelRunner
from cpuserve.engine.requests import EngineCoreOutput, EngineCoreRequest, SequenceDelta
from cpuserve.engine.sampling_params import InvalidRequest
from cpuserve.engine.scheduler import Scheduler, SequenceUpdate
from cpuserve.engine.sequence import Sequence
from cpuserve.engine.stats import EngineStats
from cpuserve.kv_cache_dtype import kv_cache_storage
from cpuserve.model.decoder import CausalLM

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    max_model_len: int | None = None  # default: the model's, or what the KV cache holds if less
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    max_num_batched_tokens: int = defaults.MAX_NUM_BATCHED_TOKENS
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None  # default: sized by the platform memory plan
    long_prefill_token_threshold: int = 0  # vLLM's: at most this many prompt tokens per request and step
    # "auto": the model's dtype (from_model_dir makes it the checkpoint's where --dtype auto computes
    # it in float32: footprint.auto_kv_storage); bfloat16, float16; int8 (or fp8 names): engine/kv_int8.py
    kv_cache_dtype: str = "auto"
    # vLLM's --seed: requests without a seed of their own draw theirs from a generator seeded with
    # this, so a run is reproducible (the same requests in the same order give the same outputs)
    # while two unseeded requests still differ. None: from the OS.
    seed: int | None = None
    # vLLM's --max-logprobs: the most logprobs a request may ask for; -1: the vocabulary
    max_logprobs: int = defaults.MAX_LOGPROBS


class EngineCore:
    def __init__(self, model: CausalLM, config: EngineConfig, max_model_len: int, eos_ids: frozenset[int]) -> None:
        self.model, self.config, self.max_model_len = model, config, max_model_len
        self.vocab_size = model.spec.vocab_size
        self.blocks = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.blocks,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            max_model_len,
            eos_ids,
            config.long_prefill_token_threshold,
        )
        self.runner = ModelRunner(
            model,
            config.num_kv_blocks,
            config.block_size,
            eos_ids,
            kv_storage=kv_cache_storage(config.kv_cache_dtype),
        )
        self.requests: dict[str, list[Sequence]] = {}
        self._seq_ids = itertools.count()
        self._seeds = random.Random(config.seed) if config.seed is not None else random.SystemRandom()
        self.steps = 0

    # ---- requests -------------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request the input processor accepted: n sequences, each with its own generator."""
        if request.request_id in self.requests:
            raise InvalidRequest("request_id", f"{request.request_id!r} is already running")
        params, seqs = request.params, []
        allowed = None
        if params.allowed_token_ids is not None:
            allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
            allowed[torch.tensor(params.allowed_token_ids, dtype=torch.long)] = True
        for index in range(params.n):
            gen = torch.Generator()
            gen.manual_seed((params.seed + index) % 2**63 if params.seed is not None else self._seeds.getrandbits(63))
            seq = Sequence(next(self._seq_ids), request.request_id, index, list(request.prompt_ids), params, gen)
            seq.allowed = allowed
            seq.grammar = request.grammar.new_state() if request.grammar is not None else None
            seqs.append(seq)
        self.requests[request.request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks at once; False if it was not running."""
        seqs = self.requests.pop(request_id, None)
        if seqs is None:
            return False
        for seq in seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "abort")
        return True

    def finish_by_stop_string(self, request_id: str, index: int, stop: str) -> None:
        """The output processor saw a stop string: the sequence ends (unknown ids are ignored)."""
        seqs = self.requests.get(request_id)
        if seqs is None:
            return
        self.scheduler.finish_by_stop_string(seqs[index], stop)
        if all(s.finished for s in seqs):
            del self.requests[request_id]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    # ---- one step ---------------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """One batched forward pass; the news of every request that drew a token or failed.

        A fault while sampling one request (or computing its prompt logprobs) fails that request
        alone (its output carries `error`, its blocks are freed); a fault in the forward pass is
        the engine's and propagates."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        self.steps += 1
        updates = self.scheduler.update_from_output(batch, self.runner.execute_model(batch))
        by_request: dict[str, list[SequenceUpdate]] = {}
        for update in updates:
            by_request.setdefault(update.seq.request_id, []).append(update)
        outputs = []
        for request_id, group in by_request.items():
            prompt_lps = next((u.prompt_logprobs for u in group if u.prompt_logprobs is not None), None)
            error = next((u.error for u in group if u.error is not None), None)
            if error is not None:
                outputs.append(self._fail(request_id, error))
            elif any(u.news for u in group) or prompt_lps is not None:
                deltas = [self._delta(u) for u in group if u.news]
                embedding = next((u.pooled for u in group if u.pooled is not None), None)
                outputs.append(EngineCoreOutput(request_id, deltas, prompt_lps, embedding=embedding))
                if all(s.finished for s in self.requests[request_id]):
                    del self.requests[request_id]
        return outputs

    @staticmethod
    def _delta(update: SequenceUpdate) -> SequenceDelta:
        seq = update.seq
        return SequenceDelta(
            index=seq.index,
            new_token_ids=[s.token for s in update.new_tokens],
            new_logprobs=[s.logprobs for s in update.new_tokens],
            finish_reason=seq.finish_reason if seq.finished else None,
            stop_reason=seq.stop_reason,
            num_cached_tokens=seq.num_cached_tokens,
            ended_by_token=seq.finished and seq.ended_by_token,
            first_scheduled=seq.first_scheduled,
        )

    def _fail(self, request_id: str, exc: BaseException) -> EngineCoreOutput:
        """End one request after a fault of its own: logged, blocks freed, the error in its output."""
        log.error("request %s failed (the others go on)", request_id, exc_info=exc)
        self.abort(request_id)
        return EngineCoreOutput(request_id, [], error=f"{type(exc).__name__}: {exc}")

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=self.blocks.usage,
            prefix_queries=self.blocks.prefix_queries,
            prefix_hits=self.blocks.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            steps=self.steps,
            prompt_tokens=self.scheduler.num_prompt_tokens,
            generation_tokens=self.scheduler.num_generated_tokens,
        )
