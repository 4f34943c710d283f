"""The quant schemes: what a quantized Linear's checkpoint holds, its layout after load, and its
reference forward.

After load every scheme holds `qweight` int8 [N, K] (int4 values in [-8, 7], int8 in [-128, 127]),
or for int4 on a native kernel only `packed` (the kernel's nibble layout, made straight from the
checkpoint's words), and `scales` fp32 [N, G] with G = K / group_size (1 for channel-wise). The reference forward is
exactly the integer arithmetic of the contract (kernels.md): activations quantized per token,
s_a = amax / 127, q_a = round(x / s_a) in [-127, 127]; per group an exact integer dot product;
y = s_a * sum_g s_w[g] * acc_g. It is the oracle of the native kernels and the fallback without one.
"""

from __future__ import annotations

import torch
from torch import nn

from cpuserve.errors import CheckpointError
from cpuserve.quant.config import WeightQuant

FLOAT_SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Integer partial sums stay exact in fp32 while |sum| < 2^24: 127 * 127 * 1024 < 2^24.
EXACT_CHUNK = 1024


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


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8 (as float values in [-127, 127]) and scales [M, 1]."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127.0
    return torch.round(x / scale).clamp(-127, 127), scale


PANEL = 16  # output columns per panel in the panel layouts (kernels/csrc/qlinear_panels.h)


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


