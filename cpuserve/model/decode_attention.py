"""Attention for one new token per sequence (decode), grouped by KV head.

torch's scaled_dot_product_attention with bf16 inputs was measured here (once, docs/benchmarks.md)
at 0.5-2.1 ms per layer for one query over 136-640 cached tokens (its flash kernel is built for long
query blocks); the same product written as two batched matmuls over the query heads that share a KV
head, in fp32, at 0.1-0.2 ms, reading each KV head once. This is the decode path of both the
reference decoder and the paged engine.
"""

from __future__ import annotations

import torch


def decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """q [N, Hq, D] (one token per sequence); keys/values [N, Hkv, L, D] (its context, the new token
    included); valid [N, L] bool, False at padding. Returns [N, Hq, D] in q's dtype; softmax in fp32."""
    n, hq, d = q.shape
    hkv, length = keys.shape[1], keys.shape[2]
    qf = q.float().view(n, hkv, hq // hkv, d)
    scores = torch.matmul(qf, keys.float().transpose(-1, -2)) * (d**-0.5)  # [N, Hkv, G, L]
    if valid is not None:
        scores = scores.masked_fill(~valid.view(n, 1, 1, length), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values.float()).view(n, hq, d).to(q.dtype)
