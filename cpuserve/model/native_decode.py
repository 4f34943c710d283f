"""A decode step through all decoder layers in one native call (kernels/csrc/decoder_layers.cpp).

The Python decoder with native ops spends more time between the ops than in them on a small model
(SmolLM2: ~20 Python-level calls and views per layer, 30 layers, per token). When every sequence of
a step brings one new token, the attention backend describes where its K/V go and what each token
attends to (`DecodeCache`), and the whole stack runs natively with the same ops in the same order:
the result is bit-identical to the Python path (tests/test_native_decode.py). Prefill chunks, models
with q/k norms, unfused projections or weights outside the native kernels stay in Python.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cpuserve.model import ops

log = logging.getLogger(__name__)


@dataclass
class DecodeCache:
    """Where each new token's K/V are written and what it attends to, for decode_layers."""

    k: list[torch.Tensor]  # per layer [B, S, Hkv, D] views of the cache
    v: list[torch.Tensor]
    write_batch: torch.Tensor  # [T]
    write_pos: torch.Tensor  # [T]
    lengths: torch.Tensor  # [T] context length of each token's sequence, itself included
    slots: torch.Tensor | None  # [T, L] paged slots (batch 0), or None: batch t, positions 0..L-1
    k_scale: list[torch.Tensor] | None = None  # per layer [B, S, Hkv] row scales of an int8 cache
    v_scale: list[torch.Tensor] | None = None


def enabled() -> bool:
    """CPUSERVE_NATIVE_DECODE=0 keeps the Python layer loop (for A/B measurements)."""
    return os.environ.get("CPUSERVE_NATIVE_DECODE", "1") != "0" and ops.native_ops_enabled()


def _linear(module: nn.Module, kernels: Any) -> Any | None:
    from cpuserve.quant.linear import Linear

    return module.native_linear(kernels) if isinstance(module, Linear) else None


def layer_is_native(spec: Any) -> bool:
    """decode_layers runs the Llama layer only: pre-norms w * x, SwiGLU, D ** -0.5, one rope, every
    key seen. Anything else (Gemma's norms, GeGLU, scale, windows, local rope) is the Python loop's."""
    return not (
        spec.qk_norm
        or spec.norm_unit_offset
        or spec.sandwich_norms
        or spec.activation != "silu"
        or spec.attention_scale is not None
        or spec.sliding_window is not None
        or spec.local_rope is not None
        or spec.embedding_scale_in_dtype
    )


def build_plan(model: nn.Module) -> list[Any] | None:
    """Per-layer plans for decode_layers, or None when some layer cannot run natively."""
    if not enabled():
        return None
    kernels = ops._native()
    spec = model.spec
    if kernels is None or not hasattr(kernels, "decode_layers") or not layer_is_native(spec):
        return None
    if model.dtype not in ops.NATIVE_DTYPES:
        return None
    plans = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is None or mlp.gate_up_proj is None:
            return None
        linears = [_linear(m, kernels) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(lin is None for lin in linears) or any(n.weight.dtype != model.dtype for n in norms):
            return None
        plans.append(
            kernels.LayerPlan(
                *linears,
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                layer.input_layernorm.eps,
                layer.residual_scale,
                spec.num_heads,
                spec.num_kv_heads,
                spec.head_dim,
            )
        )
    if model.model.norm.weight.dtype != model.dtype:
        return None
    return plans


def decode(
    model: nn.Module,
    plans: list[Any],
    input_ids: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: DecodeCache,
) -> torch.Tensor:
    """Final-norm hidden states [..., H] for one new token per sequence (input_ids [...])."""
    h = model.model.embed_tokens(input_ids.reshape(-1))
    if model.spec.embedding_scale != 1.0:
        h = h * model.spec.embedding_scale
    norm = model.model.norm
    out = ops._native().decode_layers(
        plans,
        h,
        cos,
        sin,
        cache.k,
        cache.v,
        cache.k_scale or [],
        cache.v_scale or [],
        cache.write_batch,
        cache.write_pos,
        cache.lengths,
        cache.slots,
        norm.weight,
        norm.eps,
        ops._variant(),
    )
    return out.view(*input_ids.shape, -1)
