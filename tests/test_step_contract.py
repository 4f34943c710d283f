"""The engine step contract: schedule() -> execute_model() -> update_from_output().

The scheduler's tests drive update_from_output with made-up StepOutputs (no model) and assert exact
block tables, free-list (eviction) orders and finish decisions, so any change of policy fails here.
The runner's tests use the real SmolLM2: several tokens of one sequence in one step, and a per-row
logits mask."""

from __future__ import annotations

import itertools

import pytest
import torch

from cpuserve.engine.block_manager import BlockManager
from cpuserve.engine.model_runner import ModelRunner
from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.engine.scheduler import Sampled, ScheduledBatch, Scheduler, StepOutput
from cpuserve.engine.sequence import Sequence, Status

_ids = itertools.count()
EOS = 2


def make_seq(prompt: list[int], **params) -> Sequence:  # type: ignore[no-untyped-def]
    sid = next(_ids)
    return Sequence(sid, f"r{sid}", 0, list(prompt), SamplingParams(**params), torch.Generator())


def step(sched: Scheduler, tokens: dict[int, list[int]] | None = None, token: int = 7):
    """schedule(), then update_from_output() as if every sampling item drew `token` (or, for the
    sequence with that seq_id, the tokens given)."""
    batch = sched.schedule()
    out = StepOutput()
    for i, ((seq, _), k) in enumerate(zip(batch.items, batch.num_sampled, strict=True)):
        if k:
            out.sampled[i] = [Sampled(t) for t in (tokens or {}).get(seq.seq_id, [token])]
    return batch, sched.update_from_output(batch, out)


def test_block_tables_and_the_free_list_order_are_exact():
    blocks = BlockManager(8, 4)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    a = make_seq(list(range(9)), max_tokens=100)  # two full blocks and one token
    sched.add(a)
    batch, _ = step(sched)
    assert batch.items == [(a, 9)] and batch.num_sampled == [1]
    assert a.block_table == [0, 1, 2] and list(blocks.free) == [3, 4, 5, 6, 7]
    assert a.num_computed == 9 and a.output_ids == [7]
    b = make_seq(list(range(100, 104)), max_tokens=100)  # exactly one block
    sched.add(b)
    batch, _ = step(sched)
    # a decodes first (its 10th token fits block 2), then b is admitted into the next free block.
    assert batch.items == [(a, 1), (b, 4)] and b.block_table == [3] and list(blocks.free) == [4, 5, 6, 7]
    step(sched)  # b's 5th token needs a second block
    assert b.block_table == [3, 4] and list(blocks.free) == [5, 6, 7]
    sched.finish(a, "stop")
    # A sequence's blocks return tail first: its leading (most shareable) blocks are evicted last.
    assert list(blocks.free) == [5, 6, 7, 2, 1, 0]
    sched.finish(b, "stop")
    assert list(blocks.free) == [5, 6, 7, 2, 1, 0, 4, 3]


def test_prefix_hits_reuse_exact_blocks_and_eviction_is_least_recently_freed_first():
    blocks = BlockManager(6, 4)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    a = make_seq(list(range(9)), max_tokens=1)  # blocks 0, 1 full (hashed), 2 partial
    sched.add(a)
    step(sched)
    assert a.finished and a.finish_reason == "length"
    assert list(blocks.free) == [3, 4, 5, 2, 1, 0]
    hit = make_seq([*range(8), 50], max_tokens=5)  # shares a's two full blocks
    sched.add(hit)
    batch, _ = step(sched)
    assert hit.block_table == [0, 1, 3] and hit.num_cached_tokens == 8 and batch.items == [(hit, 1)]
    assert list(blocks.free) == [4, 5, 2]
    sched.finish(hit, "stop")
    assert list(blocks.free) == [4, 5, 2, 3, 1, 0]
    # A 17-token prompt needs 5 blocks: taken from the head of the free list, which evicts block 1's
    # cached prefix (a's second block); block 0, freed last, stays cached.
    big = make_seq(list(range(200, 217)), max_tokens=1)
    sched.add(big)
    step(sched)
    assert big.block_table == [] and big.finish_reason == "length"
    assert list(blocks.free) == [0, 1, 3, 2, 5, 4]
    again = make_seq([*range(8), 60], max_tokens=5)
    sched.add(again)
    step(sched)
    assert again.num_cached_tokens == 4 and again.block_table == [0, 1, 3]


