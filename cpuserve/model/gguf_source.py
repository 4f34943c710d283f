"""A GGUF file served as it is: its quantized tensors go to the native kernels, never through bf16.

`cpuserve serve file.gguf` (and the bundled SmolLM2) opens the file through a small directory in
the cache that holds what the rest of cpuserve reads from a model directory (config.json and the
tokenizer files, made by offline/gguf_convert.py from the file's metadata) and `gguf.json`, which
points at the file. `ModelSource.open` sees that pointer and reads the weights from the GGUF:

- `GGUFCheckpoint` presents the file's tensors under HF names. A linear's quantized weight appears
  as the checkpoint tensors its quant method asks for (`weight` int8 values, and its scales and, for
  formats with a minimum, offsets as the file codes them: `weight_scale_code`, `weight_scale_super`,
  ..., quant/scale_codes.py), decoded exactly from the blocks (quant/gguf_blocks.py);
  each layer is read with positioned reads as the loader reaches it, so the file is never mapped
  whole and the resident set is the packed weights.
- `gguf_quant_config` gives every linear the scheme its block type re-expresses exactly; a type
  without one is dequantized and rounded to int8 in groups of 32 (W8A8-G32), and the log says so
  with the error it measured. Float tensors (norms, and the embedding, dequantized) are float.
- A fused projection (phi3's `attn_qkv`, `ffn_up` = gate + up) is split into its parts' row
  ranges: GGUF blocks run along a row, so rows a..b of a tensor are themselves a tensor of its type
  at an offset, and each part is decoded and quantized exactly as a separate tensor would be.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from cpuserve.errors import CheckpointError
from cpuserve.model.gguf_header import GGUFHeader, read_header
from cpuserve.quant.config import QuantConfig, WeightQuant, _Group
from cpuserve.quant.gguf_blocks import SCHEMES, DecodedWeight, decode

log = logging.getLogger(__name__)

POINTER_FILE = "gguf.json"
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# The scheme a type without an exact one is rounded to (dequantized first).
FALLBACK = WeightQuant(bits=8, group_size=32, packed=False, act_groups=True)
_LINEAR_SUFFIXES = ("_proj", "lm_head")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: its GGUF name and type, HF name and shape (rows first), bytes."""

    gguf_name: str
    kind: str
    hf_name: str
    shape: tuple[int, ...]
    offset: int
    n_bytes: int


def _is_linear(hf_name: str) -> bool:
    module = hf_name.removesuffix(".weight")
    return hf_name.endswith(".weight") and module.endswith(_LINEAR_SUFFIXES)


def read_tensor_table(header: GGUFHeader, hf_name: Any, skip: frozenset[str] = frozenset()) -> dict[str, GGUFTensor]:
    """Every tensor by HF name (hf_name maps GGUF names; one with no place is an error naming it),
    but those in `skip` (hyper-parameters stored as tensors)."""
    table = {}
    for t in header.tensors:
        if t.name in skip:
            continue
        name = hf_name(t.name)
        if name is None:
            raise CheckpointError(f"{header.path}: tensor '{t.name}' has no place in this architecture")
        table[name] = GGUFTensor(t.name, t.kind, name, t.shape, t.offset, t.n_bytes)
    return table


def split_fused(table: dict[str, GGUFTensor], spec: Any, path: Path) -> dict[str, GGUFTensor]:
    """The table with each fused projection replaced by its parts' row ranges (model/prefused.py
    names them), each a tensor of the fused one's type at its own offset."""
    from cpuserve.model.prefused import FUSED_PARTS, part_sizes

    sizes = part_sizes(spec)
    out: dict[str, GGUFTensor] = {}
    for name, t in table.items():
        layer, _, rest = name.rpartition(".layers.")
        index, _, leaf = rest.partition(".")
        module = leaf.removesuffix(".weight")
        if not layer or module not in FUSED_PARTS or not leaf.endswith(".weight"):
            out[name] = t
            continue
        rows = sum(sizes[module])
        if len(t.shape) != 2 or t.shape[0] != rows or t.n_bytes % rows:
            raise CheckpointError(
                f"{path}: tensor '{t.gguf_name}' has shape {list(t.shape)}, expected [{rows}, in_features] "
                f"(the rows of {', '.join(p.split('.')[1] for p in FUSED_PARTS[module])} stacked, from its metadata)"
            )
        row_bytes, start = t.n_bytes // rows, 0
        for part, n in zip(FUSED_PARTS[module], sizes[module], strict=True):
            part_name = f"{layer}.layers.{index}.{part}.weight"
            out[part_name] = replace(
                t, hf_name=part_name, shape=(n, t.shape[1]), offset=t.offset + start * row_bytes, n_bytes=n * row_bytes
            )
            start += n
    return out


