"""A decode step through all decoder layers in one native call (kernels/csrc/decoder_layers.cpp).

The Python decoder with native ops spends more time between the ops than in them on a small model
(SmolLM2: ~20 Python-level calls and views per layer, 30 layers, per token). When every sequence of
a step brings one new token, the attention backend describes where its K/V go and what each token
attends to (`DecodeCache`), and the whole stack runs natively with the same ops in the same order:
the result is bit-identical to the Python path (tests/test_native_decode.py). The Llama layer and
Gemma 3's switches run there ((1 + w) norms, q/k norms, sandwich norms, GeGLU, the attention scale,
sliding windows and the local rope), with q/k/v and gate/up fused or apart; prefill chunks and
weights outside the native kernels stay in Python, and the log says why.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
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
    # window -> what a sliding layer's tokens attend to: (slots [T, W] or None, lengths [T], first
    # position: without slots, the keys from there on), the same keys the Python path gives it.
    window: Callable[[int], tuple[torch.Tensor | None, torch.Tensor, int]] | None = None


def enabled() -> bool:
    """CPUSERVE_NATIVE_DECODE=0 keeps the Python layer loop (for A/B measurements)."""
    return os.environ.get("CPUSERVE_NATIVE_DECODE", "1") != "0" and ops.native_ops_enabled()


def _linear(module: nn.Module, kernels: Any) -> Any | None:
    from cpuserve.quant.linear import Linear

    return module.native_linear(kernels) if isinstance(module, Linear) else None


def layer_is_native(spec: Any) -> bool:
    """decode_layers runs the Llama layer with Gemma 3's switches; one window size for all sliding layers."""
    windows = {spec.layer_window(i) for i in range(spec.num_layers)} - {None}
    return spec.activation in ("silu", "gelu_tanh") and len(windows) <= 1


def build_plan(model: nn.Module) -> list[Any] | None:
    """Per-layer plans for decode_layers, or None (the reason logged) when some layer cannot run natively."""
    if not enabled():
        return _python_loop("CPUSERVE_NATIVE_DECODE=0 or native ops off")
    kernels = ops._native()
    spec = model.spec
    if kernels is None or not hasattr(kernels, "decode_layers"):
        return _python_loop("no native kernels")
    if not layer_is_native(spec):
        return _python_loop(f"activation {spec.activation} or several window sizes")
    if model.dtype not in ops.NATIVE_DTYPES:
        return _python_loop(f"compute dtype {model.dtype}")
    plans = []
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        # Fused where the checkpoint's methods agree, else apart (a GGUF's types can differ in a layer).
        qkv = [attn.qkv_proj] if attn.qkv_proj is not None else [attn.q_proj, attn.k_proj, attn.v_proj]
        gate_up = [mlp.gate_up_proj] if mlp.gate_up_proj is not None else [mlp.gate_proj, mlp.up_proj]
        qkv_lin, gate_up_lin = [_linear(m, kernels) for m in qkv], [_linear(m, kernels) for m in gate_up]
        o_lin, down_lin = _linear(attn.o_proj, kernels), _linear(mlp.down_proj, kernels)
        linears = [*qkv_lin, o_lin, *gate_up_lin, down_lin]
        attn_out_norm, mlp_in_norm, mlp_out_norm = layer.norm_roles
        qk_norms = (attn.q_norm, attn.k_norm) if spec.qk_norm else (None, None)
        norms = [n for n in (layer.input_layernorm, *layer.norm_roles, *qk_norms) if n is not None]
        if any(lin is None for lin in linears):
            return _python_loop(f"layer {i} has a linear without a native handle")
        if any(n.weight.dtype != model.dtype for n in norms):
            return _python_loop(f"layer {i} has a norm not in {model.dtype}")
        plans.append(
            kernels.LayerPlan(
                qkv_lin,
                o_lin,
                gate_up_lin,
                down_lin,
                layer.input_layernorm.weight,
                mlp_in_norm.weight,
                layer.input_layernorm.eps,
                layer.residual_scale,
                spec.num_heads,
                spec.num_kv_heads,
                spec.head_dim,
                unit_offset=spec.norm_unit_offset,
                q_norm=None if qk_norms[0] is None else qk_norms[0].weight,
                k_norm=None if qk_norms[1] is None else qk_norms[1].weight,
                attn_out_norm=None if attn_out_norm is None else attn_out_norm.weight,
                mlp_out_norm=None if mlp_out_norm is None else mlp_out_norm.weight,
                gelu=spec.activation == "gelu_tanh",
                attention_scale=spec.attention_scale or 0.0,
                windowed=attn.window is not None,
                local_rope=model.local_rotary is not None and spec.is_sliding(i),
            )
        )
    if model.model.norm.weight.dtype != model.dtype:
        return _python_loop(f"the final norm is not in {model.dtype}")
    return plans


def _python_loop(reason: str) -> None:
    log.info("native decode step off: %s", reason)
    return None


def decode(
    model: nn.Module,
    plans: list[Any],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    cache: DecodeCache,
) -> torch.Tensor:
    """Final-norm hidden states [..., H] for one new token per sequence (input_ids [...] at positions)."""
    h = model.embed(input_ids.reshape(-1))
    cos, sin = model.rotary(positions, model.dtype)
    local = model.local_rotary(positions, model.dtype) if model.local_rotary is not None else (None, None)
    window = model.spec.sliding_window
    windowed = window is not None and any(model.spec.is_sliding(i) for i in range(model.spec.num_layers))
    if windowed and cache.window is None:
        raise ValueError("decode: a model with sliding layers needs the cache's window context")
    w_slots, w_lengths, w_first = cache.window(window) if windowed else (None, None, 0)
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
        *local,
        w_slots,
        w_lengths,
        w_first,
    )
    return out.view(*input_ids.shape, -1)
