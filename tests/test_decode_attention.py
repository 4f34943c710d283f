"""The grouped decode attention against torch's scaled_dot_product_attention (the independent
reference), with GQA, MHA, padding masks and bf16 inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpuserve.model.decode_attention import decode_attention


@pytest.mark.parametrize("hq,hkv", [(9, 3), (16, 2), (4, 4)])
@pytest.mark.parametrize("dtype,budget", [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)])
def test_decode_attention_equals_sdpa(hq, hkv, dtype, budget):
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    n, length, d = 3, 37, 64
    q = torch.randn(n, hq, d, generator=gen).to(dtype)
    k = (torch.randn(n, hkv, length, d, generator=gen) * 2).to(dtype)
    v = torch.randn(n, hkv, length, d, generator=gen).to(dtype)
    lengths = [37, 20, 1]
    valid = torch.arange(length).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    got = decode_attention(q, k, v, valid)
    assert got.dtype == dtype and got.shape == (n, hq, d)
    for i, used in enumerate(lengths):  # each sequence alone over its real context, in fp32
        want = F.scaled_dot_product_attention(
            q[i : i + 1, :, None].float(),
            k[i : i + 1, :, :used].float(),
            v[i : i + 1, :, :used].float(),
            enable_gqa=hq != hkv,
        )[0, :, 0]
        assert (got[i].float() - want).abs().max() <= budget, i