def test_update_from_output_decides_eos_stop_tokens_and_lengths():
    sched = Scheduler(BlockManager(32, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=12, eos_ids={EOS})
    eos = make_seq([1, 1, 1], max_tokens=10)
    ignore = make_seq([1, 1, 1], max_tokens=2, ignore_eos=True)
    early = make_seq([1, 1, 1], max_tokens=10, min_tokens=2)
    stop_tok = make_seq([1, 1, 1], max_tokens=10, stop_token_ids=[9])
    limit = make_seq(list(range(10)), max_tokens=None)  # max_model_len 12: two tokens of room
    for s in (eos, ignore, early, stop_tok, limit):
        sched.add(s)
    step(sched, token=EOS, tokens={stop_tok.seq_id: [9], limit.seq_id: [5]})
    assert (eos.finish_reason, eos.stop_reason, eos.output_ids) == ("stop", None, [EOS])
    assert ignore.status == Status.RUNNING and early.status == Status.RUNNING  # ignore_eos; min_tokens
    assert (stop_tok.finish_reason, stop_tok.stop_reason) == ("stop", 9)
    assert limit.status == Status.RUNNING
    step(sched, token=EOS, tokens={limit.seq_id: [5]})
    assert (ignore.finish_reason, ignore.output_ids) == ("length", [EOS, EOS])
    assert (early.finish_reason, early.output_ids) == ("stop", [EOS, EOS])
    assert (limit.finish_reason, limit.num_tokens) == ("length", 12)
    assert not sched.running and sched.blocks.num_free == 32


def test_several_tokens_in_one_step_stop_at_the_first_finish():
    sched = Scheduler(BlockManager(32, 4), max_num_seqs=8, max_num_batched_tokens=64, eos_ids={EOS})
    seq = make_seq([1, 2, 3], max_tokens=10)
    sched.add(seq)
    batch = sched.schedule()
    (update,) = sched.update_from_output(batch, StepOutput(sampled={0: [Sampled(5), Sampled(EOS), Sampled(6)]}))
    assert seq.output_ids == [5, EOS] and seq.finish_reason == "stop"
    assert [s.token for s in update.new_tokens] == [5, EOS]


def test_a_draw_that_raised_ends_its_sequence_alone():
    sched = Scheduler(BlockManager(32, 4), max_num_seqs=8, max_num_batched_tokens=64)
    good, bad = make_seq([1, 2, 3]), make_seq([4, 5, 6])
    sched.add(good)
    sched.add(bad)
    batch = sched.schedule()
    boom = ValueError("boom")
    updates = sched.update_from_output(batch, StepOutput(sampled={0: [Sampled(7)], 1: [boom]}))
    assert updates[1].error is boom and bad.finish_reason == "abort" and bad.block_table == []
    assert good.output_ids == [7] and good.status == Status.RUNNING


def test_a_stop_string_finish_overrides_a_length_finish_of_the_same_token():
    sched = Scheduler(BlockManager(32, 4), max_num_seqs=8, max_num_batched_tokens=64)
    seq = make_seq([1, 2, 3], max_tokens=1)
    sched.add(seq)
    step(sched)
    assert seq.finish_reason == "length"
    sched.finish_by_stop_string(seq, "xy")
    assert (seq.finish_reason, seq.stop_reason) == ("stop", "xy")


@pytest.mark.slow
def test_the_runner_samples_several_positions_of_one_sequence(our_smol):
    """Three positions of one sequence sampled in one step give the logits of the contiguous
    reference at those positions (what verifying draft tokens needs)."""
    prompt = [1, 504, 3575, 282, 4649, 314, 253, 1345, 30, 378, 2512, 314]
    runner = ModelRunner(our_smol, 8, 16)
    seq = make_seq(prompt)
    seq.block_table = [0]
    logits = runner.execute(ScheduledBatch(items=[(seq, len(prompt))], num_sampled=[3])).sample_logits
    with torch.inference_mode():
        reference = our_smol(torch.tensor([prompt]))[0, -3:].float()
    assert logits.shape == (3, our_smol.spec.vocab_size)
    torch.testing.assert_close(logits, reference, atol=2e-3, rtol=0)
    assert runner.execute(ScheduledBatch(items=[(seq, len(prompt))], num_sampled=[1])).sample_logits.shape[0] == 1


@pytest.mark.slow
def test_a_row_mask_limits_the_draw_and_leaves_other_rows_alone(our_smol):
    runner = ModelRunner(our_smol, 8, 16)
    prompt = [1, 504, 3575]
    allowed = [4096, 30000, 17]
    mask = torch.zeros(our_smol.spec.vocab_size, dtype=torch.bool)
    mask[allowed] = True
    sampled, greedy, free = (make_seq(prompt, temperature=t) for t in (1.0, 0.0, 0.0))
    sampled.allowed = greedy.allowed = mask
    sampled.block_table, greedy.block_table, free.block_table = [0], [1], [2]
    batch = ScheduledBatch(items=[(sampled, 3), (greedy, 3), (free, 3)], num_sampled=[1, 1, 1])
    logits = runner.execute(ScheduledBatch(items=[(free, 3)], num_sampled=[1])).sample_logits[0]
    best_allowed = max(allowed, key=lambda t: float(logits[t]))
    assert int(logits.argmax()) not in allowed  # the mask has to change this row's answer
    for _ in range(10):
        out = runner.execute_model(batch)
        assert out.sampled[0][0].token in allowed
        assert out.sampled[1][0].token == best_allowed
        assert out.sampled[2][0].token == int(logits.argmax())


def test_long_prefill_token_threshold_caps_every_prefill_chunk():
    """vLLM's --long-prefill-token-threshold: running streams wait for one chunk, not a prompt."""
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=512, long_prefill_token_threshold=16)
    stream = make_seq([1, 2, 3], max_tokens=100)
    sched.add(stream)
    step(sched)
    long = make_seq(list(range(100, 150)), max_tokens=1)  # 50 prompt tokens
    sched.add(long)
    chunks = []
    while not long.finished:
        batch, _ = step(sched)
        assert (stream, 1) in batch.items  # the stream decodes every step
        chunks += [n for s, n in batch.items if s is long]
    assert chunks == [16, 16, 16, 2]
    unlimited = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=512)
    other = make_seq(list(range(100, 150)), max_tokens=1)
    unlimited.add(other)
    assert step(unlimited)[0].items == [(other, 50)]
