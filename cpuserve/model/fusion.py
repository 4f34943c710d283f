"""Fuse projections that read the same input into one linear, after loading: q/k/v into `qkv_proj`,
gate/up into `gate_up_proj`.

One call instead of three (or two) per layer: the activations are quantized once, the thread pool is
entered once, and the weights are read in one pass. Each output row depends only on its own weight
row, so the fused layer computes exactly what the separate ones did (bit for bit for the quantized
kernels, whose per-column arithmetic does not depend on N). Projections of different kinds (one
quantized, one ignored; different group sizes or kernel variants) are left apart.
"""

from __future__ import annotations

import torch
from torch import nn

from cpuserve.quant.schemes import PANEL, QuantLinear


def _fusable(parts: list[nn.Module]) -> bool:
    first = parts[0]
    if any(type(p) is not type(first) or p.in_features != first.in_features for p in parts):
        return False
    if any((p.bias is None) != (first.bias is None) for p in parts):
        return False
    if isinstance(first, QuantLinear):
        return all(
            p.quant == first.quant
            and p.variant == first.variant
            and p.native is first.native
            and (p.packed is None) == (first.packed is None)
            and p.packed_layout == first.packed_layout
            for p in parts
        )
    return isinstance(first, nn.Linear) and all(p.weight.dtype == first.weight.dtype for p in parts)


def _cat(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if tensors[0] is None else torch.cat(tensors, dim=0)  # type: ignore[arg-type]


def fuse_linears(parts: list[nn.Module]) -> nn.Module | None:
    """One linear whose output is the parts' outputs concatenated, or None if they do not fit."""
    if not _fusable(parts):
        return None
    first = parts[0]
    out_features = sum(p.out_features for p in parts)
    bias = _cat([p.bias.detach() if p.bias is not None else None for p in parts])
    if isinstance(first, QuantLinear):
        fused = QuantLinear(first.in_features, out_features, first.quant, bias is not None)
        fused.qweight = _cat([p.qweight for p in parts])
        fused.packed = _cat([p.packed for p in parts])
        if first.packed_layout.endswith("_panel") and any(p.out_features % PANEL for p in parts[:-1]):
            # a part that ends inside a panel: the parts' panels do not line up, so pack anew
            pack = first.native.pack_int4 if first.quant.bits == 4 else first.native.pack_int8
            fused.packed = pack(torch.cat([p.int_weight() for p in parts]), first.variant)
        fused.packed_layout = first.packed_layout
        fused.scales = torch.cat([p.scales for p in parts], dim=0)
        fused.native, fused.variant = first.native, first.variant
        if first.kernel_scales is not None:
            fused.kernel_scales = first.native.pack_scales(fused.scales, first.variant)
    else:
        fused = nn.Linear(first.in_features, out_features, bias=bias is not None, device="meta")
        fused.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts], dim=0), requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    return fused


def fuse_projections(model: nn.Module) -> int:
    """Fuse q/k/v and gate/up in every decoder layer where they fit; return how many were fused."""
    count = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        if qkv is not None:
            attn.qkv_proj = qkv
            del attn.q_proj, attn.k_proj, attn.v_proj
            count += 1
        gate_up = fuse_linears([mlp.gate_proj, mlp.up_proj])
        if gate_up is not None:
            mlp.gate_up_proj = gate_up
            del mlp.gate_proj, mlp.up_proj
            count += 1
    if hasattr(model, "reset_native_decode_plan"):
        model.reset_native_decode_plan()
    return count
