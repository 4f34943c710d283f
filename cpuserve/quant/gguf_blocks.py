"""GGUF's quantized block formats re-expressed exactly as the kernels' integer schemes.

Every llama.cpp block type used by the common files (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
Q6_K) stores, per group of 16 or 32 weights, small integers q, a scale and for some a minimum.
Written as w = s * v + offset with v signed (v = q - 8 for 4 bits, q - 16 for 5, q - 32 for 6),
each is one of the kernels' schemes: 4-bit values are W4A8 in groups of 32, 5-, 6- and 8-bit values
W8A8 in groups (32, or 16 for Q6_K; the 5- and 6-bit ones held as int6 panels where the kernel has
them: BlockScheme.int6), and the formats with a minimum add a per-group offset (the
driver's `offsets` term). Scales and offsets are kept as the file codes them (quant/scale_codes.py:
the fp16 scale and minimum of a simple type, a K-quant's 6-bit sub-block codes and its d and -dmin per
super-block) and expanded through scale_codes' reference. Values and scales are exact (products of
an fp16 and an 8-bit integer are exact in float32); an offset that sums two terms (m + 8 d,
8 d sc - dmin m) is rounded once.

Decoded from the format's description (llama.cpp's ggml-common.h block structs), vectorised with
numpy over all blocks of a tensor; tests/test_gguf_quant.py checks every type against gguf-py's own
dequantizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cpuserve.errors import CheckpointError
from cpuserve.quant.scale_codes import ScaleCoding, expand_offsets, expand_scales

QK = 32  # weights per block of the simple types
QK_K = 256  # weights per super-block of the K-quants
DECODE_CHUNK_WEIGHTS = 1 << 22  # weights decoded at a time


@dataclass(frozen=True)
class BlockScheme:
    """What a GGUF type becomes: value bits (4 or 8 in the kernels), group size, with offsets, and how
    its scales (and offsets) are coded."""

    bits: int
    group: int
    offsets: bool
    block_weights: int
    block_bytes: int
    coding: ScaleCoding
    int6: bool = False  # 8-bit values within [-32, 31]: held as int6 panels where a kernel has them


_F16 = ScaleCoding("float16", 0)
SCHEMES: dict[str, BlockScheme] = {
    "Q4_0": BlockScheme(4, 32, False, QK, 18, _F16),
    "Q4_1": BlockScheme(4, 32, True, QK, 20, ScaleCoding("float16", 0, "float16", 8.0)),
    "Q5_0": BlockScheme(8, 32, False, QK, 22, _F16, int6=True),
    "Q5_1": BlockScheme(8, 32, True, QK, 24, ScaleCoding("float16", 0, "float16", 16.0), int6=True),
    "Q8_0": BlockScheme(8, 32, False, QK, 34, _F16),
    "Q4_K": BlockScheme(4, 32, True, QK_K, 144, ScaleCoding("uint8", 8, "uint8", 8.0)),
    "Q5_K": BlockScheme(8, 32, True, QK_K, 176, ScaleCoding("uint8", 8, "uint8", 16.0), int6=True),
    "Q6_K": BlockScheme(8, 16, False, QK_K, 210, ScaleCoding("int8", 16), int6=True),
}


@dataclass
class GroupCodes:
    """A decoded tensor's scales and offsets as the file codes them (quant/scale_codes.py)."""

    scale_code: np.ndarray  # [N, G] of the coding's dtype
    scale_super: np.ndarray | None  # float16 [N, G / per] (the file's d: exact)
    offset_code: np.ndarray | None  # [N, G]
    offset_super: np.ndarray | None  # float16 [N, G / per] (the file's -dmin: exact)

    def part(self, name: str) -> np.ndarray | None:
        """The array of a checkpoint part (ScaleCoding.parts)."""
        return getattr(self, name.removeprefix("weight_"))

    def rows(self, rows_of) -> GroupCodes:  # type: ignore[no-untyped-def]
        """Each array through rows_of (a permutation of output rows)."""
        return GroupCodes(*(None if a is None else rows_of(a) for a in vars(self).values()))