def rope_factors(header: GGUFHeader) -> dict[str, list[float]]:
    """The longrope factor tensors' values (phi3), by GGUF name: they belong in config.json."""
    from cpuserve.offline.gguf_convert import ROPE_FACTOR_TENSORS

    found = {}
    for t in header.tensors:
        if t.name in ROPE_FACTOR_TENSORS:
            if t.kind not in ("F32", "F16"):
                raise CheckpointError(f"{header.path}: tensor '{t.name}' has type {t.kind}, expected F32 or F16")
            with open(header.path, "rb") as f:
                f.seek(t.offset)
                raw = f.read(t.n_bytes)
            if len(raw) != t.n_bytes:
                raise CheckpointError(f"{header.path}: truncated: tensor '{t.name}' is cut short")
            found[t.name] = np.frombuffer(raw, dtype=np.float32 if t.kind == "F32" else np.float16).tolist()
    return found


def linear_scheme(kind: str) -> WeightQuant | None:
    """The kernels' scheme for a linear stored as `kind` (None: float, computed densely)."""
    if kind in FLOAT_TYPES:
        return None
    s = SCHEMES.get(kind)
    if s is None:
        return FALLBACK
    return WeightQuant(
        bits=s.bits, group_size=s.group, packed=False, offsets=s.offsets, act_groups=True, coding=s.coding, int6=s.int6
    )


def gguf_quant_config(table: dict[str, GGUFTensor], source: str) -> QuantConfig | None:
    """One group per scheme, targeting the linears stored in it (exact module names)."""
    by_scheme: dict[WeightQuant, list[str]] = {}
    for name, t in table.items():
        if _is_linear(name) and (quant := linear_scheme(t.kind)) is not None:
            by_scheme.setdefault(quant, []).append(name.removesuffix(".weight"))
    if not by_scheme:
        return None
    groups = [_Group(q.name, sorted(mods), q) for q, mods in sorted(by_scheme.items(), key=lambda kv: kv[0].name)]
    return QuantConfig(groups, [], source, label="GGUF")


