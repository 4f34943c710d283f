"""KV cache blocks: allocation, reference counts, and automatic prefix caching.

Plain bookkeeping, no tensors. A full block is identified by a hash chained over every token
before it, so equal hashes mean equal prefixes; freed blocks keep their contents (and hash) until
reused, least recently freed first, which makes the free list the LRU eviction order.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from cpuserve.engine.sequence import Sequence


def block_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """SHA-256 over the parent block's hash and this block's tokens: a collision would silently
    serve another prompt's K/V, so no 64-bit hash."""
    return hashlib.sha256((parent or b"") + array("q", tokens).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # Hashes of the full blocks a sequence has registered, in order (kept for chaining).
        self._seq_hashes: dict[int, list[bytes]] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        old = self.hash_of[block]
        if old is not None:  # evict its cached contents
            if self.cached.get(old) == block:
                del self.cached[old]
            self.hash_of[block] = None
        self.ref_count[block] = 1
        return block

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks for the sequence's leading full blocks; the last token is always computed.
        None for a sequence that asks for prompt logprobs: they need every position computed."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None or seq.params.pooling is not None:
            return []
        tokens = seq.token_ids
        hits, parent = [], None
        for i in range((len(tokens) - 1) // self.block_size):
            h = block_hash(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
            parent = h
        return hits

    def allocate_for_admission(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give a waiting sequence its prefix-cache hits plus blocks for num_new_tokens more tokens
        (clamped to what is left after the hits). Returns False (and changes nothing) if it cannot."""
        hits = self._prefix_hits(seq)
        cached_tokens = len(hits) * self.block_size
        num_new_tokens = min(num_new_tokens, seq.num_tokens - cached_tokens)
        needed = self.blocks_needed(cached_tokens + num_new_tokens) - len(hits)
        reusable_free = sum(1 for b in hits if self.ref_count[b] == 0)
        if self.num_free - reusable_free < needed:
            return False
        for b in hits:
            if self.ref_count[b] == 0:
                del self.free[b]
            self.ref_count[b] += 1
        seq.block_table = hits + [self._take_free() for _ in range(needed)]
        seq.num_computed = cached_tokens
        seq.num_cached_tokens = cached_tokens
        self._seq_hashes[seq.seq_id] = [self.hash_of[b] for b in hits]  # type: ignore[misc]
        if self.enable_prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += cached_tokens
        return True

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq.num_computed + num_new_tokens) - len(seq.block_table) <= self.num_free

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Blocks for num_new_tokens more tokens of a running sequence (caller checked can_grow)."""
        for _ in range(self.blocks_needed(seq.num_computed + num_new_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take_free())

    def register_full_blocks(self, seq: Sequence) -> None:
        """After a step: make the sequence's newly completed blocks findable by later requests."""
        if not self.enable_prefix_caching:
            return
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        full = min(seq.num_computed // self.block_size, len(seq.block_table))
        tokens = seq.token_ids
        while len(hashes) < full:
            i = len(hashes)
            h = block_hash(hashes[-1] if hashes else None, tokens[i * self.block_size : (i + 1) * self.block_size])
            hashes.append(h)
            block = seq.block_table[i]
            if self.hash_of[block] is None and h not in self.cached:
                self.hash_of[block] = h
                self.cached[h] = block

    def free_sequence(self, seq: Sequence) -> None:
        # Tail first, so a sequence's leading (most shareable) blocks are evicted last.
        for block in reversed(seq.block_table):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free[block] = None
        seq.block_table = []
        self._seq_hashes.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> None:
        for block in range(self.num_blocks):
            if self.ref_count[block] == 0 and self.hash_of[block] is not None:
                self.hash_of[block] = None
        self.cached = {h: b for h, b in self.cached.items() if self.hash_of[b] == h}
