"""The int8 KV cache's rows (`--kv-cache-dtype int8`, vLLM's `fp8` spelling too): each key or value
row of one token and one KV head is kept as D int8 values and one fp32 scale (its largest magnitude
/ 127). For head dimension 64 that is 68 bytes a row against 128 in bf16 or 256 in fp32, so a cache
of the same memory holds about twice (bf16) or four times (fp32) the tokens. One scale per row
follows each token's own range (keys of a few outlier channels do not flatten every other token's);
the native decode step (decoder_layers.cpp) writes the same bytes with the same fp32 arithmetic.
"""

from __future__ import annotations

import torch

from cpuserve.errors import ConfigError

# What --kv-cache-dtype names the int8 cache by: vLLM's fp8 spellings ask for an 8-bit cache, which
# is this one here (int8 rows with their own scales; no fp8 arithmetic on these CPUs).
INT8_NAMES = ("int8", "fp8", "fp8_e4m3", "fp8_e5m2")
SCALE_BYTES = 4


def is_int8(kv_cache_dtype: str) -> bool:
    """True for the int8 cache, False for "auto" (the model's dtype) or bfloat16; else a ConfigError
    (a cache dtype is never silently replaced)."""
    if kv_cache_dtype in INT8_NAMES:
        return True
    if kv_cache_dtype in ("auto", "bfloat16", "bf16"):
        return False
    raise ConfigError(
        f"--kv-cache-dtype {kv_cache_dtype}: one of auto (the model's dtype), bfloat16, int8 "
        f"(also spelled {', '.join(INT8_NAMES[1:])}: int8 rows with per-row scales)"
    )


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


def row_bytes(head_dim: int, dtype_bytes: int | None) -> int:
    """Bytes of one token's key (or value) row of one KV head; dtype_bytes None: the int8 cache."""
    return head_dim + SCALE_BYTES if dtype_bytes is None else head_dim * dtype_bytes
