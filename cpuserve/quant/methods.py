"""Quant methods: one object per scheme that owns a linear layer's weights from checkpoint to kernel.

Each method (after vLLM's QuantizeMethodBase) has the same four steps:
- `create_weights(layer)`: the tensors the checkpoint holds, named as there (empty, on the device
  the model is built on);
- `load_shard(layer, shard, prefix, ckpt)`: one checkpoint module's tensors, checked (name, shape,
  dtype, values) and copied into that shard's rows: q/k/v fill one fused qkv_proj, gate/up one
  gate_up_proj, and nothing is concatenated or repacked afterwards;
- `process_weights_after_loading(layer, kernel)`: the only place that packs, once, into the layout
  of the kernel chosen at start (or, without one, the int8 values the reference forward reads);
- `apply(layer, x)`: the forward.
`native_linear(layer, kernels)` gives native decode an opaque handle to the packed weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from cpuserve.errors import CheckpointError
from cpuserve.quant import offsets_layout
from cpuserve.quant.config import WeightQuant
from cpuserve.quant.packing import (
    panel_scale_index,
    unpack_int,
    unpack_int6,
    unpack_int8,
    unpack_nibbles,
    unpack_rows,
)
from cpuserve.quant.reference import reference_forward
from cpuserve.quant.scale_codes import ScaleCoding, activation_block, expand_offsets, expand_scales

FLOAT_SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CODE_PARTS = ("scale_code", "scale_super", "offset_code", "offset_super")  # a coded layer's buffers


def _tensor(a: Any) -> torch.Tensor | None:
    return None if a is None else torch.from_numpy(a)


@dataclass(frozen=True)
class KernelChoice:
    """The native kernels and the variant chosen once at start for every quantized linear."""

    kernels: ModuleType
    variant: Any  # the variant's table row (kernels.variant(name)), equal to its name


def select_kernel() -> KernelChoice | None:
    """The platform's (or CPUSERVE_ISA's) variant, None for the pure-torch reference path."""
    from cpuserve.kernels import native, selected_variant

    variant = selected_variant()
    kernels = native() if variant != "reference" else None
    return KernelChoice(kernels, variant) if kernels is not None else None


class Checkpoint(Protocol):
    def get(self, name: str) -> torch.Tensor: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def file_of(self, name: str) -> Any: ...


def _checked_shape(ckpt: Checkpoint, name: str, shape: tuple[int, ...], what: str) -> None:
    """Before any data is read: the tensor's shape is the one expected, else the error naming it."""
    if tuple(ckpt.shape(name)) != shape:
        raise CheckpointError(
            f"{ckpt.file_of(name)}: tensor '{name}' has shape {list(ckpt.shape(name))}, expected {list(shape)} {what}"
        )


def fetch(
    ckpt: Checkpoint, name: str, shape: tuple[int, ...], kinds: tuple[torch.dtype, ...], what: str
) -> torch.Tensor:
    """A checkpoint tensor with the expected shape and one of the expected dtypes, else the error
    naming the file, the tensor, what it is and what was expected."""
    _checked_shape(ckpt, name, shape, what)
    t = ckpt.get(name)
    if t.dtype not in kinds:
        raise CheckpointError(
            f"{ckpt.file_of(name)}: tensor '{name}' has dtype {t.dtype}, expected "
            f"{' or '.join(str(d) for d in kinds)} {what}"
        )
    return t


