"""The sampler against a slow, literal implementation of each rule on random logits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cpuserve.engine.sampler import distribution, logprob_entries, processed_logits, sample
from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.engine.sequence import Sequence

V = 50


def seq_with(params: SamplingParams, prompt=(1, 2, 3), output=(4, 4, 5), seed=0) -> Sequence:
    gen = torch.Generator().manual_seed(seed)
    return Sequence(0, "r", 0, list(prompt), params, gen, output_ids=list(output))


def slow_processed(logits, prompt, output, p: SamplingParams, stop_ids):
    x = [float(v) for v in logits]
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * list(output).count(t) + p.presence_penalty
    for t, b in p.logit_bias.items():
        x[t] += b
    if len(output) < p.min_tokens:
        for t in stop_ids:
            x[t] = -math.inf
    return np.array(x)


def slow_distribution(x, p: SamplingParams):
    x = np.array(x, dtype=np.float64) / p.temperature
    order = np.argsort(-x, kind="stable")
    keep = np.ones(V, dtype=bool)
    if 0 < p.top_k < V:
        keep &= x >= x[order[p.top_k - 1]]
    e = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    probs = e / e.sum()
    if p.top_p < 1.0:
        mass = 0.0
        kept = np.zeros(V, dtype=bool)
        for t in np.argsort(-probs, kind="stable"):
            if mass >= p.top_p:
                break
            kept[t] = True
            mass += probs[t]
        probs = np.where(kept, probs, 0.0)
    if p.min_p > 0:
        probs = np.where(probs < p.min_p * probs.max(), 0.0, probs)
    return probs / probs.sum()


CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=0.9, min_p=0.2),
    SamplingParams(
        temperature=1.0,
        top_k=10,
        top_p=0.8,
        min_p=0.05,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.4,
        logit_bias={7: 3.0, 9: -5.0},
    ),
    SamplingParams(temperature=1.0, repetition_penalty=0.8, min_tokens=5, stop_token_ids=[11]),
]


@pytest.mark.parametrize("params", CASES)
def test_distribution_matches_slow_reference(params):
    gen = torch.Generator().manual_seed(5)
    for _ in range(5):
        logits = torch.randn(V, generator=gen) * 3
        seq = seq_with(params)
        stop_ids = {2, *params.stop_token_ids}
        x = processed_logits(logits, seq, stop_ids)
        expected_x = slow_processed(logits, seq.prompt_ids, seq.output_ids, params, stop_ids)
        np.testing.assert_allclose(x.numpy(), expected_x, rtol=1e-5, atol=1e-5)
        probs = distribution(x, params)
        np.testing.assert_allclose(probs.numpy() / probs.sum().item(), slow_distribution(expected_x, params), atol=1e-6)


def test_greedy_takes_the_argmax_of_processed_logits():
    logits = torch.zeros(V)
    logits[3], logits[8] = 5.0, 4.0
    seq = seq_with(SamplingParams(temperature=0.0, logit_bias={8: 2.0}))
    assert sample(logits.unsqueeze(0), [seq], set())[0][0] == 8


def test_seeded_draws_repeat_and_follow_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0] + [-30.0] * (V - 4))
    params = SamplingParams(temperature=1.0)
    a = [sample(logits.unsqueeze(0), [s], set())[0][0] for s in [seq_with(params, seed=3)] for _ in range(50)]
    s2 = seq_with(params, seed=3)
    b = [sample(logits.unsqueeze(0), [s2], set())[0][0] for _ in range(50)]
    assert a == b
    s3 = seq_with(params, seed=4)
    draws = [sample(logits.unsqueeze(0), [s3], set())[0][0] for _ in range(4000)]
    freq = np.bincount(draws, minlength=4)[:4] / 4000
    expected = torch.softmax(logits, -1)[:4].numpy()
    assert np.abs(freq - expected).max() < 0.03


def test_logprobs_rank_and_top():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5])
    lp = torch.log_softmax(logits, -1)
    info = logprob_entries(logits.unsqueeze(0), [2], [2])[0]
    assert info.rank == 2 and info.logprob == pytest.approx(float(lp[2]))
    assert list(info.top) == [1, 2] and info.top[1] == pytest.approx(float(lp[1]))


def test_a_batch_draws_each_row_as_it_would_alone():
    """Plain greedy rows are drawn in one argmax over the batch; rows with a bias, a penalty, a
    mask, a grammar error or a temperature beside them each keep their own rule: every row's token
    equals the slow rule's on that row alone."""
    torch.manual_seed(5)
    logits = torch.randn(6, V)
    logits[1, 7] = logits[1].max()  # a tie: the lower id wins, as argmax on the row alone
    greedy = SamplingParams(temperature=0.0)
    biased = SamplingParams(temperature=0.0, logit_bias={3: 100.0})
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    seqs = [seq_with(greedy), seq_with(greedy), seq_with(biased), seq_with(penalised), seq_with(greedy, seed=1)]
    seqs.append(seq_with(SamplingParams(temperature=0.8), seed=2))
    mask = torch.zeros(V, dtype=torch.bool)
    mask[int(logits[4].argmax())] = True  # the row's own best token forbidden by its grammar
    masks = [None, None, None, None, mask, ValueError("grammar fault")]
    drawn = sample(logits, seqs, set(), masks)
    assert drawn[0][0] == int(np.argmax(logits[0].numpy()))
    assert drawn[1][0] == int(np.argmax(logits[1].numpy()))
    assert drawn[2][0] == 3
    expected = slow_processed(logits[3], (1, 2, 3), (4, 4, 5), penalised, set())
    assert drawn[3][0] == int(np.argmax(expected))
    assert drawn[4][0] == int(np.argmax(np.where(mask.numpy(), -np.inf, logits[4].numpy())))
    assert isinstance(drawn[5], ValueError)
    # the same rows one at a time
    for i in range(5):
        assert sample(logits[i : i + 1], [seqs[i]], set(), [masks[i]])[0][0] == drawn[i][0]
