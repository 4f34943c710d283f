"""The int8 KV cache's rows (`--kv-cache-dtype int8`, vLLM's `fp8` spelling too): each key or value
row of one token and one KV head is kept as D int8 values and one fp32 scale (its largest magnitude
/ 127). For head dimension 64 that is 68 bytes a row against 128 in bf16 or 256 in fp32, so a cache
of the same memory holds about twice (bf16) or four times (fp32) the tokens. One scale per row
follows each token's own range (keys of a few outlier channels do not flatten every other token's);
the native decode step (decoder_layers.cpp) writes the same bytes with the same fp32 arithmetic.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 [..., D], fp32 scales [...]): round(x / s), s = max |x| / 127 per row (1 for
    a zero row)."""
    xf = x.float()
    top = xf.abs().amax(-1)
    scale = torch.where(top > 0, top / 127, torch.ones_like(top))
    return torch.round(xf / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows as attention reads them: int8 * scale in fp32 (as the native kernels), then `dtype`."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def int8_row_bytes(head_dim: int) -> int:
    """Bytes of one token's key (or value) row of one KV head in the int8 cache."""
    return head_dim + SCALE_BYTES
