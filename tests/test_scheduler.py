"""Scheduler and block manager without a model: a fake step computes what was scheduled and
appends a token to every sequence that reached its end."""

from __future__ import annotations

import itertools

import pytest
import torch

from cpuserve.engine.block_manager import BlockManager
from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.engine.scheduler import Scheduler
from cpuserve.engine.sequence import Sequence, Status

_ids = itertools.count()


def make_seq(prompt: list[int], request_id: str | None = None) -> Sequence:
    sid = next(_ids)
    return Sequence(sid, request_id or f"r{sid}", 0, list(prompt), SamplingParams(), torch.Generator())


def fake_step(sched: Scheduler, max_outputs: int | None = None):
    batch = sched.schedule()
    for seq, n in batch.items:
        seq.num_computed += n
        sched.blocks.register_full_blocks(seq)
        if seq.num_computed == seq.num_tokens:
            seq.output_ids.append(7)
            if max_outputs is not None and len(seq.output_ids) >= max_outputs:
                sched.finish(seq, "length")
    return batch


def test_token_budget_and_max_num_seqs_are_respected():
    sched = Scheduler(BlockManager(1000, 4), max_num_seqs=3, max_num_batched_tokens=10)
    seqs = [make_seq(list(range(i, i + 7))) for i in range(5)]
    for s in seqs:
        sched.add(s)
    for _ in range(30):
        batch = fake_step(sched, max_outputs=4)
        assert batch.num_tokens <= 10
        assert len(sched.running) <= 3
        assert len({id(s) for s, _ in batch.items}) == len(batch.items)
    assert all(s.finished and len(s.output_ids) == 4 for s in seqs)  # everyone was served


def test_decodes_are_never_stalled_by_a_long_prompt():
    sched = Scheduler(BlockManager(1000, 4), max_num_seqs=8, max_num_batched_tokens=8)
    streams = [make_seq([1, 2, 3]) for _ in range(3)]
    for s in streams:
        sched.add(s)
    fake_step(sched)  # all three prefilled and sampled
    long = make_seq(list(range(100)))
    sched.add(long)
    for _ in range(10):
        batch = fake_step(sched)
        scheduled = {id(s): n for s, n in batch.items}
        assert all(scheduled.get(id(s)) == 1 for s in streams), "every stream decodes every step"
        assert scheduled.get(id(long), 0) <= 8 - 3  # the prompt gets what is left: chunked
    assert long.num_computed > 0


def test_preemption_frees_blocks_and_resume_recomputes_everything():
    blocks = BlockManager(6, 4, enable_prefix_caching=False)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = make_seq(list(range(8))), make_seq(list(range(100, 108)))
    sched.add(a)
    sched.add(b)
    fake_step(sched)  # 2 blocks each + decode growth
    preempted = []
    for _ in range(12):
        batch = fake_step(sched)
        preempted += batch.preempted
        if preempted:
            break
    assert preempted == [b], "the most recently admitted sequence is preempted"
    assert b.status == Status.WAITING and b.num_computed == 0 and b.block_table == []
    assert sched.waiting[0] is b
    out_before = list(b.output_ids)
    # Finish `a`, then b comes back and recomputes prompt + its outputs so far.
    sched.finish(a, "stop")
    tokens_so_far = b.num_tokens
    batch = fake_step(sched)
    assert batch.items == [(b, tokens_so_far)]  # prompt and earlier outputs, recomputed in one go
    assert b.output_ids[: len(out_before)] == out_before
    assert sched.num_preemptions == 1


def test_prefix_cache_hits_and_lru_eviction():
    blocks = BlockManager(8, 4)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    shared = list(range(12))  # three full blocks
    first = make_seq([*shared, 50, 51])
    sched.add(first)
    fake_step(sched)
    sched.finish(first, "stop")
    assert blocks.num_free == 8
    second = make_seq([*shared, 60])
    sched.add(second)
    batch = fake_step(sched)
    assert second.num_cached_tokens == 12 and batch.items == [(second, 1)]
    sched.finish(second, "stop")
    # Fill the cache with other prompts: the shared blocks get evicted, least recently freed first.
    for base in (200, 300):
        s = make_seq(list(range(base, base + 15)))
        sched.add(s)
        fake_step(sched)
        sched.finish(s, "stop")
    third = make_seq([*shared, 70])
    sched.add(third)
    fake_step(sched)
    assert third.num_cached_tokens < 12
    assert blocks.prefix_hits >= 12 and blocks.prefix_queries > blocks.prefix_hits


def test_a_prompt_never_hits_its_own_last_token():
    blocks = BlockManager(8, 4)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    s1 = make_seq(list(range(8)))
    sched.add(s1)
    fake_step(sched)
    sched.finish(s1, "stop")
    s2 = make_seq(list(range(8)))  # identical prompt, exactly two blocks
    sched.add(s2)
    batch = fake_step(sched)
    assert s2.num_cached_tokens == 4 and batch.items[0][1] == 4  # the last block is recomputed for logits


@pytest.mark.parametrize("finish", ["finish", "abort"])
def test_every_block_is_freed(finish):
    blocks = BlockManager(32, 4)
    sched = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=16)
    seqs = [make_seq(list(range(i * 10, i * 10 + 9))) for i in range(6)]
    for s in seqs:
        sched.add(s)
    for _ in range(5):
        fake_step(sched)
    for s in seqs:
        sched.finish(s, "stop" if finish == "finish" else "abort")
    assert blocks.num_free == 32 and all(c == 0 for c in blocks.ref_count)
    assert not sched.running and not sched.waiting


def test_shared_blocks_are_reference_counted():
    blocks = BlockManager(16, 4)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    a = make_seq(list(range(9)))
    sched.add(a)
    fake_step(sched)
    b = make_seq(list(range(9)))
    sched.add(b)
    fake_step(sched)
    assert b.block_table[:2] == a.block_table[:2]
    assert blocks.ref_count[a.block_table[0]] == 2
    sched.finish(a, "stop")
    assert blocks.ref_count[b.block_table[0]] == 1
    sched.finish(b, "stop")
    assert blocks.num_free == 16
