"""A token embedding kept in its file's quantized form (a GGUF's Q4_K / Q8_0 / Q6_K table), each
looked-up row dequantized on the way out.

Why: the table is the largest single tensor of a small model (Gemma 3 270M: 262k rows, 63% of its
weights) and of a 2B one (130k x 2048), and a step reads only the rows of its tokens. Dequantized to
the compute dtype it costs 2-4x its file's bytes in RAM (the 2B's Q4_K table: 510 MB in bfloat16
against 150 MB in the file), and the float32 intermediate made the load's peak twice that again.
Rows come out exactly as the float table's would: values * scale (+ offset) in float32, then the
compute dtype.

A table that is also the output head (a tied GGUF: Gemma 3, SmolLM2) is not kept twice:
HeadRowsEmbedding looks its rows up in the head's packed weights (the kernel's layout), which hold
the same values and scales.

An untied 16-bit float table served in float32 (an AVX2 host's --dtype auto) stays 16-bit (WidenedEmbedding):
widening is exact, so its rows are the float32 table's, at half the bytes (the 2B shape's 130k x
2048 table: 535 MB instead of 1070).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from cpuserve.quant.scale_codes import expand_offsets, expand_scales


class QuantizedEmbedding(nn.Module):
    """Rows [V, K] as int4 nibbles (values in [-8, 7]), 6 bits (values in [-32, 31]: the nibbles plus
    a plane of the top two bits, Q5_* and Q6_K tables) or int8, with scales (and offsets) per group:
    fp32, or as the file codes them (codes, coding: quant/scale_codes.py, expanded for the looked-up
    rows only, by the same function that gives the fp32 values: the same bits)."""

    def __init__(
        self,
        values: np.ndarray,
        scales: np.ndarray | None,
        offsets: np.ndarray | None,
        dtype: torch.dtype,
        codes: Any = None,
        coding: Any = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = values.shape
        groups = (codes.scale_code if codes is not None else scales).shape[1]
        self.group = self.embedding_dim // groups
        self.dtype = dtype
        q = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int8))
        low, high = (int(q.min()), int(q.max())) if q.numel() else (0, 0)
        six = low >= -32 and high <= 31 and self.embedding_dim % 4 == 0
        self.bits = 4 if low >= -8 and high <= 7 else 6 if six else 8
        tops = None
        if self.bits < 8:  # two values a byte (low nibble the even column), + 8 or + 32; 6 bits: the top two
            bias = 8 if self.bits == 4 else 32
            packed = torch.empty(self.num_embeddings, self.embedding_dim // 2, dtype=torch.uint8)
            if self.bits == 6:  # four columns' top two bits a byte, column 4b + t at bits 2t
                tops = torch.empty(self.num_embeddings, self.embedding_dim // 4, dtype=torch.uint8)
            step = max(1, (1 << 22) // self.embedding_dim)  # rows at a time: small temporaries
            for r0 in range(0, self.num_embeddings, step):
                u = (q[r0 : r0 + step].to(torch.int16) + bias).to(torch.uint8)
                pairs = (u & 0x0F).view(-1, self.embedding_dim // 2, 2)
                packed[r0 : r0 + step] = pairs[..., 0] | (pairs[..., 1] << 4)
                if tops is not None:
                    t = (u >> 4).view(-1, self.embedding_dim // 4, 4)
                    tops[r0 : r0 + step] = t[..., 0] | (t[..., 1] << 2) | (t[..., 2] << 4) | (t[..., 3] << 6)
            q = packed
        self.register_buffer("values", q.contiguous())
        self.register_buffer("tops", tops)
        self.coding = coding if codes is not None else None
        if codes is not None:
            self.register_buffer("scales", None)
            self.register_buffer("offsets", None)
            for part in ("scale_code", "scale_super", "offset_code", "offset_super"):
                array = getattr(codes, part)
                self.register_buffer(part, None if array is None else torch.from_numpy(np.ascontiguousarray(array)))
        else:
            self.register_buffer("scales", torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32)))
            offsets_t = None if offsets is None else torch.from_numpy(np.ascontiguousarray(offsets, dtype=np.float32))
            self.register_buffer("offsets", offsets_t)

    def _rows_scales(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The looked-up rows' fp32 scales and offsets [R, G]."""
        if self.coding is None:
            offsets = None if self.offsets is None else self.offsets.index_select(0, flat)
            return self.scales.index_select(0, flat), offsets
        code, super_, offset_code, offset_super = (
            None if t is None else t.index_select(0, flat)
            for t in (self.scale_code, self.scale_super, self.offset_code, self.offset_super)
        )
        scales = expand_scales(code, super_, self.coding.per)
        if offset_code is None:
            return scales, None
        return scales, expand_offsets(scales, offset_code, offset_super, self.coding.per, self.coding.mid)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        q = self.values.index_select(0, flat)
        if self.bits < 8:
            u = torch.stack([(q & 0x0F), (q >> 4)], dim=-1).view(len(flat), self.embedding_dim).to(torch.int16)
            if self.tops is not None:
                t = self.tops.index_select(0, flat).to(torch.int16)
                top = torch.stack([(t >> s) & 3 for s in (0, 2, 4, 6)], dim=-1).view(len(flat), self.embedding_dim)
                u = u | (top << 4)
            q = u - (8 if self.bits == 4 else 32)
        groups = self.embedding_dim // self.group
        scales, offsets = self._rows_scales(flat)
        rows = q.float().view(len(flat), groups, self.group) * scales.unsqueeze(-1)
        if offsets is not None:
            rows = rows + offsets.unsqueeze(-1)
        return rows.view(*ids.shape, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        kind = {4: "int4", 6: "6-bit", 8: "int8"}[self.bits]
        scales = "coded scales" if self.coding is not None else "fp32 scales"
        return f"{self.num_embeddings}, {self.embedding_dim}, {kind} groups of {self.group}, {scales}, out {self.dtype}"


class HeadRowsEmbedding(nn.Module):
    """The token embedding of a tied quantized table, read from the output head that holds it: row
    i of the embedding is output channel i of the head (IntWeightMethod.weight_rows, whatever layout
    the kernel packed), dequantized exactly as QuantizedEmbedding's."""

    def __init__(self, head: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self._head = (head,)  # not a submodule: the head is the model's lm_head, registered there
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self._head[0]
        rows = head.method.weight_rows(head, ids.reshape(-1))
        return rows.view(*ids.shape, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        head = self._head[0]
        where = f"the output head's {head.quant.name} weights"
        return f"{self.num_embeddings}, {self.embedding_dim}, {where}, out {self.dtype}"


class WidenedEmbedding(nn.Module):
    """An untied bfloat16 / float16 table kept as stored, each looked-up row widened to the compute
    dtype (float32): the same values as the widened table's, which would take twice the memory."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype
        self.register_buffer("weight", weight.contiguous())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.index_select(0, ids.reshape(-1))
        return rows.view(*ids.shape, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, stored {self.weight.dtype}, out {self.dtype}"
