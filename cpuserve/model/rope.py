"""Rotary position embeddings (HF "rotate half" layout) with default, linear and llama3 scaling."""

from __future__ import annotations

import math

import torch

from cpuserve.model.config import RopeSpec


def inverse_frequencies(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """Per-pair rotation frequencies in fp32, scaled as the rope type prescribes."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.type == "linear":
        inv = inv / rope.factor
    elif rope.type == "llama3":
        old_ctx = rope.original_max_position_embeddings
        low_wavelen = old_ctx / rope.low_freq_factor
        high_wavelen = old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - smooth) * inv / rope.factor + smooth * inv
        inv = torch.where(wavelen > low_wavelen, inv / rope.factor, torch.where(wavelen < high_wavelen, inv, blended))
    return inv.to(torch.float32)


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [*positions.shape, head_dim] for the given positions."""
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)
