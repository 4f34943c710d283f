"""GGUF's quantized block formats re-expressed exactly as the kernels' integer schemes.

Every llama.cpp block type used by the common files (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
Q6_K) stores, per group of 16 or 32 weights, small integers q, a scale and for some a minimum.
Written as w = s * v + offset with v signed (v = q - 8 for 4 bits, q - 16 for 5, q - 32 for 6),
each is one of the kernels' schemes: 4-bit values are W4A8 in groups of 32, 5-, 6- and 8-bit values
W8A8 in groups (32, or 16 for Q6_K), and the formats with a minimum add a per-group offset (the
driver's `offsets` term). Values and scales are exact (products of an fp16 and a 6-bit integer are
exact in float32); an offset that sums two terms (m + 8 d, 8 d sc - dmin m) is rounded once.

Decoded from the format's description (llama.cpp's ggml-common.h block structs), vectorised with
numpy over all blocks of a tensor; tests/test_gguf_quant.py checks every type against gguf-py's own
dequantizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cpuserve.errors import CheckpointError

QK = 32  # weights per block of the simple types
QK_K = 256  # weights per super-block of the K-quants
DECODE_CHUNK_WEIGHTS = 1 << 22  # weights decoded at a time


@dataclass(frozen=True)
class BlockScheme:
    """What a GGUF type becomes: value bits (4 or 8 in the kernels), group size, with offsets."""

    bits: int
    group: int
    offsets: bool
    block_weights: int
    block_bytes: int


SCHEMES: dict[str, BlockScheme] = {
    "Q4_0": BlockScheme(4, 32, False, QK, 18),
    "Q4_1": BlockScheme(4, 32, True, QK, 20),
    "Q5_0": BlockScheme(8, 32, False, QK, 22),
    "Q5_1": BlockScheme(8, 32, True, QK, 24),
    "Q8_0": BlockScheme(8, 32, False, QK, 34),
    "Q4_K": BlockScheme(4, 32, True, QK_K, 144),
    "Q5_K": BlockScheme(8, 32, True, QK_K, 176),
    "Q6_K": BlockScheme(8, 16, False, QK_K, 210),
}


@dataclass
class DecodedWeight:
    """w[n, k] = scales[n, k // group] * values[n, k] (+ offsets[n, k // group])."""

    values: np.ndarray  # int8 [N, K]
    scales: np.ndarray  # float32 [N, K // group]
    offsets: np.ndarray | None  # float32 [N, K // group]
    scheme: BlockScheme

    def dequantized(self) -> np.ndarray:
        n, k = self.values.shape
        g = self.scheme.group
        w = self.values.reshape(n, k // g, g).astype(np.float32) * self.scales[:, :, None]
        if self.offsets is not None:
            w = w + self.offsets[:, :, None]
        return w.reshape(n, k)


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian fp16 from two uint8 columns, as float32 [blocks, 1]."""
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: element j is byte j's low nibble, element 16 + j its high nibble."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """A block's 32 fifth bits (uint32 little-endian, bit j for element j) as 0 or 16."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")
    return bits.astype(np.uint8) << 4


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 8 sub-blocks' 6-bit scales and minimums packed in 12 bytes."""
    s = scales.astype(np.uint8)
    sc = np.empty((s.shape[0], 8), np.uint8)
    mn = np.empty((s.shape[0], 8), np.uint8)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_quants_low(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: 128 bytes -> 256 low-nibble values; chunk c's 32 bytes hold sub-block 2c in
    their low nibbles and 2c + 1 in their high nibbles."""
    chunks = qs.reshape(qs.shape[0], 4, 32)
    return np.stack([chunks & 0x0F, chunks >> 4], axis=2).reshape(qs.shape[0], QK_K)


def _decode_blocks(kind: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Blocks [B, bytes] -> signed values [B, weights] int8, scales and offsets [B, groups]."""
    if kind == "Q8_0":
        d = _f16(raw[:, 0:2])
        return raw[:, 2:34].view(np.int8), d, None
    if kind in ("Q4_0", "Q4_1"):
        d = _f16(raw[:, 0:2])
        start = 2 if kind == "Q4_0" else 4
        v = _nibbles(raw[:, start : start + 16]).astype(np.int8) - 8
        if kind == "Q4_0":
            return v, d, None
        return v, d, _f16(raw[:, 2:4]) + 8 * d  # d q + m = d (q - 8) + (m + 8 d)
    if kind in ("Q5_0", "Q5_1"):
        d = _f16(raw[:, 0:2])
        start = 2 if kind == "Q5_0" else 4
        q = _nibbles(raw[:, start + 4 : start + 20]) | _high_bits(raw[:, start : start + 4])
        v = q.astype(np.int8) - 16
        if kind == "Q5_0":
            return v, d, None
        return v, d, _f16(raw[:, 2:4]) + 16 * d
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(raw[:, 0:2]), _f16(raw[:, 2:4])
        sc, mn = _k_scales(raw[:, 4:16])
        scale = d * sc  # [B, 8] exact in float32
        if kind == "Q4_K":
            q, mid = _k_quants_low(raw[:, 16:144]), 8
        else:
            high = np.unpackbits(raw[:, 16:48], axis=-1, bitorder="little").reshape(-1, 32, 8)
            # qh byte l, bit 2c: sub-block 2c's element l; bit 2c + 1: sub-block 2c + 1's.
            high = high.transpose(0, 2, 1).reshape(-1, QK_K).astype(np.uint8) << 4
            q, mid = _k_quants_low(raw[:, 48:176]) | high, 16
        # w = d sc q - dmin m = (d sc) (q - mid) + (mid d sc - dmin m)
        return q.astype(np.int8) - mid, scale, mid * scale - dmin * mn
    if kind == "Q6_K":
        ql, qh = raw[:, 0:128], raw[:, 128:192]
        sc = raw[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(raw[:, 208:210])
        q = np.empty((raw.shape[0], QK_K), np.uint8)
        for half in range(2):
            lo, hi = ql[:, 64 * half : 64 * half + 64], qh[:, 32 * half : 32 * half + 32]
            base = 128 * half
            q[:, base : base + 32] = (lo[:, :32] & 0x0F) | ((hi & 3) << 4)
            q[:, base + 32 : base + 64] = (lo[:, 32:] & 0x0F) | (((hi >> 2) & 3) << 4)
            q[:, base + 64 : base + 96] = (lo[:, :32] >> 4) | (((hi >> 4) & 3) << 4)
            q[:, base + 96 : base + 128] = (lo[:, 32:] >> 4) | (((hi >> 6) & 3) << 4)
        return q.astype(np.int8) - 32, d * sc, None
    raise KeyError(kind)


def decode(kind: str, raw: np.ndarray, rows: int, cols: int, what: str) -> DecodedWeight:
    """A quantized tensor's bytes (its rows of blocks, in file order) as values, scales, offsets."""
    scheme = SCHEMES.get(kind)
    if scheme is None:
        raise CheckpointError(f"{what}: GGUF type {kind} has no kernel scheme (known: {', '.join(SCHEMES)})")
    if cols % scheme.block_weights:
        raise CheckpointError(f"{what}: {cols} columns are not whole {kind} blocks of {scheme.block_weights}")
    blocks = rows * cols // scheme.block_weights
    flat = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if flat.size != blocks * scheme.block_bytes:
        raise CheckpointError(
            f"{what}: {flat.size} bytes of {kind} data, expected {blocks * scheme.block_bytes} for [{rows}, {cols}]"
        )
    groups = cols // scheme.group
    values = np.empty((rows, cols), np.int8)
    scales = np.empty((rows, groups), np.float32)
    offsets = np.empty((rows, groups), np.float32) if scheme.offsets else None
    # A slice of blocks at a time into the result: the decode's temporaries stay a few MB (whole, a
    # 2B's Q6_K head made 800 MB of them, the load's peak).
    per_block = scheme.block_weights // scheme.group
    step = max(1, DECODE_CHUNK_WEIGHTS // scheme.block_weights)
    by_block = flat.reshape(blocks, scheme.block_bytes)
    for b0 in range(0, blocks, step):
        b1 = min(blocks, b0 + step)
        v, sc, off = _decode_blocks(kind, by_block[b0:b1])
        values.reshape(-1)[b0 * scheme.block_weights : b1 * scheme.block_weights] = v.reshape(-1)
        scales.reshape(-1)[b0 * per_block : b1 * per_block] = np.broadcast_to(sc, (b1 - b0, per_block)).reshape(-1)
        if offsets is not None:
            offsets.reshape(-1)[b0 * per_block : b1 * per_block] = off.reshape(-1)
    return DecodedWeight(values, scales, offsets, scheme)
