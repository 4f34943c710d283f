"""`quantization_config` (compressed-tensors) -> which scheme each Linear module uses.

Accepted: symmetric int weights (4 bits by group of 32/64/128, or 8 bits per channel, also 4 bits
per channel), with dynamic per-token symmetric int8 activations; formats int-quantized /
naive-quantized (one value per int8) and pack-quantized (int32 words). Everything else is refused
with a message that names the scheme and the module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from cpuserve.errors import ConfigError
from cpuserve.quant.scale_codes import ScaleCoding

UNPACKED_FORMATS = ("int-quantized", "naive-quantized")
PACKED_FORMAT = "pack-quantized"
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class WeightQuant:
    """How one Linear's weight is stored: bits, group size (None: one scale per output channel),
    and whether each group also has an additive offset (w = s * q + offset: the GGUF formats with
    a minimum, quant/gguf_blocks.py; compressed-tensors checkpoints never do). act_groups: the
    activations are quantized per group of the weight's instead of per token (GGUF's numerics:
    llama.cpp's int8 activation blocks; a compressed-tensors checkpoint says which: input
    activations strategy "token", or "group" with the weights' group size). coding: how a GGUF
    type codes its scales and offsets, kept so (quant/scale_codes.py); None: fp32. int6: 8-bit values
    that all lie in [-32, 31] (GGUF's Q6_K, Q5_K, Q5_0, Q5_1), held as int6 panels (6 bits a weight,
    not 8) on kernels that have them, as int8 elsewhere: the same values either way."""

    bits: int
    group_size: int | None
    packed: bool
    offsets: bool = False
    act_groups: bool = False
    coding: ScaleCoding | None = None
    int6: bool = False

    @property
    def name(self) -> str:
        grouping = f"G{self.group_size}" if self.group_size else "channel"
        extras = ("+offsets" if self.offsets else "") + (" packed" if self.packed else "")
        return f"W{self.bits}A8-{grouping}{extras}{' (A8 per group)' if self.act_groups else ''}"


def _targets_match(targets: list[str], module: str) -> bool:
    for t in targets:
        if t == "Linear":
            return True
        if t.startswith("re:") and re.match(t[3:], module):
            return True
        if t == module:
            return True
    return False


def is_ignored(ignore: list[str], module: str) -> bool:
    """compressed-tensors' ignore rule: an exact module name or a `re:` pattern."""
    for pattern in ignore:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module):
                return True
        elif pattern == module:
            return True
    return False


@dataclass(frozen=True)
class _Group:
    name: str
    targets: list[str]
    weight: WeightQuant


class QuantConfig:
    def __init__(self, groups: list[_Group], ignore: list[str], source: str, label: str = "compressed-tensors") -> None:
        """label: where the schemes come from (a compressed-tensors config, or a GGUF's block types)."""
        self.groups, self.ignore, self.source, self.label = groups, ignore, source, label

    @classmethod
    def from_hf(cls, qc: dict[str, Any], source: str) -> QuantConfig:
        method = qc.get("quant_method")
        if method != "compressed-tensors":
            raise ConfigError(f"{source}: quant_method {method!r} is not supported (expected 'compressed-tensors')")
        if qc.get("kv_cache_scheme"):
            raise ConfigError(
                f"{source}: kv_cache_scheme {qc['kv_cache_scheme']} is not supported (KV cache stays "
                "in the model dtype)"
            )
        sparsity = qc.get("sparsity_config") or {}
        if sparsity.get("format") not in (None, "dense"):
            raise ConfigError(f"{source}: sparsity format {sparsity.get('format')!r} is not supported")
        groups = []
        default_format = qc.get("format")
        for name, group in (qc.get("config_groups") or {}).items():
            groups.append(
                _Group(
                    name,
                    list(group.get("targets") or []),
                    _weight_quant(group, group.get("format") or default_format, f"{source}: {name}"),
                )
            )
        if not groups:
            raise ConfigError(f"{source}: quantization_config has no config_groups")
        return cls(groups, list(qc.get("ignore") or []), source)

    def scheme_for(self, module: str) -> WeightQuant | None:
        """The module's weight format, or None when it stays unquantized (ignored or untargeted)."""
        if is_ignored(self.ignore, module):
            return None
        for group in self.groups:
            if _targets_match(group.targets, module):
                return group.weight
        return None


def _weight_quant(group: dict[str, Any], fmt: str | None, where: str) -> WeightQuant:
    w = group.get("weights")
    a = group.get("input_activations")
    if not w:
        raise ConfigError(f"{where}: no weights quantization (activation-only schemes are not supported)")
    if fmt not in (*UNPACKED_FORMATS, PACKED_FORMAT):
        raise ConfigError(
            f"{where}: format {fmt!r} is not supported (int-quantized, naive-quantized or pack-quantized)"
        )
    bits, strategy = w.get("num_bits"), w.get("strategy")
    scheme = f"weights int{bits} {strategy}"
    if w.get("type", "int") != "int":
        raise ConfigError(f"{where}: {w.get('type')} weights are not supported (int only)")
    if not w.get("symmetric", True):
        raise ConfigError(f"{where}: asymmetric weights ({scheme}, zero points) are not supported")
    if w.get("actorder") not in (None, False, "none"):
        raise ConfigError(f"{where}: actorder {w.get('actorder')!r} ({scheme}) is not supported")
    if w.get("dynamic"):
        raise ConfigError(f"{where}: dynamic weight quantization is not supported")
    if bits not in (4, 8):
        raise ConfigError(f"{where}: {bits}-bit weights are not supported (4 or 8)")
    if strategy == "group":
        size = w.get("group_size")
        if size not in GROUP_SIZES:
            raise ConfigError(f"{where}: group_size {size} is not supported ({', '.join(map(str, GROUP_SIZES))})")
        group_size = size
    elif strategy == "channel":
        group_size = None
    else:
        raise ConfigError(f"{where}: weight strategy {strategy!r} is not supported (group or channel)")
    if bits == 8 and group_size is not None:
        raise ConfigError(f"{where}: int8 weights by group are not supported (int8 is channel-wise)")
    if not a:
        raise ConfigError(
            f"{where}: weight-only schemes (W{bits}A16) are not supported; "
            "activations must be int8 dynamic, per token or per group"
        )
    activation = (a.get("num_bits"), a.get("type", "int"), a.get("strategy"), bool(a.get("dynamic")))
    # Per group: one int8 scale per token and weight group (as llama.cpp's Q8 activation blocks).
    act_groups = (
        group_size is not None and activation == (8, "int", "group", True) and a.get("group_size") == group_size
    )
    if activation != (8, "int", "token", True) and not act_groups:
        raise ConfigError(
            f"{where}: input activations int{a.get('num_bits')} {a.get('strategy')} "
            f"{'' if a.get('group_size') is None else str(a.get('group_size')) + ' '}"
            f"{'dynamic' if a.get('dynamic') else 'static'} are not supported (int8 dynamic, per token or per "
            "group of the weights' group size)"
        )
    if not a.get("symmetric", True):
        raise ConfigError(f"{where}: asymmetric activations are not supported")
    return WeightQuant(bits=bits, group_size=group_size, packed=fmt == PACKED_FORMAT, act_groups=act_groups)
