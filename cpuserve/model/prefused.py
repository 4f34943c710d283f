"""Checkpoints that store q/k/v and gate/up already fused (Phi-3: `self_attn.qkv_proj`,
`mlp.gate_up_proj`), presented under the separate names every other architecture uses.

The decoder, the loader, the footprint and the quantizer all ask for `q_proj` ... `up_proj`; a
view that serves those as row ranges of the stored fused tensor keeps them model-agnostic, and the
loader fuses the parts again at build time (linears.py) exactly as for any checkpoint. Only float
weights are split: a quantized fused tensor (its scales, packed words, shape tensors) is refused,
naming it. Tensors already stored under the separate names pass through unchanged (what `cpuserve
quantize` writes for a Phi-3).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from cpuserve.errors import CheckpointError
from cpuserve.model.config import ModelSpec

# fused module -> its parts, in the order their rows are stacked
FUSED_PARTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
_FUSED_NAME = re.compile(r"^(model\.layers\.\d+\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(.+)$")
_PART_NAME = re.compile(r"^(model\.layers\.\d+\.)(self_attn\.[qkv]_proj|mlp\.gate_proj|mlp\.up_proj)\.(.+)$")
_FLOAT = ("F32", "F16", "BF16")


def part_sizes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Each fused module's part row counts."""
    i = spec.intermediate_size
    return {"self_attn.qkv_proj": (spec.q_size, spec.kv_size, spec.kv_size), "mlp.gate_up_proj": (i, i)}


class SplitFusedCheckpoint:
    """A checkpoint (safetensors or GGUF view) with its fused projections split into their parts."""

    def __init__(self, inner: Any, spec: ModelSpec) -> None:
        self.inner = inner
        self.model_dir: Path | None = getattr(inner, "model_dir", None)
        sizes = part_sizes(spec)
        self._parts: dict[str, tuple[str, int, int]] = {}  # part name -> (fused name, first row, end row)
        self._names: list[str] = []
        for name in inner.names():
            match = _FUSED_NAME.match(name)
            if match is None:
                self._names.append(name)
                continue
            prefix, module, leaf = match.groups()
            where = f"{inner.file_of(name)}: tensor '{name}'"
            if leaf != "weight" or inner.stored_dtype(name) not in _FLOAT:
                raise CheckpointError(
                    f"{where} ({inner.stored_dtype(name)}): a pre-fused {module.split('.')[1]} is read only as a "
                    "float weight (bf16/fp16/fp32); a quantized or biased pre-fused checkpoint is not supported"
                )
            shape = tuple(inner.shape(name))
            rows = sum(sizes[module])
            if len(shape) != 2 or shape[0] != rows:
                raise CheckpointError(
                    f"{where} has shape {list(shape)}, expected [{rows}, in_features] "
                    f"(the rows of {', '.join(p.split('.')[1] for p in FUSED_PARTS[module])} stacked, from config.json)"
                )
            start = 0
            for part, n in zip(FUSED_PARTS[module], sizes[module], strict=True):
                part_name = f"{prefix}{part}.weight"
                self._parts[part_name] = (name, start, start + n)
                start += n
                self._names.append(part_name)
        seen: set[str] = set()
        for name in self._names:
            if name in seen:
                raise CheckpointError(
                    f"{self.file_of(name)}: tensor '{name}' is stored both fused and on its own; keep one"
                )
            seen.add(name)
        self._cached: tuple[str, torch.Tensor] | None = None  # the fused tensor last read (its parts come in a row)

    def stored_name(self, name: str) -> str:
        """Where a part's tensor is expected (for naming a missing one): in the fused tensor, unless
        the checkpoint stores its projections separately (a Phi-3 that `cpuserve quantize` wrote)."""
        match = _PART_NAME.match(name)
        separate = any(_PART_NAME.match(n) for n in self._names if n not in self._parts)
        if match is None or (separate and not self._parts):
            return name
        prefix, part, leaf = match.groups()
        fused = next(f for f, parts in FUSED_PARTS.items() if part in parts)
        return f"{prefix}{fused}.{leaf}"

    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._parts or (name in self.inner and _FUSED_NAME.match(name) is None)

    def file_of(self, name: str) -> Path:
        return self.inner.file_of(self._parts[name][0] if name in self._parts else name)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._parts:
            return tuple(self.inner.shape(name))
        fused, start, end = self._parts[name]
        return (end - start, *tuple(self.inner.shape(fused))[1:])

    def stored_dtype(self, name: str) -> str:
        return self.inner.stored_dtype(self._parts[name][0] if name in self._parts else name)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._parts:
            return self.inner.get(name)
        fused, start, end = self._parts[name]
        if self._cached is None or self._cached[0] != fused:
            self._cached = None  # release the previous fused tensor before reading the next
            self._cached = (fused, self.inner.get(fused))
        part = self._cached[1][start:end].clone()
        if end == self._cached[1].shape[0]:
            self._cached = None  # the last part: nothing more comes from this tensor
        return part

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self._names:
            yield name, self.get(name)

    def close(self) -> None:
        self._cached = None
        self.inner.close()

    def __enter__(self) -> SplitFusedCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def split_prefused(checkpoint: Any, spec: ModelSpec) -> Any:
    """The checkpoint as the decoder names it: split where the architecture stores fused projections."""
    return SplitFusedCheckpoint(checkpoint, spec) if spec.prefused_projections else checkpoint