def fetch_float(ckpt: Checkpoint, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A float checkpoint tensor (any float dtype: the model converts it) of the expected shape."""
    _checked_shape(ckpt, name, shape, "from config.json")
    t = ckpt.get(name)
    if not t.is_floating_point():
        raise CheckpointError(
            f"{ckpt.file_of(name)}: tensor '{name}' has dtype {t.dtype}, "
            "expected a floating-point dtype (float32, bfloat16 or float16)"
        )
    return t


def _real(layer: Any, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The layer's buffer `name`, allocated in memory at the first shard (the model is built on meta)."""
    t = getattr(layer, name)
    if t is None or t.is_meta:
        t = torch.empty(shape, dtype=dtype)
        setattr(layer, name, t)
    return t


def exact_storage_dtype(w: torch.Tensor) -> torch.dtype:
    """The narrowest float type that holds every value of w exactly: a bf16 or fp16 checkpoint loaded
    in float32 (`--dtype auto` on a CPU without native 16-bit dot products) is stored as it came."""
    for dtype in (torch.bfloat16, torch.float16):
        if w.dtype == dtype or (w.dtype == torch.float32 and torch.equal(w.to(dtype).float(), w)):
            return dtype
    return w.dtype


@dataclass(frozen=True)
class DenseMethod:
    """An unquantized linear. With the native kernels its weight becomes float panels of the
    narrowest exact type (kernels/csrc/float_panels.h: widened in registers, fp32 sums) and the float
    tensor is let go; without them, torch's matmul in the compute dtype."""

    dtype: torch.dtype
    quant = None
    name = "dense"

    def create_weights(self, layer: Any) -> None:
        weight = torch.empty(layer.out_features, layer.in_features, dtype=self.dtype)
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)

    def checkpoint_tensors(self, prefix: str, n: int, k: int) -> dict[str, tuple[int, ...]]:
        return {f"{prefix}.weight": (n, k)}

    def load_shard(self, layer: Any, shard: int, prefix: str, ckpt: Checkpoint) -> None:
        name, rows = f"{prefix}.weight", layer.shard_rows(shard)
        t = fetch_float(ckpt, name, (rows.stop - rows.start, layer.in_features))
        if layer.weight.is_meta:
            layer.weight = torch.nn.Parameter(torch.empty(layer.weight.shape, dtype=self.dtype), requires_grad=False)
        layer.weight.data[rows].copy_(t)  # converted in place: no second full-size copy (a float32 head: 1 GB)

    def process_weights_after_loading(self, layer: Any, kernel: KernelChoice | None) -> None:
        """Packs into float panels when a kernel was chosen; the layer's weight attribute is then a
        meta tensor (a tied head's embedding stays with the embedding)."""
        layer.kernel = kernel
        if kernel is None:
            return
        w = layer.weight.data
        layer.packed = kernel.kernels.pack_float(w.to(exact_storage_dtype(w)))
        layer.weight = torch.nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        kernel = getattr(layer, "kernel", None)
        if kernel is None:
            return F.linear(x, layer.weight, layer.bias)
        y = kernel.kernels.float_linear(
            x.reshape(-1, x.shape[-1]), layer.packed, layer.out_features, layer.bias, kernel.variant
        )
        return y.view(*x.shape[:-1], layer.out_features)

    def native_linear(self, layer: Any, kernels: Any) -> Any:
        kernel = getattr(layer, "kernel", None)
        if kernel is None:
            return kernels.NativeLinear(0, layer.weight, torch.empty(0), layer.bias, None)
        return kernels.NativeLinear(3, layer.packed, torch.empty(0), layer.bias, kernel.variant, n=layer.out_features)

    def storage(self, layer: Any) -> str:
        """What holds the weight, for the start-up log."""
        if getattr(layer, "kernel", None) is None:
            return f"torch {str(layer.weight.dtype).removeprefix('torch.')}"
        return f"native {layer.kernel.variant} float panels, {str(layer.packed.dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class IntWeightMethod:
    """W8A8 (int8 per output channel or per group) and W4A8 (int4 per group), int8 per-token
    activations, optionally with a per-group offset (w = s * q + offset; GGUF's formats with a
    minimum, read through model/gguf_source.py).

    From the checkpoint: `weight` int8 [N, K] (int-quantized) or `weight_packed` int32 words plus
    `weight_shape` (pack-quantized), `weight_scale` [N, G] and, with offsets, `weight_offset` [N, G];
    a GGUF scheme (quant.coding) has its scales and offsets as the file codes them instead
    (`weight_scale_code`, `weight_scale_super`, ...: quant/scale_codes.py), held as such.
    After processing, on a kernel: `packed` in the kernel's layout (`packed_layout`) and, for int4
    and grouped int8, `kernel_scales` in its order, and `kernel_offsets` in the driver's column chunks
    (quant/offsets_layout.py; `offsets` then dropped); coded, the codes in those orders and their
    factors in the same orders (`kernel_scale_super`, `kernel_offset_super`). W8A8 on a kernel whose
    layout is the int8 rows themselves keeps `qweight`. A quant.int6 weight (values in [-32, 31]) on a
    variant with int6 panels is packed as those (`int6_panel`) and run by the W4A8 kernel.
    Without a kernel: `qweight` int8 [N, K] and fp32 `scales` (`offsets`) for the reference forward."""

    quant: WeightQuant
    dtype: torch.dtype

    @property
    def name(self) -> str:
        return self.quant.name

    def groups(self, k: int) -> int:
        return k // self.quant.group_size if self.quant.group_size else 1

    @property
    def coding(self) -> ScaleCoding | None:
        return self.quant.coding

    def create_weights(self, layer: Any) -> None:
        n, k = layer.out_features, layer.in_features
        words = -(-k * self.quant.bits // 32)
        layer.register_buffer("qweight", None if self.quant.packed else torch.empty(n, k, dtype=torch.int8))
        layer.register_buffer("weight_words", torch.empty(n, words, dtype=torch.int32) if self.quant.packed else None)
        coding, groups = self.coding, self.groups(k)
        layer.register_buffer("scales", torch.empty(n, groups, dtype=torch.float32) if coding is None else None)
        offsets = torch.empty(n, groups, dtype=torch.float32) if self.quant.offsets and coding is None else None
        layer.register_buffer("offsets", offsets)
        for part in _CODE_PARTS:  # the codes as the checkpoint holds them (quant/scale_codes.py)
            name = f"weight_{part}"
            held = coding is not None and name in coding.parts()
            layer.register_buffer(
                part, torch.empty(coding.part_shape(name, n, groups), dtype=self._part_dtype(name)) if held else None
            )
        layer.packed, layer.packed_layout, layer.kernel_scales, layer.kernel = None, "none", None, None
        layer.kernel_offsets, layer.kernel_scale_super, layer.kernel_offset_super = None, None, None

    def _part_dtype(self, name: str) -> torch.dtype:
        """The dtype of a coded checkpoint part."""
        if name.endswith("super"):
            return torch.float16  # GGUF's d and -dmin, as the file holds them
        return self.coding.offset_dtype if name.startswith("weight_offset") else self.coding.code_dtype

    def checkpoint_tensors(self, prefix: str, n: int, k: int) -> dict[str, tuple[int, ...]]:
        if self.coding is not None:
            shapes = {f"{prefix}.{p}": self.coding.part_shape(p, n, self.groups(k)) for p in self.coding.parts()}
        else:
            shapes = {f"{prefix}.weight_scale": (n, self.groups(k))}
        if self.quant.offsets and self.coding is None:
            shapes[f"{prefix}.weight_offset"] = (n, self.groups(k))
        if self.quant.packed:
            shapes[f"{prefix}.weight_packed"] = (n, -(-k * self.quant.bits // 32))
            shapes[f"{prefix}.weight_shape"] = (2,)
        else:
            shapes[f"{prefix}.weight"] = (n, k)
        return shapes

    def load_shard(self, layer: Any, shard: int, prefix: str, ckpt: Checkpoint) -> None:
        quant, k, rows = self.quant, layer.in_features, layer.shard_rows(shard)
        n = rows.stop - rows.start
        if quant.group_size and k % quant.group_size:
            raise CheckpointError(
                f"{prefix}: {quant.name} needs the input size {k} to be a multiple of the group size {quant.group_size}"
            )
        shapes = self.checkpoint_tensors(prefix, n, k)
        what = f"for {quant.name} ({n} x {k})"

        def get(suffix: str, kinds: tuple[torch.dtype, ...]) -> torch.Tensor:
            name = f"{prefix}.{suffix}"
            return fetch(ckpt, name, shapes[name], kinds, what)

        if self.coding is not None:
            for name in self.coding.parts():
                part = get(name, (self._part_dtype(name),))
                self._check_values(ckpt, prefix, coded={name: part})
                attr = name.removeprefix("weight_")
                _real(layer, attr, getattr(layer, attr).shape, part.dtype)[rows] = part
        else:
            scale = get("weight_scale", FLOAT_SCALE_DTYPES).float()
            self._check_values(ckpt, prefix, scale=scale)
            _real(layer, "scales", layer.scales.shape, torch.float32)[rows] = scale
        if quant.packed:
            shape = get("weight_shape", (torch.int32, torch.int64)).tolist()
            if shape != [n, k]:
                name = f"{prefix}.weight_shape"
                raise CheckpointError(
                    f"{ckpt.file_of(name)}: tensor '{name}' says {shape}, expected {[n, k]} from config.json"
                )
            words = get("weight_packed", (torch.int32,))
            _real(layer, "weight_words", layer.weight_words.shape, torch.int32)[rows] = words
        else:
            q = get("weight", (torch.int8,))
            self._check_values(ckpt, prefix, q=q)
            _real(layer, "qweight", layer.qweight.shape, torch.int8)[rows] = q
        if quant.offsets and self.coding is None:
            offset = get("weight_offset", (torch.float32,))
            self._check_values(ckpt, prefix, offset=offset)
            _real(layer, "offsets", layer.offsets.shape, torch.float32)[rows] = offset

    def load_packed(self, layer: Any, prefix: str, ckpt: Checkpoint, slices: Any, kernel: KernelChoice) -> bool:
        """load_shard and process_weights_after_loading in one, for a one-shard layer whose checkpoint
        hands its decoded rows out in slices ((first row, DecodedWeight), rows a multiple of 16):
        each slice checked and packed into the kernel's copies, which are what a whole pack gives
        (a panel's bytes, its scales and a chunk's offsets are rows 16p.. of each, in order). Peak:
        the packed weight and one slice, not the decoded weight, its int8 copy and the packed one.
        False (nothing done) when the layer does not fit the kernel or has more than one shard."""
        n, k = layer.out_features, layer.in_features
        if len(layer.output_sizes) != 1 or not self.fits(k) or layer.bias is not None:
            return False
        mod, variant, groups = kernel.kernels, kernel.variant, self.groups(k)
        bits4, int6 = self.quant.bits == 4, self.holds_int6(kernel, n, k)
        layout = "int6_panel" if int6 else mod.int4_layout(variant) if bits4 else mod.int8_layout(variant)
        kernel_order = bits4 or bool(self.quant.group_size)  # scales in pack_scales' order, as a whole pack
        packed: torch.Tensor | None = None  # shaped like the first slice's pack: the layout's own width
        coding = self.coding
        supers = groups // coding.per if coding is not None and coding.per else 0
        code, off_code = (coding.code_dtype, coding.offset_dtype) if coding is not None else (torch.float32,) * 2
        scales = torch.empty(n, groups, dtype=code)
        scale_super = torch.empty(n, supers, dtype=torch.float16) if supers else None
        offsets = torch.empty(n * groups, dtype=off_code) if self.quant.offsets else None
        offset_super = torch.empty(n * supers, dtype=torch.float16) if supers and offsets is not None else None
        what = f"for {self.quant.name} ({n} x {k})"
        for name, shape in self.checkpoint_tensors(prefix, n, k).items():  # before any data is read
            _checked_shape(ckpt, name, shape, what)
        file, covered = ckpt.file_of(f"{prefix}.weight"), 0
        for r0, d in slices:
            r1 = r0 + d.values.shape[0]
            if r0 % 16 or r1 > n or d.values.shape[1] != k or d.scales.shape != (r1 - r0, groups):
                raise CheckpointError(f"{file}: tensor '{prefix}.weight': rows {r0}..{r1} do not fit {what}")
            if r0 != covered or (d.offsets is None) == bool(self.quant.offsets):
                raise CheckpointError(f"{file}: tensor '{prefix}.weight': rows {r0}..{r1} do not follow row {covered}")
            covered = r1
            q, scale = torch.from_numpy(d.values), torch.from_numpy(d.scales)
            offset = None if d.offsets is None else torch.from_numpy(d.offsets)
            if coding is not None:  # each coded part checked under its own name
                if d.codes is None:
                    raise CheckpointError(f"{file}: tensor '{prefix}.weight': rows {r0}..{r1} have no codes {what}")
                self._check_values(ckpt, prefix, q, coded={p: _tensor(d.codes.part(p)) for p in coding.parts()})
            else:
                self._check_values(ckpt, prefix, q, scale, offset)
            pack = mod.pack_int6 if int6 else mod.pack_int4 if bits4 else mod.pack_int8  # "signed": q itself
            part = pack(q, variant)
            if packed is None:
                packed = torch.empty(n, part.shape[1], dtype=part.dtype)
            packed[r0:r1] = part
            if coding is not None:  # the codes and factors, each in the order of what it codes
                scale, offset = torch.from_numpy(d.codes.scale_code), _tensor(d.codes.offset_code)
                if scale_super is not None:
                    scale_super[r0:r1] = mod.pack_scales(torch.from_numpy(d.codes.scale_super), variant)
                if offset_super is not None:
                    chunks = offsets_layout.to_chunks(torch.from_numpy(d.codes.offset_super))
                    offset_super[r0 * supers : r1 * supers] = chunks
            scales[r0:r1] = mod.pack_scales(scale, variant) if kernel_order else scale
            if offsets is not None:
                offsets[r0 * groups : r1 * groups] = offsets_layout.to_chunks(offset)
        if covered != n:
            raise CheckpointError(f"{file}: tensor '{prefix}.weight' ends at row {covered}, expected {n} {what}")
        layer.qweight, layer.weight_words, layer.offsets = None, None, None
        for part in _CODE_PARTS:  # the meta placeholders create_weights registered
            setattr(layer, part, None)
        layer.packed_layout = layout
        if layout == "signed":
            layer.qweight = packed
        else:
            layer.packed = packed
        if kernel_order or coding is not None:
            layer.kernel_scales, layer.scales = scales, None
        else:
            layer.scales = scales
        layer.kernel_offsets, layer.kernel_scale_super, layer.kernel_offset_super = offsets, scale_super, offset_super
        layer.kernel = kernel
        return True

    def _check_values(
        self,
        ckpt: Checkpoint,
        prefix: str,
        q: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
        offset: torch.Tensor | None = None,
        coded: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """What a checkpoint's int values, scales and offsets (or coded parts, by name) may not hold
        (whichever are given), named by tensor and file. Negative scales are fine: w = q * s either way."""

        def refuse(part: str, what: str) -> None:
            name = f"{prefix}.{part}"
            raise CheckpointError(f"{ckpt.file_of(name)}: tensor '{name}' {what}")

        bits = self.quant.bits  # (int6 values come from the file's 5- or 6-bit fields; pack_int6 checks them)
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        if q is not None and bits < 8 and (q.min() < lo or q.max() > hi):
            refuse("weight", f"holds values outside [{lo}, {hi}] for {self.quant.name}")
        if scale is not None and not torch.isfinite(scale).all():
            refuse("weight_scale", "has non-finite scales")
        if offset is not None and not torch.isfinite(offset).all():
            refuse("weight_offset", "has non-finite offsets")
        for name, part in (coded or {}).items():
            if part.is_floating_point() and not torch.isfinite(part).all():
                refuse(name.removeprefix(f"{prefix}."), "has non-finite values")

    def set_weights(self, layer: Any, qweight: torch.Tensor, scales: torch.Tensor) -> None:
        """Int8 values and scales made in memory (the output head quantized at load), in place of
        load_shard; process_weights_after_loading follows as for a checkpoint."""
        layer.qweight, layer.weight_words, layer.scales = qweight.contiguous(), None, scales.float().contiguous()

    def fits(self, k: int) -> bool:
        group = self.quant.group_size or k
        if self.quant.bits == 8 and self.quant.group_size:  # int8 groups: whole quads (Q6_K's 16)
            return group % 4 == 0 and k % group == 0
        return k % 32 == 0 and group % 32 == 0

    def holds_int6(self, kernel: KernelChoice, n: int, k: int) -> bool:
        """Whether this weight is held as int6 panels on `kernel` (quant.int6 values, a variant with
        them, whole panels): 6 bits a weight a decode step reads instead of 8."""
        return self.quant.int6 and bool(kernel.variant.int6) and n % 16 == 0 and k % 32 == 0 and self.fits(k)

    def process_weights_after_loading(self, layer: Any, kernel: KernelChoice | None) -> None:
        """Pack once for `kernel` (or unpack the words for the reference path, when there is none
        or the shapes do not fit it); the checkpoint's copies are dropped."""
        k, bits4 = layer.in_features, self.quant.bits == 4
        if kernel is not None and layer.kernel is kernel:
            return  # already packed for it
        if layer.weight_words is not None and (not bits4 or kernel is None or not self.fits(k)):
            # int4 words go straight to the kernel's nibbles below; everything else needs the values
            layer.qweight, layer.weight_words = unpack_int(layer.weight_words, self.quant.bits, k), None
        if kernel is None or not self.fits(k):
            if self.coding is not None:  # the reference forward reads fp32
                layer.scales, layer.offsets = self.weight_scales(layer), self.weight_offsets(layer)
                for part in _CODE_PARTS:
                    setattr(layer, part, None)
            return
        mod, variant = kernel.kernels, kernel.variant
        if self.coding is not None:  # the codes, packed as the fp32 values they stand for would be
            layer.scales, layer.offsets = layer.scale_code, layer.offset_code
            if layer.scale_super is not None:
                layer.kernel_scale_super = mod.pack_scales(layer.scale_super, variant)
            if layer.offset_super is not None:
                layer.kernel_offset_super = offsets_layout.to_chunks(layer.offset_super)
            for part in _CODE_PARTS:
                setattr(layer, part, None)
        if bits4:
            if layer.weight_words is not None:  # straight to the kernel's layout: no int8 copy of the weight
                layer.packed = mod.words_to_nibbles(layer.weight_words, k, variant)
            else:
                layer.packed = mod.pack_int4(layer.qweight, variant)
            layer.qweight, layer.weight_words = None, None
            layer.packed_layout = mod.int4_layout(variant)
            layer.kernel_scales, layer.scales = mod.pack_scales(layer.scales, variant), None
        else:
            if self.holds_int6(kernel, layer.out_features, k):
                layer.packed_layout = "int6_panel"
                layer.packed, layer.qweight = mod.pack_int6(layer.qweight, variant), None
            else:
                layer.packed_layout = mod.int8_layout(variant)
            if layer.packed_layout not in ("signed", "int6_panel"):  # "signed": the int8 rows as they are
                layer.packed, layer.qweight = mod.pack_int8(layer.qweight, variant), None
            if self.quant.group_size:
                layer.kernel_scales, layer.scales = mod.pack_scales(layer.scales, variant), None
        if layer.offsets is not None:  # the driver's order; one copy kept (weight_offsets reads it back)
            layer.kernel_offsets, layer.offsets = offsets_layout.to_chunks(layer.offsets), None
        layer.kernel = kernel

    def int_weight(self, layer: Any) -> torch.Tensor:
        """The int8 values [N, K], whatever layout holds them now."""
        if layer.qweight is not None:
            return layer.qweight
        if layer.weight_words is not None:
            return unpack_int(layer.weight_words, self.quant.bits, layer.in_features)
        if layer.packed_layout == "int6_panel":
            return unpack_int6(layer.packed, layer.in_features)
        if self.quant.bits == 8:
            return unpack_int8(layer.packed, layer.in_features, layer.packed_layout)
        return unpack_nibbles(layer.packed, layer.in_features, layer.packed_layout)

    def weight_scales(self, layer: Any) -> torch.Tensor:
        """The fp32 scales [N, G] in the checkpoint's order, whatever holds them (codes expanded)."""
        if layer.scales is not None:
            return layer.scales
        groups = self.groups(layer.in_features)
        if layer.kernel_scales is None:  # coded, not packed yet
            return expand_scales(layer.scale_code, layer.scale_super, self.coding.per)
        codes = self._in_checkpoint_order(layer, layer.kernel_scales, groups)
        if self.coding is None:
            return codes
        supers = layer.kernel_scale_super
        supers = None if supers is None else self._in_checkpoint_order(layer, supers, groups // self.coding.per)
        return expand_scales(codes, supers, self.coding.per)

    def _in_checkpoint_order(self, layer: Any, packed: torch.Tensor, groups: int) -> torch.Tensor:
        """Values [N, groups] packed by pack_scales read back in the checkpoint's order. Once packed,
        only the kernel's copy is kept (two copies cost a 2B GGUF 333 MB): each position's source
        index packed the same way (in two halves of 12 bits, each exact in float32; 0: padding)."""
        n = layer.out_features
        mod, variant = layer.kernel.kernels, layer.kernel.variant
        index = torch.arange(1, n * groups + 1, dtype=torch.int64).view(n, groups)
        high = mod.pack_scales((index >> 12).float(), variant).long()
        low = mod.pack_scales((index & 4095).float(), variant).long()
        source = (high << 12) | low
        kept = source > 0
        values = torch.empty(n * groups, dtype=packed.dtype)
        values[source[kept] - 1] = packed.reshape(-1)[kept.view(-1)]
        return values.view(n, groups)

    def weight_offsets(self, layer: Any) -> torch.Tensor | None:
        """The fp32 offsets [N, G] in the checkpoint's order (None for a scheme without), whatever holds
        them (codes expanded)."""
        n, groups = layer.out_features, self.groups(layer.in_features)
        coding = self.coding
        if layer.offsets is not None:
            return layer.offsets
        if coding is None or coding.offset_code is None:
            if layer.kernel_offsets is None:
                return None
            return offsets_layout.from_chunks(layer.kernel_offsets, n, groups)
        if layer.kernel_offsets is None:  # coded, not packed yet
            codes, supers = layer.offset_code, layer.offset_super
        else:
            codes = offsets_layout.from_chunks(layer.kernel_offsets, n, groups)
            supers = layer.kernel_offset_super
            supers = None if supers is None else offsets_layout.from_chunks(supers, n, groups // coding.per)
        return expand_offsets(self.weight_scales(layer), codes, supers, coding.per, coding.mid)

    def weight_rows(self, layer: Any, rows: torch.Tensor) -> torch.Tensor:
        """Rows (output channels) of the dequantized weight, fp32 [len(rows), K], read from whatever
        holds them (the kernel's layout too): values * scale (+ offset), as dequantized_weight gives
        them. A tied GGUF embedding is looked up here, in its head's packed copy."""
        n, k, groups = layer.out_features, layer.in_features, self.groups(layer.in_features)
        if layer.qweight is not None or layer.weight_words is not None:
            values = self.int_weight(layer)[rows]
        else:
            values = unpack_rows(layer.packed, layer.packed_layout, self.quant.bits, n, k, rows)
        coding = self.coding
        if layer.scales is not None or layer.kernel_scales is None:
            scales = self.weight_scales(layer)[rows]
        else:
            scales = self._packed_rows(layer, layer.kernel_scales, groups, rows)
            if coding is not None:
                supers = layer.kernel_scale_super
                if supers is not None:
                    supers = self._packed_rows(layer, supers, groups // coding.per, rows)
                scales = expand_scales(scales, supers, coding.per)
        w = values.float().view(len(rows), groups, k // groups) * scales.unsqueeze(-1)
        if layer.offsets is not None or layer.kernel_offsets is None:
            offsets = self.weight_offsets(layer)
            offsets = None if offsets is None else offsets[rows]
        else:
            offsets = layer.kernel_offsets[offsets_layout.chunk_index(n, groups, rows)]
            if coding is not None and coding.offset_code is not None:
                supers = layer.kernel_offset_super
                if supers is not None:
                    supers = supers[offsets_layout.chunk_index(n, groups // coding.per, rows)]
                offsets = expand_offsets(scales, offsets, supers, coding.per, coding.mid)
        if offsets is not None:
            w = w + offsets.unsqueeze(-1)
        return w.view(len(rows), k)

    def _packed_rows(self, layer: Any, packed: torch.Tensor, groups: int, rows: torch.Tensor) -> torch.Tensor:
        """Rows [len(rows), groups] of values packed by pack_scales (scales, their factors)."""
        if layer.packed_layout.endswith("panel"):
            return packed.reshape(-1)[panel_scale_index(layer.out_features, groups, rows)]
        return packed.view(layer.out_features, groups)[rows]

    def dequantized_weight(self, layer: Any) -> torch.Tensor:
        n, k = layer.out_features, layer.in_features
        scales = self.weight_scales(layer)
        w = self.int_weight(layer).float().view(n, -1, k // scales.shape[1]) * scales.unsqueeze(-1)
        offsets = self.weight_offsets(layer)
        if offsets is not None:
            w = w + offsets.unsqueeze(-1)
        return w.view(n, k)

    def kernel_operands(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed weight and the scales in the kernel's order, as w8a8_linear / w4a8_linear and
        NativeLinear take them (also the vLLM plugin's custom op, vllm_plugin/kernels.py)."""
        if self.quant.bits == 4 or layer.packed_layout == "int6_panel":
            return layer.packed, layer.kernel_scales
        weight = layer.qweight if layer.qweight is not None else layer.packed
        scales = layer.kernel_scales if layer.kernel_scales is not None else layer.scales.view(-1)
        return weight, scales

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        kernel = layer.kernel
        if kernel is None:
            return reference_forward(
                x,
                self.int_weight(layer),
                layer.scales,
                layer.bias,
                layer.offsets,
                self.quant.act_groups,
                activation_block(self.coding, self.quant.group_size),
            )
        weight, scales = self.kernel_operands(layer)
        return native_int_linear(
            kernel,
            self.kernel_bits(layer),
            x,
            weight,
            scales,
            layer.bias,
            layer.kernel_offsets,
            self.quant.act_groups,
            layer.out_features,
            **self.coded_operands(layer),
        )

    def kernel_bits(self, layer: Any) -> int:
        """4 when the W4A8 kernel runs this layer (int4, and int6 panels: nibbles plus a plane), else 8."""
        return 4 if self.quant.bits == 4 or layer.packed_layout == "int6_panel" else 8

    def coded_operands(self, layer: Any) -> dict[str, Any]:
        """The kernels' arguments for coded scales (their factors and mid), none for fp32 ones."""
        if self.coding is None:
            return {}
        return {
            "scale_super": layer.kernel_scale_super,
            "offset_super": layer.kernel_offset_super,
            "mid": self.coding.mid,
        }

    def native_linear(self, layer: Any, kernels: Any) -> Any | None:
        kernel = layer.kernel
        if kernel is None:
            return None
        weight, scales = self.kernel_operands(layer)
        kind = 2 if self.kernel_bits(layer) == 4 else 1
        return kernels.NativeLinear(
            kind,
            weight,
            scales,
            layer.bias,
            kernel.variant,
            layer.kernel_offsets,
            self.quant.act_groups,
            **self.coded_operands(layer),
        )


def native_int_linear(
    kernel: KernelChoice,
    bits: int,
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    offsets: torch.Tensor | None,
    act_groups: bool,
    out_features: int,
    **coded: Any,
) -> torch.Tensor:
    """The native W4A8 / W8A8 linear on IntWeightMethod's kernel operands, any leading shape: what
    IntWeightMethod.apply runs, and the vLLM plugin's custom op (vllm_plugin/kernels.py). bits: 4 for
    the W4A8 kernel (int6 panels too: it tells them by their width). coded: coded scales' factors and
    mid (IntWeightMethod.coded_operands)."""
    linear = kernel.kernels.w4a8_linear if bits == 4 else kernel.kernels.w8a8_linear
    y = linear(x.reshape(-1, x.shape[-1]), weight, scales, bias, kernel.variant, offsets, act_groups, **coded)
    return y.view(*x.shape[:-1], out_features)


def method_for(quant: WeightQuant | None, dtype: torch.dtype) -> DenseMethod | IntWeightMethod:
    return DenseMethod(dtype) if quant is None else IntWeightMethod(quant, dtype)