class GGUFCheckpoint:
    """The loader's checkpoint protocol over a GGUF file (names, shapes, dtypes, get)."""

    def __init__(
        self, path: Path, table: dict[str, GGUFTensor], rows_of: Any, aliased: frozenset[str] | set[str] = frozenset()
    ) -> None:
        """rows_of(hf_name, array) puts an array in HF's layout (offline/gguf_convert.py's rules; for a
        quantized linear, the values, scales and offsets alike, whose rows are output channels)."""
        self.path, self.table, self._rows_of = path, table, rows_of
        self._virtual: dict[str, tuple[str, str]] = {}  # checkpoint name -> (weight name, part)
        for name, t in table.items():
            quant = linear_scheme(t.kind) if _is_linear(name) else None
            if quant is not None:
                prefix = name.removesuffix(".weight")
                if quant.coding is not None:  # the scales and offsets as the file codes them
                    parts = ["weight", *quant.coding.parts()]
                else:
                    parts = ["weight", "weight_scale"] + (["weight_offset"] if quant.offsets else [])
                for part in parts:
                    self._virtual[f"{prefix}.{part}"] = (name, part)
            else:
                self._virtual[name] = (name, "float")
        # Checkpoint names that repeat another tensor's data (a tied head read from the embedding):
        # memory of their own once packed, but no parameters of their own.
        self.aliases = {n for n, (base, _) in self._virtual.items() if base in aliased}
        self._decoded: tuple[str, DecodedWeight] | None = None
        # Parts of the cached decode not yet asked for: at zero the cache goes (a 2B's head decoded is
        # 330 MB, held otherwise while the loader packs it).
        self._unread: dict[str, int] = {}
        self._fd: int | None = None
        self.format_description = f"GGUF ({path.name}: {', '.join(sorted({t.kind for t in table.values()}))})"

    def names(self) -> list[str]:
        return list(self._virtual)

    def __contains__(self, name: str) -> bool:
        return name in self._virtual

    def file_of(self, name: str) -> Path:
        return self.path

    def shape(self, name: str) -> tuple[int, ...]:
        base, part = self._virtual[name]
        t = self.table[base]
        if part.startswith(("weight_scale", "weight_offset")):
            quant = linear_scheme(t.kind)
            groups = t.shape[1] // quant.group_size
            return quant.coding.part_shape(part, t.shape[0], groups) if quant.coding else (t.shape[0], groups)
        return t.shape

    def stored_dtype(self, name: str) -> str:
        base, part = self._virtual[name]
        if part == "weight":
            return "I8"
        if part == "float":
            return {"F16": "F16", "BF16": "BF16"}.get(self.table[base].kind, "F32")
        coding = linear_scheme(self.table[base].kind).coding
        if coding is None:
            return "F32"
        if part.endswith("super"):
            return "F16"  # the K-quants' d and -dmin, as the file holds them
        code = coding.offset_code if part.startswith("weight_offset") else coding.code
        return {"uint8": "U8", "int8": "I8", "float16": "F16"}[code]

    def _read(self, t: GGUFTensor) -> np.ndarray:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        data = os.pread(self._fd, t.n_bytes, t.offset)
        if len(data) != t.n_bytes:
            raise CheckpointError(f"{self.path}: truncated: tensor '{t.gguf_name}' is cut short")
        return np.frombuffer(data, dtype=np.uint8)

    def _float(self, t: GGUFTensor) -> np.ndarray:
        raw = self._read(t)
        if t.kind == "F32":
            data = raw.view(np.float32)
        elif t.kind == "F16":
            data = raw.view(np.float16).astype(np.float32)
        elif t.kind == "BF16":
            data = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif t.kind in SCHEMES:  # a quantized tensor the model uses as floats (the embedding)
            rows, cols = t.shape if len(t.shape) == 2 else (1, t.shape[0])
            data = decode(t.kind, raw, rows, cols, f"{self.path}: tensor '{t.gguf_name}'").dequantized()
        else:
            try:
                data = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[t.kind])
            except (NotImplementedError, KeyError) as exc:
                raise CheckpointError(
                    f"{self.path}: tensor '{t.gguf_name}' has type {t.kind}, which cpuserve cannot read ({exc})"
                ) from None
        return data.reshape(t.shape)

    def _decode(self, base: str) -> DecodedWeight:
        if self._decoded is not None and self._decoded[0] == base:
            return self._decoded[1]
        self._unread = {base: sum(b == base and part != "float" for b, part in self._virtual.values())}
        t = self.table[base]
        rows, cols = t.shape
        what = f"{self.path}: tensor '{t.gguf_name}'"
        if t.kind in SCHEMES:
            d = decode(t.kind, self._read(t), rows, cols, what)
            d = DecodedWeight(
                self._rows_of(base, d.values),
                self._rows_of(base, d.scales),
                None if d.offsets is None else self._rows_of(base, d.offsets),
                d.scheme,
                None if d.codes is None else d.codes.rows(lambda a: self._rows_of(base, a)),
            )
        else:
            d = _rounded_int8(self._rows_of(base, self._float(t)), t, what)
        self._decoded = (base, d)
        return d

    def quantized_table(self, name: str) -> DecodedWeight | None:
        """A float tensor the file holds quantized (the token embedding), as its decoded blocks, for a
        model that keeps it so (model/quantized_embedding.py); None when the file holds it in float."""
        base, part = self._virtual[name]
        t = self.table[base]
        if part != "float" or t.kind not in SCHEMES or len(t.shape) != 2:
            return None
        d = decode(t.kind, self._read(t), *t.shape, f"{self.path}: tensor '{t.gguf_name}'")
        offsets = None if d.offsets is None else self._rows_of(base, d.offsets)
        codes = None if d.codes is None else d.codes.rows(lambda a: self._rows_of(base, a))
        return DecodedWeight(self._rows_of(base, d.values), self._rows_of(base, d.scales), offsets, d.scheme, codes)

    def row_slices(self, prefix: str, rows: int) -> Iterator[tuple[int, DecodedWeight]] | None:
        """The output head's decoded blocks `rows` rows at a time, (first row, slice), decoded from
        the file slice by slice, so the loader packs each into the kernel's copy and the whole
        decoded head never exists (a 2B's Q6_K head decoded is 330 MB). None for other tensors
        (whose rows may be permuted: llama's q/k) and for types without a kernel scheme."""
        name = f"{prefix}.weight"
        if prefix != "lm_head" or name not in self._virtual:
            return None
        t = self.table[self._virtual[name][0]]
        if t.kind not in SCHEMES or len(t.shape) != 2:
            return None
        n, k = t.shape
        row_bytes = t.n_bytes // n
        what = f"{self.path}: tensor '{t.gguf_name}'"

        def slices() -> Iterator[tuple[int, DecodedWeight]]:
            for r0 in range(0, n, rows):
                r1 = min(n, r0 + rows)
                part = GGUFTensor(
                    t.gguf_name, t.kind, name, (r1 - r0, k), t.offset + r0 * row_bytes, (r1 - r0) * row_bytes
                )
                yield r0, decode(t.kind, self._read(part), r1 - r0, k, what)

        return slices()

    def get(self, name: str) -> torch.Tensor:
        base, part = self._virtual[name]
        t = self.table[base]
        if part == "float":
            array = self._rows_of(base, self._float(t))
            return torch.from_numpy(np.array(array, dtype=np.float32))
        d = self._decode(base)
        if part in ("weight", "weight_scale", "weight_offset"):
            array = {"weight": d.values, "weight_scale": d.scales, "weight_offset": d.offsets}[part]
        else:
            array = d.codes.part(part)
        self._unread[base] -= 1
        if self._unread[base] <= 0:  # every part handed out: the arrays now belong to the caller alone
            self._decoded = None
        if array.flags.c_contiguous and array.flags.writeable:  # the decode's own array: no copy
            return torch.from_numpy(array)
        return torch.from_numpy(np.array(array))

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self._virtual:
            yield name, self.get(name)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._decoded = None

    def __enter__(self) -> GGUFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_warned_types: set[str] = set()