@dataclass
class DecodedWeight:
    """w[n, k] = scales[n, k // group] * values[n, k] (+ offsets[n, k // group]); codes: how the file
    codes the scales and offsets (None: a type rounded at load, fp32 scales of its own)."""

    values: np.ndarray  # int8 [N, K]
    scales: np.ndarray  # float32 [N, K // group]
    offsets: np.ndarray | None  # float32 [N, K // group]
    scheme: BlockScheme
    codes: GroupCodes | None = None

    def dequantized(self) -> np.ndarray:
        n, k = self.values.shape
        g = self.scheme.group
        w = self.values.reshape(n, k // g, g).astype(np.float32) * self.scales[:, :, None]
        if self.offsets is not None:
            w = w + self.offsets[:, :, None]
        return w.reshape(n, k)


def _f16_codes(b: np.ndarray) -> np.ndarray:
    """Little-endian fp16 from two uint8 columns, [blocks, 1]."""
    return np.ascontiguousarray(b).view("<f2").astype(np.float16)


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
    return sc, mn


def _k_quants_low(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: 128 bytes -> 256 low-nibble values; chunk c's 32 bytes hold sub-block 2c in
    their low nibbles and 2c + 1 in their high nibbles."""
    chunks = qs.reshape(qs.shape[0], 4, 32)
    return np.stack([chunks & 0x0F, chunks >> 4], axis=2).reshape(qs.shape[0], QK_K)


_Codes = tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]


def _decode_blocks(kind: str, raw: np.ndarray) -> tuple[np.ndarray, _Codes]:
    """Blocks [B, bytes] -> signed values [B, weights] int8 and the codes of their scales and offsets
    (scale codes [B, groups], factors [B, 1], offset codes, factors; ScaleCoding)."""
    if kind == "Q8_0":
        return raw[:, 2:34].view(np.int8), (_f16_codes(raw[:, 0:2]), None, None, None)
    if kind in ("Q4_0", "Q4_1"):
        start = 2 if kind == "Q4_0" else 4
        v = _nibbles(raw[:, start : start + 16]).astype(np.int8) - 8
        m = None if kind == "Q4_0" else _f16_codes(raw[:, 2:4])  # d q + m = d (q - 8) + (8 d + m)
        return v, (_f16_codes(raw[:, 0:2]), None, m, None)
    if kind in ("Q5_0", "Q5_1"):
        start = 2 if kind == "Q5_0" else 4
        q = _nibbles(raw[:, start + 4 : start + 20]) | _high_bits(raw[:, start : start + 4])
        m = None if kind == "Q5_0" else _f16_codes(raw[:, 2:4])
        return q.astype(np.int8) - 16, (_f16_codes(raw[:, 0:2]), None, m, None)
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16_codes(raw[:, 0:2]), _f16_codes(raw[:, 2:4])
        sc, mn = _k_scales(raw[:, 4:16])
        if kind == "Q4_K":
            q, mid = _k_quants_low(raw[:, 16:144]), 8
        else:
            high = np.unpackbits(raw[:, 16:48], axis=-1, bitorder="little").reshape(-1, 32, 8)
            # qh byte l, bit 2c: sub-block 2c's element l; bit 2c + 1: sub-block 2c + 1's.
            high = high.transpose(0, 2, 1).reshape(-1, QK_K).astype(np.uint8) << 4
            q, mid = _k_quants_low(raw[:, 48:176]) | high, 16
        # w = d sc q - dmin m = (d sc) (q - mid) + (mid d sc + (-dmin) m)
        return q.astype(np.int8) - mid, (sc, d, mn, -dmin)
    if kind == "Q6_K":
        ql, qh = raw[:, 0:128], raw[:, 128:192]
        sc = raw[:, 192:208].view(np.int8)
        d = _f16_codes(raw[:, 208:210])
        q = np.empty((raw.shape[0], QK_K), np.uint8)
        for half in range(2):
            lo, hi = ql[:, 64 * half : 64 * half + 64], qh[:, 32 * half : 32 * half + 32]
            base = 128 * half
            q[:, base : base + 32] = (lo[:, :32] & 0x0F) | ((hi & 3) << 4)
            q[:, base + 32 : base + 64] = (lo[:, 32:] & 0x0F) | (((hi >> 2) & 3) << 4)
            q[:, base + 64 : base + 96] = (lo[:, :32] >> 4) | (((hi >> 4) & 3) << 4)
            q[:, base + 96 : base + 128] = (lo[:, 32:] >> 4) | (((hi >> 6) & 3) << 4)
        return q.astype(np.int8) - 32, (sc, d, None, None)
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
    groups, coding = cols // scheme.group, scheme.coding
    per_block = scheme.block_weights // scheme.group
    values = np.empty((rows, cols), np.int8)
    codes = [np.empty((rows, groups), np.dtype(coding.code))]
    codes.append(np.empty((rows, groups // coding.per), np.float16) if coding.per else None)
    codes.append(np.empty((rows, groups), np.dtype(coding.offset_code)) if coding.offset_code else None)
    codes.append(np.empty((rows, groups // coding.per), np.float16) if coding.per and coding.offset_code else None)
    # A slice of blocks at a time into the result: the decode's temporaries stay a few MB (whole, a
    # 2B's Q6_K head made 800 MB of them, the load's peak).
    step = max(1, DECODE_CHUNK_WEIGHTS // scheme.block_weights)
    by_block = flat.reshape(blocks, scheme.block_bytes)
    for b0 in range(0, blocks, step):
        b1 = min(blocks, b0 + step)
        v, parts = _decode_blocks(kind, by_block[b0:b1])
        values.reshape(-1)[b0 * scheme.block_weights : b1 * scheme.block_weights] = v.reshape(-1)
        for whole, part, width in zip(codes, parts, (per_block, 1, per_block, 1), strict=True):
            if whole is not None:
                whole.reshape(-1)[b0 * width : b1 * width] = np.broadcast_to(part, (b1 - b0, width)).reshape(-1)
    return from_codes(values, GroupCodes(*codes), scheme)


def from_codes(values: np.ndarray, codes: GroupCodes, scheme: BlockScheme) -> DecodedWeight:
    """A decoded tensor whose fp32 scales and offsets are its codes expanded (scale_codes' reference)."""
    c, t = scheme.coding, (lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a)))
    scales = expand_scales(t(codes.scale_code), t(codes.scale_super), c.per)
    offsets = None
    if codes.offset_code is not None:
        offsets = expand_offsets(scales, t(codes.offset_code), t(codes.offset_super), c.per, c.mid).numpy()
    return DecodedWeight(values, scales.numpy(), offsets, scheme, codes)
