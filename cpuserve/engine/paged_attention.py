"""Attention over the paged KV cache for a flat batch mixing prefill chunks and decodes.

K/V live in per-layer slot arrays [num_blocks * block_size, Hkv, D]; a sequence's token at
position p is in slot block_table[p // block_size] * block_size + p % block_size. Decodes are
batched into one grouped attention call (ops.decode_attention_paged: natively, each sequence reads
its own slots straight from the cache; in the torch reference, gathered, padded to the longest
context and masked; each KV head read once for the query heads that share it); each prefill chunk is
one call (ops.prefill_attention_paged: natively, flash-style query and key blocks reading the chunk's
context slots in place; in the torch reference, gathered for SDPA with a causal mask offset by what is
already cached). An int8 cache (engine/kv_int8.py) is written quantized and read back as int8 times
each row's scale: natively inside both attentions, dequantized for the reference's SDPA.

A sliding-window layer sees only each query's last `window` positions: its decodes get only those
slots (so the native attention never reads an older key), its prefill chunks only the cached keys
some query of the chunk still sees, with the window in the mask. Every key stays cached (the
full-attention layers and the prefix cache need them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpuserve.engine.kv_int8 import quantize_kv
from cpuserve.model import ops
from cpuserve.model.native_decode import DecodeCache


class PagedKVCache:
    """Per-layer K/V slot arrays in `dtype` (the model's, or a 16-bit one under a float32 model: new
    rows are rounded to it as they are written) or, with int8=True, as int8 rows with one fp32 scale
    per (slot, KV head) (engine/kv_int8.py)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        int8: bool = False,
    ) -> None:
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        stored = torch.int8 if int8 else dtype
        # Uninitialised on purpose: pages are committed only when first written, so a large cache
        # costs memory only as it fills. Nothing reads a slot before it is written (padding below
        # points at written slots).
        self.k = [torch.empty(shape, dtype=stored) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=stored) for _ in range(num_layers)]
        self.k_scale = [torch.empty(shape[:2], dtype=torch.float32) for _ in range(num_layers)] if int8 else None
        self.v_scale = [torch.empty(shape[:2], dtype=torch.float32) for _ in range(num_layers)] if int8 else None
        # [1, S, Hkv, D] views (scales [1, S, Hkv]), as the native decode step addresses caches (batch 0, slot s).
        self.k_by_position = [k.unsqueeze(0) for k in self.k]
        self.v_by_position = [v.unsqueeze(0) for v in self.v]
        self.k_scale_by_position = None if self.k_scale is None else [s.unsqueeze(0) for s in self.k_scale]
        self.v_scale_by_position = None if self.v_scale is None else [s.unsqueeze(0) for s in self.v_scale]
        self.num_blocks = num_blocks
        self.block_size = block_size

    @property
    def int8(self) -> bool:
        return self.k_scale is not None

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """New tokens' K/V [T, Hkv, D] into their slots (quantized for an int8 cache)."""
        if self.k_scale is None or self.v_scale is None:
            self.k[layer][slots] = k.to(self.k[layer].dtype)
            self.v[layer][slots] = v.to(self.v[layer].dtype)
            return
        self.k[layer][slots], self.k_scale[layer][slots] = quantize_kv(k)
        self.v[layer][slots], self.v_scale[layer][slots] = quantize_kv(v)

    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Slot indices of token positions start..end-1 of a sequence."""
        pos = torch.arange(start, end)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size


@dataclass
class PrefillChunk:
    rows: slice  # rows of the flat batch
    context_slots: torch.Tensor  # slots of every cached + new token of the sequence
    num_cached: int  # tokens before this chunk


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    decode_rows: torch.Tensor | None  # [Nd] rows of single-token sequences
    decode_slots: torch.Tensor | None  # [Nd, Lmax] context slots, padded
    decode_lengths: torch.Tensor | None  # [Nd] context lengths (the new token included)
    prefills: list[PrefillChunk]


def window_slots(slots: torch.Tensor, lengths: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's last `window` context slots (of slots [N, L] padded, lengths [N]), left-aligned and
    padded with the row's first kept slot (a written one), and their lengths."""
    kept = lengths.clamp(max=window)
    width = min(slots.shape[1], window)
    first = (lengths - kept).unsqueeze(1)
    cols = first + torch.arange(width).unsqueeze(0)
    cols = torch.where(torch.arange(width).unsqueeze(0) < kept.unsqueeze(1), cols, first)
    return slots.gather(1, cols), kept


class PagedAttention:
    """The decoder's AttentionBackend for one engine step."""

    def __init__(self, cache: PagedKVCache, meta: AttentionMetadata) -> None:
        self.cache, self.meta = cache, meta
        self._windowed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # window -> decode slots, lengths

    def _decode_context(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The decodes' context slots and lengths as a layer with this window sees them (made once per step)."""
        meta = self.meta
        if window is None:
            return meta.decode_slots, meta.decode_lengths
        if window not in self._windowed:
            self._windowed[window] = window_slots(meta.decode_slots, meta.decode_lengths, window)
        return self._windowed[window]

    def decode_cache(self) -> DecodeCache | None:
        """For the native decode step, when every sequence of the step decodes one token."""
        meta = self.meta
        if meta.prefills or meta.decode_rows is None:
            return None
        cache = self.cache
        return DecodeCache(
            k=cache.k_by_position,
            v=cache.v_by_position,
            write_batch=torch.zeros_like(meta.slot_mapping),
            write_pos=meta.slot_mapping,
            lengths=meta.decode_lengths,
            slots=meta.decode_slots,
            k_scale=cache.k_scale_by_position,
            v_scale=cache.v_scale_by_position,
            window=lambda size: (*self._decode_context(size), 0),
        )

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        meta, cache = self.meta, self.cache
        cache.write(layer, meta.slot_mapping, k, v)
        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            slots, lengths = self._decode_context(window)
            int8 = cache.k_scale is not None and cache.v_scale is not None
            scales = (cache.k_scale[layer], cache.v_scale[layer]) if int8 else (None, None)
            out[meta.decode_rows] = ops.decode_attention_paged(
                q[meta.decode_rows], cache.k[layer], cache.v[layer], slots, lengths, scale, *scales
            )
        for chunk in meta.prefills:
            # The first cached position the chunk's first query still sees (a window hides older ones).
            first = 0 if window is None else max(0, chunk.num_cached - window + 1)
            scales = (cache.k_scale[layer], cache.v_scale[layer]) if cache.int8 else (None, None)  # type: ignore[index]
            out[chunk.rows] = ops.prefill_attention_paged(
                q[chunk.rows], cache.k[layer], cache.v[layer], chunk.context_slots[first:], window, scale, *scales
            )
        return out