def _rounded_int8(w: np.ndarray, t: GGUFTensor, what: str) -> DecodedWeight:
    """A type without a kernel scheme: dequantized, then int8 in groups of 32 (absmax scales)."""
    rows, cols = w.shape
    if cols % 32:
        raise CheckpointError(f"{what}: type {t.kind} with {cols} columns has no kernel scheme (needs 32 | K)")
    g = w.reshape(rows, cols // 32, 32).astype(np.float32)
    scales = np.maximum(np.abs(g).max(axis=-1), 1e-30) / 127.0
    values = np.clip(np.rint(g / scales[:, :, None]), -127, 127).astype(np.int8)
    scheme = SCHEMES["Q8_0"]
    d = DecodedWeight(values.reshape(rows, cols), scales.astype(np.float32), None, scheme)
    if t.kind not in _warned_types:
        _warned_types.add(t.kind)
        err = np.sqrt(np.mean((d.dequantized() - w) ** 2) / max(np.mean(w.astype(np.float64) ** 2), 1e-30))
        log.warning(
            "GGUF type %s has no kernel scheme: its tensors are dequantized and rounded to W8A8-G32 "
            "(int8 per 32 weights; relative RMS error %.2e on %s, more memory than %s)",
            t.kind,
            err,
            t.gguf_name,
            t.kind,
        )
    return d


def write_pointer(directory: Path, gguf_path: Path) -> None:
    st = gguf_path.stat()
    pointer = {"file": str(gguf_path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    (directory / POINTER_FILE).write_text(json.dumps(pointer, indent=2))


def read_pointer(directory: Path) -> Path | None:
    """The GGUF file a model directory stands for (None: an ordinary HF directory)."""
    p = directory / POINTER_FILE
    if not p.is_file():
        return None
    try:
        pointer = json.loads(p.read_text())
        path = Path(pointer["file"])
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{p}: not a GGUF pointer cpuserve wrote (remove {directory})") from None
    if not path.is_file():
        raise CheckpointError(f"{p}: the GGUF file it points at, {path}, is missing")
    st = path.stat()
    if (st.st_size, st.st_mtime_ns) != (pointer["size"], pointer["mtime_ns"]):
        raise CheckpointError(f"{p}: {path} changed since this directory was made from it (remove {directory})")
    return path


def _in_hf_layout(arch: str, table: dict[str, GGUFTensor], spec: Any) -> Any:
    """What llama.cpp's converter did to a tensor, undone as `cpuserve convert` undoes it (one
    implementation, offline/gguf_convert.py): a llama model's q/k rows permuted for its rope (so
    every row-indexed array of those: float weights, int values, scales, offsets), Gemma's +1 on
    every norm weight (floats only)."""
    from cpuserve.offline.gguf_convert import to_hf_layout

    heads = {"num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads}

    def layout(hf_name: str, array: np.ndarray) -> np.ndarray:
        return to_hf_layout(arch, table[hf_name].gguf_name, array, heads)

    return layout


def open_gguf_weights(gguf_path: Path, spec: Any) -> tuple[QuantConfig | None, GGUFCheckpoint]:
    """The quant config and checkpoint of a GGUF file (its header read, no tensor data)."""
    from cpuserve.offline.gguf_convert import ROPE_FACTOR_TENSORS, gguf_architecture, hf_name

    header = read_header(gguf_path)
    arch = gguf_architecture(header.metadata, gguf_path)
    table = read_tensor_table(header, lambda name: hf_name(name, arch), skip=frozenset(ROPE_FACTOR_TENSORS))
    table = split_fused(table, spec, gguf_path)
    embedding = table.get("model.embed_tokens.weight")
    aliased: set[str] = set()  # tensors that repeat another's data
    if not spec.tie_word_embeddings and "lm_head.weight" not in table and embedding is not None:
        # A tied file whose directory says untied (make_model_dir): the head is the embedding's own
        # quantized data on the kernels, as llama.cpp runs it, not a float matmul over the vocabulary.
        table["lm_head.weight"] = replace(embedding, hf_name="lm_head.weight")
        aliased.add("lm_head.weight")
    checkpoint = GGUFCheckpoint(gguf_path, table, _in_hf_layout(arch, table, spec), aliased)
    return gguf_quant_config(table, str(gguf_path)), checkpoint


def make_model_dir(gguf_path: Path, out: Path) -> Path:
    """The directory a GGUF is served through: config.json and tokenizer files from its metadata,
    and the pointer to the file (a few MB at most, written once; the weights stay in the file)."""
    from cpuserve.model.checkpoint import atomic_directory
    from cpuserve.offline.gguf_convert import hf_config, tokenizer_files

    header = read_header(gguf_path, arrays=True)
    meta = header.metadata
    names = {t.name for t in header.tensors}
    config = hf_config(meta, tied="output.weight" not in names, source=gguf_path, rope_factors=rope_factors(header))
    embedding = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    if config["tie_word_embeddings"] and embedding is not None and embedding.kind in SCHEMES:
        # The output head reads the embedding's quantized blocks on the kernels (open_gguf_weights);
        # the embedding itself is dequantized for the lookup.
        config["tie_word_embeddings"] = False
        log.info("%s: tied %s embedding: the output head runs it on the kernels", gguf_path.name, embedding.kind)
    with atomic_directory(out, force=True) as partial:
        for fname, text in tokenizer_files(meta, config, gguf_path).items():
            (partial / fname).write_text(text)
        (partial / "config.json").write_text(json.dumps(config, indent=2))
        write_pointer(partial, gguf_path)
    return out
