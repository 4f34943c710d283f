"""Continuous batching: which sequences run this step, how many tokens of each, and what the step's
results do to them.

The scheduler owns every sequence's state: `schedule()` says what to run (a ScheduledBatch);
`update_from_output()` takes what came out (sampled tokens) and advances the sequences: tokens
computed, full blocks registered in the prefix cache, tokens appended, and the stops it can decide
from token ids alone (EOS, stop token ids, max_tokens, max_model_len). Stop strings need text and
are decided by the output processor, outside the engine core. Never touches tensors.

Each step: running decodes first (one token each, so a long prompt never stalls a stream), then
running chunked prefills, then waiting sequences first-come first-served, all under the token
budget and max_num_seqs. When KV blocks run out, the most recently admitted sequence is
preempted: its blocks are freed and it is recomputed later from its tokens, which changes nothing
in its output.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from cpuserve.engine.block_manager import BlockManager
from cpuserve.engine.sequence import Sequence, Status, TokenLogprobs


@dataclass
class ScheduledBatch:
    """This step's work: (sequence, number of tokens to compute), in batch order, and how many of
    each item's last positions are sampled (0: a prefill chunk that does not reach the end; 1: the
    next token; more: a runner that verifies several tokens at once, as speculative decoding will)."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_sampled: list[int] = field(default_factory=list)  # one per item, set when scheduled

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


@dataclass
class Sampled:
    """One drawn token and, when the request asked for them, its logprobs."""

    token: int
    logprobs: TokenLogprobs | None = None


@dataclass
class StepOutput:
    """What a step computed, by batch index: drawn tokens (or the fault drawing raised), prompt
    logprobs (first position, entries), and faults of an item's other work."""

    sampled: dict[int, list[Sampled | Exception]] = field(default_factory=dict)
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    errors: dict[int, Exception] = field(default_factory=dict)
    pooled: dict[int, list[float]] = field(default_factory=dict)  # an embedding request's vector, when complete


