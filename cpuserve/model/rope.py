"""Rotary position embeddings (HF "rotate half" layout) with default, linear, llama3 and longrope scaling."""

from __future__ import annotations

import math

import torch

from cpuserve.model.config import RopeSpec


def inverse_frequencies(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """Per-pair rotation frequencies in fp32, scaled as the rope type prescribes (longrope: the
    short factors; `Rotary` holds the long ones too)."""
    if rope.type == "longrope":
        return _longrope_frequencies(rope, rope.short_factor, head_dim)
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


def _longrope_frequencies(rope: RopeSpec, factors: tuple[float, ...], head_dim: int) -> torch.Tensor:
    """theta ** (-2i / d) / factors[i], computed in fp32 in transformers' order of operations, so
    that the tables agree bit for bit at long positions too."""
    ext = torch.tensor(factors, dtype=torch.float32)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (ext * rope.theta**exponents)


def cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [*positions.shape, head_dim] for the given positions; inv_freq is
    [head_dim / 2], or one row per position ([*positions.shape, head_dim / 2]). `scale` multiplies
    both in fp32 before the cast (longrope's attention factor)."""
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


class Rotary:
    """A layer's rope: the cos/sin tables of any positions.

    longrope (Phi-3) has two frequency sets. transformers picks one for a whole forward call: the
    long factors when the call's last position + 1 exceeds original_max_position_embeddings, else
    the short ones; its Phi-3 `generate` drops the KV cache when a sequence first grows past that
    length and recomputes every position with the long factors. Here the choice is per position:
    p < original gets the short factors, p >= original the long ones, so a token's K/V never depend
    on how the sequence was cut into prefill chunks or shared through the prefix cache, and nothing
    is recomputed. That equals transformers exactly for every sequence within
    original_max_position_embeddings (one pass, chunks or generation), and equals transformers'
    forward calls that decode one token at a time past it on a cache filled within it. It differs
    from transformers wherever transformers rotates positions before the original length with the
    long factors: one pass over a longer sequence, and `generate` once the sequence outgrows the
    original length (there the first `original` positions keep the short factors here). cos and sin
    are multiplied by the attention factor at every position, as in transformers."""

    def __init__(self, rope: RopeSpec, head_dim: int) -> None:
        self.inv_freq = inverse_frequencies(rope, head_dim)
        self.scale = rope.attention_factor if rope.type == "longrope" else 1.0
        self.long_from: int | None = None
        self.long_inv_freq: torch.Tensor | None = None
        if rope.type == "longrope":
            self.long_from = rope.original_max_position_embeddings
            self.long_inv_freq = _longrope_frequencies(rope, rope.long_factor, head_dim)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables [*positions.shape, head_dim] in dtype."""
        inv = self.inv_freq
        if self.long_inv_freq is not None and self.long_from is not None:
            long = positions >= self.long_from
            if bool(long.any()):
                inv = torch.where(long.unsqueeze(-1), self.long_inv_freq, self.inv_freq)
        return cos_sin(inv, positions, dtype, self.scale)
