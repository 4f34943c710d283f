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


class QuantizedEmbedding(nn.Module):
    """Rows [V, K] as int4 nibbles (values in [-8, 7]) or int8, with scales (and offsets) per group."""

    def __init__(self, values: np.ndarray, scales: np.ndarray, offsets: np.ndarray | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = values.shape
        self.group = self.embedding_dim // scales.shape[1]
        self.dtype = dtype
        q = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int8))
        self.nibbles = bool(q.numel()) and int(q.min()) >= -8 and int(q.max()) <= 7
        if self.nibbles:  # two values a byte: low nibble the even column, high the odd, each + 8
            packed = torch.empty(self.num_embeddings, self.embedding_dim // 2, dtype=torch.uint8)
            step = max(1, (1 << 22) // self.embedding_dim)  # rows at a time: small temporaries
            for r0 in range(0, self.num_embeddings, step):
                u = (q[r0 : r0 + step] + 8).view(torch.uint8).view(-1, self.embedding_dim // 2, 2)
                packed[r0 : r0 + step] = u[..., 0] | (u[..., 1] << 4)
            q = packed
        self.register_buffer("values", q.contiguous())
        self.register_buffer("scales", torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32)))
        offsets_t = None if offsets is None else torch.from_numpy(np.ascontiguousarray(offsets, dtype=np.float32))
        self.register_buffer("offsets", offsets_t)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        q = self.values.index_select(0, flat)
        if self.nibbles:
            q = torch.stack([(q & 0x0F), (q >> 4)], dim=-1).view(len(flat), self.embedding_dim).to(torch.int8) - 8
        groups = self.embedding_dim // self.group
        rows = q.float().view(len(flat), groups, self.group) * self.scales.index_select(0, flat).unsqueeze(-1)
        if self.offsets is not None:
            rows = rows + self.offsets.index_select(0, flat).unsqueeze(-1)
        return rows.view(*ids.shape, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        kind = "int4" if self.nibbles else "int8"
        return f"{self.num_embeddings}, {self.embedding_dim}, {kind} groups of {self.group}, out {self.dtype}"


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
