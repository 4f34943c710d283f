"""Continuous batching: which sequences run this step, and how many tokens of each.

Never touches tensors. Each step: running decodes first (one token each, so a long prompt never
stalls a stream), then running chunked prefills, then waiting sequences first-come first-served,
all under the token budget and max_num_seqs. When KV blocks run out, the most recently admitted
sequence is preempted: its blocks are freed and it is recomputed later from its tokens, which
changes nothing in its output.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cpuserve.engine.block_manager import BlockManager
from cpuserve.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """This step's work: (sequence, number of tokens to compute), in batch order."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        self.blocks = block_manager
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
        batch = ScheduledBatch()
        decodes = [s for s in self.running if s.num_tokens - s.num_computed == 1]
        prefills = [s for s in self.running if s.num_tokens - s.num_computed > 1]
        for seq in decodes + prefills:
            budget = self.max_num_batched_tokens - batch.num_tokens
            if budget == 0:
                break
            if seq.status != Status.RUNNING:  # preempted while making room for another
                continue
            want = min(seq.num_tokens - seq.num_computed, budget)
            if self._fit_running(seq, want, batch):
                batch.items.append((seq, want))
        budget = self.max_num_batched_tokens - batch.num_tokens
        if batch.preempted:
            return batch  # memory is short: admit nothing new this step
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.blocks.allocate_for_admission(seq, budget):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            want = min(seq.num_tokens - seq.num_computed, budget)
            batch.items.append((seq, want))
            budget -= want
        return batch

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence (finished or aborted) and free its blocks."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        elif seq.status == Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_sequence(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = seq.finish_reason or reason