class QuantLinear(nn.Module):
    """A Linear whose weight is quantized. `use_native` repacks it for a native kernel variant;
    otherwise (or with CPUSERVE_ISA=reference) forward is the scheme's pure-torch reference."""

    def __init__(self, in_features: int, out_features: int, quant: WeightQuant, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features, self.quant = in_features, out_features, quant
        groups = in_features // quant.group_size if quant.group_size else 1
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features, groups, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.native = None  # the kernel module, once use_native() succeeded
        self.variant = "reference"
        self.packed: torch.Tensor | None = None  # the weight in a kernel variant's layout
        self.packed_layout = "offset"  # which one (kernels.int4_layout / int8_layout of that variant)
        self.kernel_scales: torch.Tensor | None = None  # W4A8 scales in the variant's order (pack_scales)

    def use_native(self, kernels, variant: str) -> bool:  # type: ignore[no-untyped-def]
        """Switch to a native variant when the shapes fit it; the int4 weight is repacked (and the
        int8 copy dropped: `int_weight()` rebuilds it for the reference)."""
        group = self.quant.group_size or self.in_features
        if self.in_features % 32 or group % 32:
            return False
        if self.native is kernels and self.variant == variant:  # repacked as it was loaded
            return True
        bits4 = self.quant.bits == 4
        layout = kernels.int4_layout(variant) if bits4 else kernels.int8_layout(variant)
        pack = kernels.pack_int4 if bits4 else kernels.pack_int8
        if layout == "signed":  # int8 as it is
            if self.qweight is None:  # was packed for another variant
                self.qweight, self.packed = self.int_weight(), None
        else:
            if self.packed is None:
                self.packed = pack(self.qweight, variant)
            elif self.packed_layout != layout:  # packed for another variant's layout
                self.packed = pack(self.int_weight(), variant)
            self.qweight = None
        self.packed_layout = layout
        self.kernel_scales = kernels.pack_scales(self.scales, variant) if bits4 else None
        self.native, self.variant = kernels, variant
        return True

    def int_weight(self) -> torch.Tensor:
        if self.qweight is not None:
            return self.qweight
        if self.quant.bits == 8:
            return unpack_int8(self.packed, self.in_features, self.packed_layout)
        return unpack_nibbles(self.packed, self.in_features, self.packed_layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is None:
            return reference_forward(x, self.int_weight(), self.scales, self.bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.quant.bits == 4:
            y = self.native.w4a8_linear(x2, self.packed, self.kernel_scales, self.bias, self.variant)
        else:
            weight = self.qweight if self.qweight is not None else self.packed
            y = self.native.w8a8_linear(x2, weight, self.scales.view(-1), self.bias, self.variant)
        return y.view(*lead, self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        g = self.in_features // self.scales.shape[1]
        return (self.int_weight().float().view(self.out_features, -1, g) * self.scales.unsqueeze(-1)).view(
            self.out_features, self.in_features
        )


def use_native_kernels(model: nn.Module) -> str:
    """Route every QuantLinear to the selected native variant; returns what runs (for the log)."""
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not quantized:
        return "none"
    from cpuserve.kernels import native, selected_variant

    variant = selected_variant()
    kernels = native() if variant != "reference" else None
    if kernels is None:
        return "reference (pure torch)"
    done = sum(m.use_native(kernels, variant) for m in quantized)
    if hasattr(model, "reset_native_decode_plan"):
        model.reset_native_decode_plan()
    return f"native {variant} ({done}/{len(quantized)} layers; the rest reference)"


@torch.inference_mode()
def reference_forward(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    lead, k = x.shape[:-1], x.shape[-1]
    n, groups = scales.shape
    g = k // groups
    qa, sa = quantize_activations(x.reshape(-1, k).float())
    m = qa.shape[0]
    chunk = next(g // f for f in range(1, g + 1) if g % f == 0 and g // f <= EXACT_CHUNK)
    qw = qweight.float().view(n, k // chunk, chunk)
    per_group = g // chunk
    out = torch.empty(m, n, dtype=torch.float64 if per_group > 1 else torch.float32)
    rows = max(1, (1 << 24) // max(1, n * (k // chunk)))  # bound the [rows, N, chunks] temporary
    for start in range(0, m, rows):
        a = qa[start : start + rows].view(-1, k // chunk, chunk)
        acc = torch.einsum("mck,nck->mnc", a, qw)  # exact integer sums per chunk
        if per_group > 1:  # channel-wise with long K: add chunks exactly, in float64
            acc = acc.double().view(acc.shape[0], n, groups, per_group).sum(-1)
        out[start : start + rows] = (acc * scales.to(acc.dtype)).sum(-1)
    y = (out * sa.to(out.dtype)).float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*lead, n)


def expected_tensors(prefix: str, quant: WeightQuant, n: int, k: int) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape that a checkpoint must hold for one quantized Linear."""
    groups = k // quant.group_size if quant.group_size else 1
    shapes = {f"{prefix}.weight_scale": (n, groups)}
    if quant.packed:
        shapes[f"{prefix}.weight_packed"] = (n, -(-k * quant.bits // 32))
        shapes[f"{prefix}.weight_shape"] = (2,)
    else:
        shapes[f"{prefix}.weight"] = (n, k)
    return shapes


def _native_for_load(quant: WeightQuant, k: int):  # type: ignore[no-untyped-def]
    """(kernel module, variant) when the weights will run natively (so they can be repacked into
    that variant's layout as they are read), else None."""
    group = quant.group_size or k
    if k % 32 or group % 32:
        return None
    from cpuserve.kernels import native, selected_variant

    variant = selected_variant()
    kernels = native() if variant != "reference" else None
    return (kernels, variant) if kernels is not None else None


def load_quantized(module: QuantLinear, prefix: str, get, where) -> None:  # type: ignore[no-untyped-def]
    """Fill a QuantLinear from checkpoint tensors (get(name) -> tensor), checking each one."""
    quant, n, k = module.quant, module.out_features, module.in_features
    if quant.group_size and k % quant.group_size:
        raise CheckpointError(
            f"{prefix}: {quant.name} needs the input size {k} to be a multiple of the group size {quant.group_size}"
        )
    shapes = expected_tensors(prefix, quant, n, k)

    def fetch(name: str, kinds: tuple[torch.dtype, ...]) -> torch.Tensor:
        t = get(name)
        if tuple(t.shape) != shapes[name]:
            raise CheckpointError(
                f"{where(name)}: tensor '{name}' has shape {list(t.shape)}, expected "
                f"{list(shapes[name])} for {quant.name} ({n} x {k})"
            )
        if t.dtype not in kinds:
            raise CheckpointError(
                f"{where(name)}: tensor '{name}' has dtype {t.dtype}, expected "
                f"{' or '.join(str(d) for d in kinds)} for {quant.name}"
            )
        return t

    scale = fetch(f"{prefix}.weight_scale", FLOAT_SCALE_DTYPES).float()
    if not torch.isfinite(scale).all():  # negative scales are fine: w = q * s either way
        raise CheckpointError(
            f"{where(prefix + '.weight_scale')}: tensor '{prefix}.weight_scale' has non-finite scales"
        )
    if quant.packed:
        shape = fetch(f"{prefix}.weight_shape", (torch.int32, torch.int64)).tolist()
        if shape != [n, k]:
            raise CheckpointError(
                f"{where(prefix + '.weight_shape')}: tensor '{prefix}.weight_shape' says {shape}, "
                f"expected {[n, k]} from config.json"
            )
        words = fetch(f"{prefix}.weight_packed", (torch.int32,))
        native = _native_for_load(quant, k)
        if native is not None:  # straight to the kernel's layout: no int8 copy of the weight
            kernels, variant = native
            module.packed = kernels.words_to_nibbles(words, k, variant)
            module.packed_layout = kernels.int4_layout(variant)
            module.qweight = None
            module.scales = scale.contiguous()
            module.use_native(kernels, variant)  # finds the layout in place: the rest of the switch only
            return
        q = unpack_int(words, quant.bits, k)
    else:
        q = fetch(f"{prefix}.weight", (torch.int8,))
        lo, hi = -(1 << (quant.bits - 1)), (1 << (quant.bits - 1)) - 1
        if quant.bits < 8 and (q.min() < lo or q.max() > hi):
            raise CheckpointError(
                f"{where(prefix + '.weight')}: tensor '{prefix}.weight' holds values outside "
                f"[{lo}, {hi}] for {quant.name}"
            )
    module.qweight = q.contiguous()
    module.scales = scale.contiguous()
    native = _native_for_load(quant, k)
    if native is not None:  # repacked now: one int8 copy at a time, not every layer's at the end
        module.use_native(*native)
