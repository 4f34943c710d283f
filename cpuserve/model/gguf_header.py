"""A GGUF file's header read fast: scalar metadata and the tensor table, arrays skipped unless asked.

gguf-py's reader builds a numpy view of every metadata element; for a 262144-token vocabulary that
took 5-15 s at every start. Serving needs only the architecture's scalars and where each tensor's
bytes are, so this walks the header once with struct over a memory map (only the header's pages are
touched) and checks what the loader relies on: the magic and version, known value and tensor
types, and every tensor's bytes inside the file (a truncated file names its first cut tensor).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from cpuserve.errors import CheckpointError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    kind: str  # the GGML type's name: F32, Q4_K, ...
    shape: tuple[int, ...]  # rows first (GGML lists the fastest dimension first)
    offset: int  # absolute byte offset in the file
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    metadata: dict[str, Any]
    tensors: list[TensorInfo]


class _Cursor:
    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise CheckpointError(f"{self.path}: not a readable GGUF file (the header is cut short)")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise CheckpointError(f"{self.path}: not a readable GGUF file (the header is cut short)")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, keep: bool) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.take("<I"), self.take("<Q")
            if not keep and etype in _SCALARS:  # skipped in one step
                self.pos += count * struct.calcsize(_SCALARS[etype])
                return None
            items = [self.value(etype, keep) for _ in range(count)]
            return items if keep else None
        raise CheckpointError(f"{self.path}: not a readable GGUF file (metadata value type {vtype})")


def read_header(path: Path, arrays: bool = False) -> GGUFHeader:
    """The metadata (arrays as lists only with arrays=True, else None) and the tensor table."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(_Cursor(buf, path), size, arrays)
    except (OSError, ValueError) as exc:  # a missing, empty or unmappable file
        if not path.is_file():
            raise CheckpointError(f"{path}: file not found (expected a .gguf file)") from None
        raise CheckpointError(f"{path}: not a readable GGUF file ({exc})") from None


def _parse(cur: _Cursor, size: int, arrays: bool) -> GGUFHeader:
    path = cur.path
    if bytes(cur.buf[:4]) != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (no GGUF magic at its start)")
    cur.pos = 4
    version = cur.take("<I")
    if version not in (2, 3):
        raise CheckpointError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.take("<I"), arrays)
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
        type_id, offset = cur.take("<I"), cur.take("<Q")
        infos.append((name, dims, type_id, offset))
    alignment = int(meta.get("general.alignment") or 32)
    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, dims, type_id, offset in infos:
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise CheckpointError(f"{path}: tensor '{name}' has an unknown GGML type {type_id}") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        count = 1
        for d in dims:
            count *= d
        if dims and dims[0] % block:
            raise CheckpointError(f"{path}: tensor '{name}' has rows of {dims[0]}, not whole {qtype.name} blocks")
        n_bytes = count // block * type_size
        start = data_start + offset
        if start + n_bytes > size:
            raise CheckpointError(
                f"{path}: truncated: tensor '{name}' needs bytes up to {start + n_bytes}, the file has {size}"
            )
        tensors.append(TensorInfo(name, qtype.name, tuple(reversed(dims)), start, n_bytes))
    return GGUFHeader(path, meta, tensors)
