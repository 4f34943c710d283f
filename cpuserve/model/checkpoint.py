"""Reading tensors from an HF checkpoint directory: safetensors only, single or sharded.

Each tensor is read into memory of its own (positioned reads at the offsets the header gives), not
returned as a view of an mmapped file: one live view keeps a whole shard mapped, with every page
that loading touched still resident (2.4 GB of RSS after loading the 2B W8A8 shape, on top of the
repacked weights).

Pickled formats (`*.bin`, `*.pt`) are refused: loading them can run arbitrary code.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from cpuserve.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype names -> torch dtypes; a tensor of any other dtype is refused, naming it.
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100_000_000  # safetensors' own limit on the header's length


@dataclass(frozen=True)
class TensorEntry:
    path: Path
    dtype: str  # as the file stores it ('BF16', 'I8', ...)
    shape: tuple[int, ...]
    begin: int  # byte offsets in the file
    end: int


def _count(value: object) -> bool:
    return type(value) is int and value >= 0  # not bool, not float, not negative


def read_header(path: Path) -> dict[str, TensorEntry]:
    """One file's tensors from its header, parsed once and checked as safetensors checks it: a
    UTF-8 JSON object of a bounded length, every dtype known, whole non-negative dimensions and
    offsets, each tensor's byte range as long as its shape needs, and the ranges tiling the data
    exactly (no overlap, no gap, nothing after)."""

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: not a readable safetensors file ({why})")

    try:
        size_on_disk = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= min(_MAX_HEADER, size_on_disk - 8):
                raise bad("the header length is out of range")
            raw = f.read(n)
        text = raw.decode("utf-8")
        if not text.startswith("{"):
            raise bad("the header is not a JSON object")
        header = json.loads(text)
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise bad(str(exc)) from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    data_start, entries = 8 + n, {}
    for name in sorted(header):  # by name, as safetensors lists them
        info = header[name]
        if name == "__metadata__":
            continue
        dtype = info.get("dtype") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(shape, list) and all(_count(d) for d in shape)):
            raise bad(f"tensor '{name}' has shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)):
            raise bad(f"tensor '{name}' has data_offsets {offsets!r}")
        if dtype not in _DTYPES:
            raise CheckpointError(f"{path}: tensor '{name}' has dtype {dtype}, which cpuserve does not read")
        begin, end = offsets
        count = math.prod(shape) * _DTYPES[dtype].itemsize
        if end - begin != count:
            raise bad(f"tensor '{name}' has byte range [{begin}, {end}) for {count} bytes")
        entries[name] = TensorEntry(path, dtype, tuple(shape), data_start + begin, data_start + end)
    position = data_start
    for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin != position:
            raise bad(f"the tensors' byte ranges {'overlap' if entry.begin < position else 'leave a gap'}")
        position = entry.end
    if position != size_on_disk:
        raise bad(
            f"the tensors cover {position - data_start} bytes of data but the file holds {size_on_disk - data_start}"
        )
    return entries


class SafetensorsCheckpoint:
    """Every tensor of a checkpoint by name, from the headers read once; data read only on `get`.

    Holds no open files: it can be kept from the start-up plan to the end of loading."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._files = self._shard_files(model_dir)
        self._entries: dict[str, TensorEntry] = {}
        for path in self._files:
            self._entries.update(read_header(path))

    @staticmethod
    def _shard_files(model_dir: Path) -> list[Path]:
        if not model_dir.is_dir():
            raise CheckpointError(f"{model_dir}: not a directory (expected an HF model directory)")
        index = model_dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: malformed index, expected a 'weight_map' ({exc})") from None
            files = sorted({model_dir / name for name in weight_map.values()})
            missing = [f for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{missing[0]}: missing (listed in {INDEX_FILE})")
            return files
        files = sorted(model_dir.glob("*.safetensors"))
        if files:
            return files
        pickled = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        if pickled:
            raise CheckpointError(
                f"{model_dir / pickled[0]}: pickled weights are never loaded; convert the checkpoint to safetensors"
            )
        raise CheckpointError(f"{model_dir}: no *.safetensors weights found")

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def file_of(self, name: str) -> Path:
        return self._entries[name].path

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def stored_dtype(self, name: str) -> str:
        """The dtype as the file stores it (e.g. 'BF16', 'I8'), without reading the data."""
        return self._entries[name].dtype

    def get(self, name: str) -> torch.Tensor:
        entry = self._entries.get(name)
        if entry is None:
            raise CheckpointError(f"{self.model_dir}: tensor '{name}' is missing from the checkpoint")
        try:
            data = torch.empty(entry.end - entry.begin, dtype=torch.uint8)
            with open(entry.path, "rb", buffering=0) as f:
                f.seek(entry.begin)
                got = f.readinto(memoryview(data.numpy())) if data.numel() else 0
            if got != entry.end - entry.begin:
                raise OSError(f"the file ends {entry.end - entry.begin - got} bytes early")
            return data.view(_DTYPES[entry.dtype]).view(entry.shape)
        except (OSError, RuntimeError) as exc:
            raise CheckpointError(f"{entry.path}: tensor '{name}' cannot be read ({exc})") from None

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self._entries:
            yield name, self.get(name)

    def close(self) -> None:
        """Nothing is held open; kept so `with SafetensorsCheckpoint(...)` reads as it always did."""

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class ShardWriter:
    """Writes tensors as HF safetensors shards (a new file past `shard_bytes`), with the index
    file when there is more than one; tensors are released as each shard is written."""

    def __init__(self, out: Path, shard_bytes: int = 2 * 1024**3) -> None:
        self.out, self.shard_bytes = out, shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._size = 0
        self._files: list[list[str]] = []
        self._total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._size + nbytes > self.shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._size += nbytes
        self._total += nbytes

    def _flush(self) -> None:
        index = len(self._files) + 1
        path = self.out / f"part-{index}.safetensors"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        # safetensors creates the file owner-only (0600); a checkpoint is as readable as any file the
        # user writes (the umask decides), so a container's non-root user can read a mounted model.
        path.chmod(0o666 & ~_umask())
        self._files.append(list(self._pending))
        self._pending, self._size = {}, 0

    def finish(self) -> None:
        if self._pending or not self._files:
            self._flush()
        count = len(self._files)
        if count == 1:
            (self.out / "part-1.safetensors").rename(self.out / "model.safetensors")
            return
        weight_map = {}
        for i, names in enumerate(self._files, 1):
            final = f"model-{i:05d}-of-{count:05d}.safetensors"
            (self.out / f"part-{i}.safetensors").rename(self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self._total}, "weight_map": weight_map}
        (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2))


def refuse_existing(out: Path, force: bool) -> None:
    """An output directory is replaced only with --force (said before any long work, and again when
    the writing starts)."""
    if out.exists() and not force:
        raise CheckpointError(f"{out}: already exists (pass --force to replace it)")


@contextmanager
def atomic_directory(out: Path, force: bool) -> Iterator[Path]:
    """A hidden sibling to write into, renamed to `out` only when the block completes: a
    directory named `out` is always complete, whatever interrupts the writing."""
    refuse_existing(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        yield partial
        if out.exists():
            shutil.rmtree(out)
        partial.rename(out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