@dataclass
class SequenceUpdate:
    """What one step did to one sequence: the scheduler's answer to a StepOutput."""

    seq: Sequence
    new_tokens: list[Sampled] = field(default_factory=list)
    prompt_logprobs: tuple[int, list[TokenLogprobs]] | None = None
    error: Exception | None = None
    pooled: list[float] | None = None

    @property
    def sampled(self) -> bool:
        return bool(self.new_tokens) or self.error is not None

    @property
    def news(self) -> bool:
        """Something to report: tokens, an error, or a finish (a prompt scored with max_tokens 0)."""
        return self.sampled or self.seq.finished


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int | None = None,
        eos_ids: frozenset[int] = frozenset(),
        long_prefill_token_threshold: int = 0,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        self.blocks = block_manager
        self.max_model_len = max_model_len
        self.eos_ids = eos_ids
        # vLLM's long_prefill_token_threshold: a prefill chunk is at most this long (0: only the
        # budget limits it), so the decodes batched with it wait for one chunk, not a whole prompt.
        self.prefill_chunk = long_prefill_token_threshold
        self.num_prompt_tokens = 0  # prompt tokens computed (recomputed ones count again)
        self.num_generated_tokens = 0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.blocks.free_sequence(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        batch.preempted.append(seq)
        batch.items = [(s, n) for s, n in batch.items if s is not seq]

    def _fit_running(self, seq: Sequence, want: int, batch: ScheduledBatch) -> bool:
        """Make room for `want` more tokens of a running sequence, preempting the newest others."""
        while not self.blocks.can_grow(seq, want):
            victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is seq:
                return False
        self.blocks.grow(seq, want)
        return True

    def schedule(self) -> ScheduledBatch:
        batch = self._fill()
        # Sampled positions, fixed now (num_computed moves on in update_from_output): one for
        # every item that reaches the end of its sequence (none for a prompt scored with max_tokens 0).
        batch.num_sampled = [
            int(s.num_computed + n == s.num_tokens and s.params.max_tokens != 0) for s, n in batch.items
        ]
        return batch

    def _fill(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        decodes = [s for s in self.running if s.num_tokens - s.num_computed == 1]
        prefills = [s for s in self.running if s.num_tokens - s.num_computed > 1]
        for seq in decodes + prefills:
            budget = self.max_num_batched_tokens - batch.num_tokens
            if budget == 0:
                break
            if seq.status != Status.RUNNING:  # preempted while making room for another
                continue
            want = self._chunk(seq.num_tokens - seq.num_computed, budget)
            if self._fit_running(seq, want, batch):
                batch.items.append((seq, want))
        budget = self.max_num_batched_tokens - batch.num_tokens
        if batch.preempted:
            return batch  # memory is short: admit nothing new this step
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.blocks.allocate_for_admission(seq, self._chunk(seq.num_tokens, budget)):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            if seq.first_scheduled is None:  # a preempted sequence keeps its first admission's time
                seq.first_scheduled = time.monotonic()
            self.running.append(seq)
            want = self._chunk(seq.num_tokens - seq.num_computed, budget)
            batch.items.append((seq, want))
            budget -= want
        return batch

    def _chunk(self, remaining: int, budget: int) -> int:
        """How many of a sequence's remaining tokens run this step."""
        want = min(remaining, budget)
        return min(want, self.prefill_chunk) if self.prefill_chunk > 0 else want

    def update_from_output(self, batch: ScheduledBatch, out: StepOutput) -> list[SequenceUpdate]:
        """Advance every scheduled sequence by what the step computed; one update per item, in
        batch order. A draw that raised ends its sequence (reason "abort") with the error."""
        updates = []
        for i, (seq, n) in enumerate(batch.items):
            update = SequenceUpdate(
                seq, prompt_logprobs=out.prompt_logprobs.get(i), error=out.errors.get(i), pooled=out.pooled.get(i)
            )
            self.num_prompt_tokens += max(0, min(n, len(seq.prompt_ids) - seq.num_computed))
            seq.num_computed += n
            self.blocks.register_full_blocks(seq)
            for drawn in out.sampled.get(i, []):
                if update.error is not None or seq.finished:
                    break
                if isinstance(drawn, Exception):
                    update.error = drawn
                    break
                update.new_tokens.append(drawn)
                try:
                    self._append(seq, drawn.token)
                except Exception as exc:  # a grammar that rejects the token: this sequence's fault alone
                    update.error = exc
                    break
            if update.error is not None and not seq.finished:
                self.finish(seq, "abort")
            elif seq.params.max_tokens == 0 and not seq.in_prefill and not seq.finished:
                self.finish(seq, "length")  # the prompt is scored; nothing is generated
            updates.append(update)
        return updates

    def _append(self, seq: Sequence, token: int) -> None:
        """One new token; finish the sequence on EOS, a stop token id, a completed grammar, max_tokens
        or max_model_len."""
        p = seq.params
        seq.output_ids.append(token)
        self.num_generated_tokens += 1
        count = len(seq.output_ids)
        reason, stop = None, None
        ends = token in self.eos_ids and not p.ignore_eos and count >= p.min_tokens
        if seq.grammar is not None and not ends:
            seq.grammar.observe(token)  # raises GrammarRejected: the sequence fails alone
        if ends:
            reason = "stop"
        elif token in p.stop_token_ids and count >= p.min_tokens:
            reason, stop = "stop", token
        elif seq.grammar is not None and seq.grammar.terminated:
            reason = "stop"  # the constrained output is complete (it may also have hit max_tokens)
        elif (p.max_tokens is not None and count >= p.max_tokens) or (
            self.max_model_len is not None and seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if reason is not None:
            seq.stop_reason = stop
            seq.ended_by_token = ends or stop is not None
            self.finish(seq, reason)

    def finish_by_stop_string(self, seq: Sequence, stop: str) -> None:
        """The output processor found a stop string in the sequence's text: it ends now (its
        finish reason becomes "stop" even if the same token also reached a length limit)."""
        if seq.finished and seq.finish_reason == "stop":
            return
        seq.finish_reason, seq.stop_reason = "stop", stop
        if not seq.finished:
            self.finish(seq, "stop")

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence (finished or aborted) and free its blocks."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        elif seq.status == Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_sequence(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = seq.finish_reason or reason
