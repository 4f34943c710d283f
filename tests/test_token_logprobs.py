"""The sampler's native logprobs pass against its pure-torch twin: ranks and top-k ids exact; values,
like the twin's, within 3e-5 of float64 log_softmax."""

from __future__ import annotations

import pytest
import torch

from cpuserve.model import ops

BUDGET = 3e-5  # 16 float32 ULPs of |lp| < 32: torch's own log_softmax was seen 1.5e-5 off


def _error(got: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest difference; a masked token (-inf) must be -inf in both."""
    assert torch.equal(torch.isinf(got), torch.isinf(exact))
    finite = ~torch.isinf(exact)
    return float((got.double()[finite] - exact[finite]).abs().max()) if finite.any() else 0.0


def _native():
    module = ops._use_native(torch.empty(1))
    if module is None:
        pytest.skip("native kernels not available")
    return module


@pytest.mark.parametrize(("rows", "vocab", "k"), [(1, 49152, 20), (5, 1000, 0), (3, 257, 257), (8, 130560, 5)])
def test_native_logprobs_match_the_reference(rows, vocab, k):
    native = _native()
    g = torch.Generator().manual_seed(rows * vocab + k)
    logits = torch.randn(rows, vocab, generator=g) * 4
    logits[0, :50] = 3.25  # ties: lower ids first, as the reference's stable sort
    logits[-1, 7] = float("-inf")  # a masked-out token
    chosen = torch.randint(0, vocab, (rows,), generator=g)
    chosen[0] = 10  # a tied token: its rank counts only strictly more likely ones
    got = native.token_logprobs(logits, chosen, k)
    want = ops.token_logprobs_reference(logits, chosen, k)
    assert torch.equal(got[1], want[1])  # ranks
    assert torch.equal(got[2], want[2])  # top-k ids, in order
    exact = torch.log_softmax(logits.double(), dim=-1)  # the values both are held to
    assert _error(got[0], exact.gather(1, chosen.unsqueeze(1)).squeeze(1)) <= BUDGET
    assert _error(got[3], exact.gather(1, got[2])) <= BUDGET
    assert _error(want[0], exact.gather(1, chosen.unsqueeze(1)).squeeze(1)) <= BUDGET
    assert int(got[1][0]) == int((logits[0] > 3.25).sum()) + 1


def test_bad_arguments_are_refused():
    native = _native()
    with pytest.raises(RuntimeError, match="out of range"):
        native.token_logprobs(torch.zeros(1, 10), torch.tensor([10]), 3)
    with pytest.raises(RuntimeError, match="float32"):
        native.token_logprobs(torch.zeros(1, 10, dtype=torch.bfloat16), torch.tensor([1]), 3)
