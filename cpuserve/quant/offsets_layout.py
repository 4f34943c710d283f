"""The order the native driver reads per-group offsets in (w = s * q + offset, GGUF's formats with a
minimum): columns in chunks of 16, each chunk's 16 columns for every group in one contiguous run
([N / 16][G][16]), then the last N % 16 columns group by group ([G][N % 16]).

Why: the offsets pass streams one chunk at a time; group-major [G, N] made it read G rows N floats
apart for every chunk, which cost three times the int4 kernel's time per byte at one token.
linear_driver.cpp's offsets_index is the same map."""

from __future__ import annotations

import torch

CHUNK = 16


def to_chunks(offsets: torch.Tensor) -> torch.Tensor:
    """[N, G] -> the driver's order, one contiguous run of N * G (offsets, their codes or factors)."""
    n, groups = offsets.shape
    full = n // CHUNK * CHUNK
    head = offsets[:full].reshape(n // CHUNK, CHUNK, groups).transpose(1, 2).reshape(-1)
    tail = offsets[full:].t().reshape(-1)
    return torch.cat([head, tail]).contiguous()


def from_chunks(flat: torch.Tensor, n: int, groups: int) -> torch.Tensor:
    """The driver's order -> [N, G]."""
    full = n // CHUNK * CHUNK
    head = flat[: full * groups].reshape(n // CHUNK, groups, CHUNK).transpose(1, 2).reshape(full, groups)
    tail = flat[full * groups :].reshape(groups, n - full).t()
    return torch.cat([head, tail]).contiguous()


def chunk_index(n: int, groups: int, rows: torch.Tensor) -> torch.Tensor:
    """Where the offsets [len(rows), G] of rows are in the driver's order (offsets_index)."""
    full = n // CHUNK * CHUNK
    g = torch.arange(groups).view(1, -1)
    r = rows.view(-1, 1)
    in_chunk = (r // CHUNK) * CHUNK * groups + g * CHUNK + r % CHUNK
    in_tail = full * groups + g * (n - full) + (r - full)
    return torch.where(r < full, in_chunk, in_tail)
