"""Native prefill attention (kernels/csrc/prefill_attention.h, prefill_blocks.h) against an
independent float64 reference: new tokens against every key they see, causal, with and without a
sliding window, from the contiguous cache and through shuffled paged slots, fp32/bf16/fp16/int8
caches, on this CPU's variant, AVX2's blocks and the portable loops.

Budgets: fp32 differs from float64 by summation order only (2e-6 on outputs of magnitude ~1). A
bf16 or fp16 result is rounded once to its dtype (half a step: 2^-9 / 2^-12 of its magnitude, with
a factor 2 of margin), and a bf16 cache on a CPU with AVX512_BF16 runs its bf16 pairs, whose
probabilities are rounded to bf16 (2^-9 relative each: at most 2^-9 of the largest |value|)."""

from __future__ import annotations

import pytest
import torch

from cpuserve.model import ops
from tests.attention_paths import ATTENTION_PATHS, select_attention_path

pytestmark = pytest.mark.usefixtures("fresh_variant")


def _reference(q, keys, values, window: int | None, scale: float) -> torch.Tensor:
    """q [B, T, Hq, D], keys/values [B, L, Hkv, D] -> [B, T, Hq, D] in float64, masks built here."""
    _, t, hq, _ = q.shape
    length, hkv = keys.shape[1], keys.shape[2]
    k = keys.double().repeat_interleave(hq // hkv, dim=2)
    v = values.double().repeat_interleave(hq // hkv, dim=2)
    scores = torch.einsum("bthd,blhd->bhtl", q.double(), k) * scale
    query = (length - t + torch.arange(t)).view(t, 1)
    key = torch.arange(length).view(1, length)
    seen = key <= query
    if window is not None:
        seen &= query - key < window
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.einsum("bhtl,blhd->bthd", scores.softmax(-1), v)


def _budget(want: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float32:
        return torch.full_like(want, 2e-6)
    rounding = want.abs() * (2.0**-8 if dtype == torch.bfloat16 else 2.0**-11)
    pairs = values.double().abs().max() * 2.0**-9 if dtype == torch.bfloat16 else 0.0
    return rounding + pairs + 2e-6


CASES = [  # (T new tokens, L keys in all, window)
    (1, 1, None),
    (5, 5, None),
    (70, 70, None),  # key blocks of 64 cut by the diagonal
    (40, 150, None),  # a chunk behind cached keys
    (33, 200, 50),  # a window inside the context
    (100, 100, 16),  # a window shorter than a key block
]


@pytest.mark.parametrize("path", ATTENTION_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (16, 2, 128), (4, 4, 36)])  # 36: not a whole vector
@pytest.mark.parametrize("t,length,window", CASES)
def test_contiguous_prefill_equals_the_float64_reference(
    kernels, monkeypatch, path, dtype, hq, hkv, d, t, length, window
):
    select_attention_path(monkeypatch, path)
    gen = torch.Generator().manual_seed(t * 1000 + length)
    b, capacity = 2, length + 9
    q = torch.randn(b, t, hq, d, generator=gen).to(dtype)
    cache_k = torch.randn(b, hkv, capacity, d, generator=gen).to(dtype)  # the contiguous cache's layout
    cache_v = torch.randn(b, hkv, capacity, d, generator=gen).to(dtype)
    cache_k[:, :, length:], cache_v[:, :, length:] = float("nan"), float("nan")  # past the context: never read
    keys, values = cache_k[:, :, :length].transpose(1, 2), cache_v[:, :, :length].transpose(1, 2)
    got = ops.prefill_attention_contiguous(q, keys, values, window, d**-0.5)
    assert got.dtype == dtype and got.shape == (b, t, hq, d)
    want = _reference(q, keys, values, window, d**-0.5)
    err = (got.double() - want).abs()
    assert (err <= _budget(want, values, dtype)).all(), err.max().item()


@pytest.mark.parametrize("path", ATTENTION_PATHS)
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("t,length,window", [(70, 70, None), (40, 150, None), (33, 200, 50)])
def test_paged_prefill_reads_its_slots_in_place(kernels, monkeypatch, path, int8, t, length, window):
    """The chunk's context through shuffled slots of a paged cache [S, Hkv, D]; every other slot NaN.
    An int8 cache is read as int8 times each row's scale, as the reference dequantizes it."""
    from cpuserve.engine.kv_int8 import dequantize_kv, quantize_kv

    select_attention_path(monkeypatch, path)
    gen = torch.Generator().manual_seed(length)
    hq, hkv, d, capacity = 9, 3, 64, length + 50
    q = torch.randn(t, hq, d, generator=gen)
    k, v = torch.randn(capacity, hkv, d, generator=gen), torch.randn(capacity, hkv, d, generator=gen)
    slots = torch.randperm(capacity, generator=gen)[:length]
    unused = torch.ones(capacity, dtype=torch.bool)
    unused[slots] = False
    scales = (None, None)
    if int8:
        (k, ks), (v, vs) = quantize_kv(k), quantize_kv(v)
        ks[unused], vs[unused] = float("nan"), float("nan")
        scales = (ks, vs)
        keys, values = (
            dequantize_kv(k[slots], ks[slots], torch.float32),
            dequantize_kv(v[slots], vs[slots], torch.float32),
        )
    else:
        k[unused], v[unused] = float("nan"), float("nan")
        keys, values = k[slots], v[slots]
    got = ops.prefill_attention_paged(q, k, v, slots, window, d**-0.5, *scales)
    want = _reference(q[None], keys[None], values[None], window, d**-0.5)[0]
    assert (got.double() - want).abs().max().item() <= 2e-6


def test_the_native_path_is_taken_and_counted(kernels, monkeypatch):
    """A prefill through the ops reaches the variant's prefill_attention (the dispatch counter), and
    with native ops off the same call gives SDPA's result within the fp32 budget."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 50, n, 64, generator=gen) for n in (8, 2, 2))
    kernels.reset_dispatch_counts()
    got = ops.prefill_attention_contiguous(q, k, v)
    counts = kernels.dispatch_counts()
    assert sum(row.get("prefill_attention", 0) for row in counts.values()) == 1, counts
    monkeypatch.setenv("CPUSERVE_NATIVE_OPS", "0")
    assert (got - ops.prefill_attention_contiguous(q, k, v)).abs().max().item() <= 2e-6


def test_bad_prefill_calls_are_refused_with_a_message(kernels):
    variant = ops._variant()
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 10, 2, 8)
    with pytest.raises(RuntimeError, match="needs 1 <= T <= context"):
        kernels.prefill_attention(q, k, k, None, 3, 0, 1.0, variant)
    with pytest.raises(RuntimeError, match="the context exceeds the cache"):
        kernels.prefill_attention(q, k, k, None, 11, 0, 1.0, variant)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.prefill_attention(q, k, k, torch.tensor([0, 1, 2, 10]), 4, 0, 1.0, variant)
    with pytest.raises(RuntimeError, match="head shapes do not fit"):
        kernels.prefill_attention(torch.randn(1, 4, 3, 8), k, k, None, 4, 0, 1.0, variant)


@pytest.mark.parametrize("path", ATTENTION_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_reaches_exactly_the_outputs_that_see_it(kernels, monkeypatch, path, dtype):
    """A NaN query head gives NaN in that head's rows only; a NaN key gives NaN in the rows of its
    KV group's heads that see it (queries from its position on), as the reference gives; every other
    output stays within budget. Never a finite guess."""
    select_attention_path(monkeypatch, path)
    gen = torch.Generator().manual_seed(5)
    t, hq, hkv, d = 70, 9, 3, 64
    q = torch.randn(1, t, hq, d, generator=gen).to(dtype)
    k, v = (torch.randn(1, t, hkv, d, generator=gen).to(dtype) for _ in range(2))
    q[0, 10, 4, 3] = float("nan")
    k[0, 30, 0, 5] = float("nan")  # KV head 0: query heads 0-2
    got = ops.prefill_attention_contiguous(q, k, v, None, d**-0.5).double()
    want = _reference(q, k, v, None, d**-0.5)
    assert torch.equal(got.isnan(), want.isnan())
    assert got[0, 10, 4].isnan().all() and got[0, 30:, :3].isnan().all() and not got[0, :30, :3].isnan().any()
    finite = ~want.isnan()
    assert ((got - want).abs()[finite] <= _budget(want, v, dtype)[finite]).all()
