"""Integer weight layouts and their inverses: the checkpoint's packed int32 words (compressed-tensors
pack-quantized) and the native kernels' nibble and panel layouts, read back to int8 [N, K] values
(for the reference path, tests and tools), whole or some rows at a time (a tied GGUF embedding
looked up in its output head's packed weights)."""

from __future__ import annotations

import torch


def pack_int(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[N, K] signed ints -> int32 [N, ceil(K * bits / 32)]: value + 2^(bits-1), element i at bit i*bits."""
    per_word = 32 // bits
    n, k = values.shape
    words = -(-k // per_word)
    u = (values.to(torch.int64) + (1 << (bits - 1))) & ((1 << bits) - 1)
    u = torch.nn.functional.pad(u, (0, words * per_word - k)).view(n, words, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    packed = (u << shifts).sum(dim=-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_int(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of pack_int: int32 [N, W] -> int8 [N, k]."""
    per_word = 32 // bits
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    u = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return (u.view(packed.shape[0], -1)[:, :k] - (1 << (bits - 1))).to(torch.int8)


PANEL = 16  # output columns per panel in the panel layouts (kernels/csrc/panel_layout.h)


def _unpanel(packed: torch.Tensor, n: int, per_column: int, unpack) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Rows [N, per_column bytes] of a panel layout: per panel of width w, steps of [w, 4] bytes;
    `unpack(steps [w, steps, 4])` turns one panel's bytes into its [w, K] values."""
    flat, rows = packed.reshape(-1), []
    for c0 in range(0, n, PANEL):
        w = min(PANEL, n - c0)
        steps = flat[c0 * per_column : (c0 + w) * per_column].view(-1, w, 4).transpose(0, 1)
        rows.append(unpack(steps))
    return torch.cat(rows)


def unpack_nibbles(packed: torch.Tensor, k: int, layout: str = "offset") -> torch.Tensor:
    """A native int4 layout (uint8 [N, K/2]) back to int8 [N, K]. Rows (`offset`: nibbles value + 8;
    `twos_complement`: the value's two's complement): 16 bytes per 32 values, low nibbles the first 16.
    `offset_panel`: 16 columns interleaved, per 8 values 4 bytes a column, low nibbles the first 4."""
    if layout == "offset_panel":

        def panel(steps: torch.Tensor) -> torch.Tensor:  # [w, K/8, 4] -> [w, K]
            lo, hi = (steps & 0x0F).to(torch.int8) - 8, (steps >> 4).to(torch.int8) - 8
            return torch.cat((lo, hi), dim=-1).reshape(steps.shape[0], k)

        return _unpanel(packed, packed.shape[0], k // 2, panel)
    b = packed.view(packed.shape[0], k // 32, 16)
    lo, hi = (b & 0x0F).to(torch.int8), (b >> 4).to(torch.int8)
    if layout == "offset":
        lo, hi = lo - 8, hi - 8
    else:
        lo, hi = torch.where(lo > 7, lo - 16, lo), torch.where(hi > 7, hi - 16, hi)
    return torch.cat((lo, hi), dim=-1).view(packed.shape[0], k)


def unpack_int8(packed: torch.Tensor, k: int, layout: str) -> torch.Tensor:
    """A native W8A8 layout back to int8 [N, K]: `signed` is the weight itself; `signed_panel` (int8)
    and `offset_panel` (uint8 w + 128) are [N, K rounded up to 4], 16 columns interleaved by 4 values."""
    if layout == "signed":
        return packed
    flip = 0x80 if layout == "offset_panel" else 0

    def panel(steps: torch.Tensor) -> torch.Tensor:  # [w, K4/4, 4] -> [w, K]
        return (steps ^ flip).view(torch.int8).reshape(steps.shape[0], -1)[:, :k]

    return _unpanel(packed, packed.shape[0], packed.shape[1], panel)


INT6_PLANE_STEP = 32  # bytes of a panel's 2-bit plane per 8 inputs (kernels/csrc/panel_layout.h)


def unpack_int6(packed: torch.Tensor, k: int) -> torch.Tensor:
    """`int6_panel` (pack_int6: uint8 [N, 3K/4], N a multiple of 16) back to int8 [N, K]: per panel
    the int4 steps of the low nibbles, then per 8 inputs 32 bytes holding each lane's two high bits
    (byte e: low-nibble lanes e and e + 32 in bits 0-1 and 2-3, high-nibble lanes in 4-5 and 6-7)."""
    return _int6_rows(packed, k, torch.arange(packed.shape[0]))


def _int6_rows(packed: torch.Tensor, k: int, rows: torch.Tensor) -> torch.Tensor:
    """Rows of `int6_panel` -> int8 [len(rows), K], gathered a 4-byte word a step: column c's nibbles
    at word 16j + c of its panel, its plane bits at word 8j + c % 8 of the plane (lanes 4c..4c+3 in
    one half: shift 2 * (c // 8))."""
    steps, panel_words = k // 8, PANEL * (k // 2 + k // 4) // 4
    p, c = rows // PANEL, rows % PANEL
    j = torch.arange(steps)
    base = (p * panel_words).view(-1, 1)
    words = packed.reshape(-1).view(torch.int32)
    nibbles = words[base + 16 * j + c.view(-1, 1)].view(torch.uint8).view(len(rows), steps, 4).to(torch.int16)
    plane_at = base + PANEL * (k // 2) // 4 + 8 * j + (c % 8).view(-1, 1)
    plane = words[plane_at].view(torch.uint8).view(len(rows), steps, 4).to(torch.int16)
    shift = (2 * (c // 8)).view(-1, 1, 1)
    lo = (nibbles & 0x0F) | (((plane >> shift) & 3) << 4)
    hi = (nibbles >> 4) | (((plane >> (shift + 4)) & 3) << 4)
    return (torch.stack((lo, hi), dim=2).reshape(len(rows), k) - 32).to(torch.int8)


def panel_index(n: int, per_column: int, rows: torch.Tensor) -> torch.Tensor:
    """Where rows (output columns) of a panel layout [N, per_column bytes] are, as 4-byte words of the
    flat buffer: [len(rows), per_column // 4], each row's steps in order (a step of a column is one
    word: an int64 index per 4 bytes, not per byte)."""
    p = rows // PANEL
    width = (n - p * PANEL).clamp(max=PANEL)
    base = p * PANEL * (per_column // 4) + rows % PANEL
    return base.view(-1, 1) + torch.arange(per_column // 4).view(1, -1) * width.view(-1, 1)


def unpack_rows(packed: torch.Tensor, layout: str, bits: int, n: int, k: int, rows: torch.Tensor) -> torch.Tensor:
    """Rows of a native layout (as unpack_nibbles / unpack_int8 name them) -> int8 [len(rows), K]."""
    if layout == "signed":
        return packed[rows]
    if layout == "int6_panel":
        return _int6_rows(packed, k, rows)
    if bits == 4 and layout != "offset_panel":
        return unpack_nibbles(packed[rows], k, layout)
    words = packed.reshape(-1).view(torch.int32)[panel_index(n, packed.shape[1], rows)]
    steps = words.view(torch.uint8).view(len(rows), packed.shape[1] // 4, 4)  # [R, steps, 4], bytes in order
    if bits == 8:
        flip = 0x80 if layout == "offset_panel" else 0
        return (steps ^ flip).view(torch.int8).reshape(len(rows), packed.shape[1])[:, :k]
    lo, hi = (steps & 0x0F).to(torch.int8) - 8, (steps >> 4).to(torch.int8) - 8
    return torch.cat((lo, hi), dim=-1).reshape(len(rows), k)


def panel_scale_index(n: int, groups: int, rows: torch.Tensor) -> torch.Tensor:
    """Where the group scales [len(rows), G] of rows are in panel order (pack_scales of a panel
    variant: panel p at 16p * G, then per group its w columns)."""
    p = rows // PANEL
    width = (n - p * PANEL).clamp(max=PANEL)
    base = p * PANEL * groups + rows % PANEL
    return base.view(-1, 1) + torch.arange(groups).view(1, -1) * width.view(-1, 1)
