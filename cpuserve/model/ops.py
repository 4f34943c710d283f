"""The decoder's float ops around the linears: RMSNorm (alone and fused with the residual add; Gemma's
unit-offset one too), RoPE, SiLU-and-mul, GeGLU and single-query attention, and the causal
(optionally sliding-window) mask of a query block.

Each op has its pure-torch reference here (`*_reference`) and a native twin (kernels/csrc/
layer_ops.cpp) that does in one call what the reference does in 5-20 torch ops: on SmolLM2 those
ops, not the matmuls, were most of a decode step. The native twin is used when the kernels are built,
the selected variant is not `reference` and CPUSERVE_NATIVE_OPS is not 0 (for A/B measurements), for fp32,
bf16 and fp16 tensors.
"""

from __future__ import annotations

import os
from functools import cache
from types import ModuleType

import torch
import torch.nn.functional as F

NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@cache
def _module() -> ModuleType | None:
    from cpuserve.kernels import native

    module = native()
    return module if module is not None and hasattr(module, "rms_norm") else None


def _native() -> ModuleType | None:
    """The kernel module, unless CPUSERVE_NATIVE_OPS=0 (read at each call: tests switch) or the
    selected variant is the pure-torch reference."""
    if os.environ.get("CPUSERVE_NATIVE_OPS", "1") == "0" or _variant() == "reference":
        return None
    return _module()


def _variant():  # type: ignore[no-untyped-def]
    """The selected variant's table row, passed to every native op (resolved once)."""
    from cpuserve.kernels import selected_variant

    return selected_variant()


def native_ops_enabled() -> bool:
    """Whether the native twins run (for the start-up log and doctor)."""
    return _native() is not None


def _use_native(*tensors: torch.Tensor) -> ModuleType | None:
    module = _native()
    if module is None or any(t.dtype not in NATIVE_DTYPES or t.device.type != "cpu" for t in tensors):
        return None
    return module


# ---------------------------------------------------------------- references (pure torch)
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalize in fp32 whatever the compute dtype, as the reference implementations do.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_reference(
    h: torch.Tensor, delta: torch.Tensor, scale: float, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    h = h + delta * scale if scale != 1.0 else h + delta
    return h, rms_norm_reference(h, weight, eps)


def rms_norm_unit_offset_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: weights are offsets from 1, and the scaling is done in fp32 before rounding
    to x's dtype (Llama's rounds first, then scales)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., T, H, D] by cos/sin [..., T, 1, D] ("rotate half" layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def gelu_tanh_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GeGLU: gelu(gate) (tanh approximation) * up."""
    return F.gelu(gate, approximate="tanh") * up


def causal_window_mask(t: int, offset: int, window: int | None) -> torch.Tensor | None:
    """Which of offset + t keys each of t queries sees ([t, offset + t] bool): query i is key
    offset + i and sees the keys up to itself, and with a window only those less than `window`
    back (q - k < window, as HF's sliding-window mask). None when that is the plain causal mask of
    a block without cached keys (SDPA's is_causal)."""
    keys = offset + t
    windowed = window is not None and keys > window  # else no visible key is ever too old
    if offset == 0 and not windowed:
        return None
    mask = torch.ones(t, keys, dtype=torch.bool).tril(diagonal=offset)
    if windowed:
        mask &= ~torch.ones(t, keys, dtype=torch.bool).tril(diagonal=offset - window)
    return mask


def decode_attention_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """q [N, Hq, D] (one token per sequence); keys/values [N, Hkv, L, D] (its context, the new token
    included); valid [N, L] bool, False at padding; scale None: D ** -0.5. Returns [N, Hq, D] in q's
    dtype; softmax in fp32.

    Written as two batched matmuls over the query heads that share a KV head: torch's SDPA with bf16
    inputs took 0.5-2.1 ms per layer for one query over 136-640 cached tokens here (its flash kernel
    is built for long query blocks), this 0.1-0.2 ms (once, docs/benchmarks.md)."""
    n, hq, d = q.shape
    hkv, length = keys.shape[1], keys.shape[2]
    qf = q.float().view(n, hkv, hq // hkv, d)
    scale = d**-0.5 if scale is None else scale
    scores = torch.matmul(qf, keys.float().transpose(-1, -2)) * scale  # [N, Hkv, G, L]
    if valid is not None:
        scores = scores.masked_fill(~valid.view(n, 1, 1, length), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values.float()).view(n, hq, d).to(q.dtype)


def prefill_attention_reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int | None = None, scale: float | None = None
) -> torch.Tensor:
    """q [B, T, Hq, D] new tokens; keys/values [B, L, Hkv, D] every key they see, the T new ones last
    (query i is key L - T + i); causal, with a sliding window if given. torch's SDPA, in q's dtype
    (in fp32 when the keys are of another dtype: a 16-bit cache under a float32 model, or fp16 rows
    under a bf16 one)."""
    if keys.dtype != q.dtype:  # a 16-bit cache under another compute dtype: widened exactly, in fp32
        out = prefill_attention_reference(q.float(), keys.float(), values.float(), window, scale)
        return out.to(q.dtype)
    t, offset = q.shape[1], keys.shape[1] - q.shape[1]
    mask = causal_window_mask(t, offset, window)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask,
        is_causal=mask is None and t > 1,
        scale=scale,
        enable_gqa=q.shape[2] != keys.shape[2],
    )
    return out.transpose(1, 2)


def token_logprobs_reference(
    logits: torch.Tensor, chosen: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of fp32 logits [N, V]: the chosen token's logprob [N], its rank [N] (1 = most
    likely), the top-k ids and logprobs [N, k] (ties: lower id first)."""
    lp = torch.log_softmax(logits, dim=-1)
    chosen_lp = lp.gather(1, chosen.unsqueeze(1)).squeeze(1)
    # Ranks and order from the logits themselves: subtracting the row's logsumexp in float32 can
    # round two different logits to one logprob.
    ranks = (logits > logits.gather(1, chosen.unsqueeze(1))).sum(dim=1) + 1
    if k == 0:
        return chosen_lp, ranks, torch.empty(len(chosen), 0, dtype=torch.int64), torch.empty(len(chosen), 0)
    # Sorting ids by (-logit, id): a stable sort on values descending keeps ids ascending among ties.
    top_ids = torch.sort(logits, dim=1, descending=True, stable=True).indices[:, :k]
    return chosen_lp, ranks, top_ids, lp.gather(1, top_ids)


# ---------------------------------------------------------------- dispatch
def token_logprobs(
    logits: torch.Tensor, chosen: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """token_logprobs_reference in one native pass per row (0.12 ms a row over a 49k vocabulary;
    docs/benchmarks.md)."""
    module = _use_native(logits)
    if module is None or logits.dtype != torch.float32:
        return token_logprobs_reference(logits, chosen, k)
    return tuple(module.token_logprobs(logits, chosen, k))  # type: ignore[return-value]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm; unit_offset: Gemma's x * (1 + w)."""
    module = _use_native(x, weight)
    if module is None or x.dtype != weight.dtype:
        if unit_offset:
            return rms_norm_unit_offset_reference(x, weight, eps)
        return rms_norm_reference(x, weight, eps)
    return module.rms_norm(x, weight, eps, _variant(), unit_offset)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, scale: float, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta * scale, its RMSNorm): the residual add fused with the norm that follows it."""
    module = _use_native(h, delta, weight)
    if module is None or not (h.dtype == delta.dtype == weight.dtype) or h.shape != delta.shape:
        if unit_offset:
            h = h + delta * scale if scale != 1.0 else h + delta
            return h, rms_norm_unit_offset_reference(h, weight, eps)
        return add_rms_norm_reference(h, delta, scale, weight, eps)
    total, normed = module.add_rms_norm(h, delta, scale, weight, eps, _variant(), unit_offset)
    return total, normed


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [..., T, Hq, D], k [..., T, Hkv, D] rotated by cos/sin [..., T, D]. The native twin rotates
    in place (q and k are fresh projection outputs nobody else holds)."""
    module = _use_native(q, k, cos)
    flat = _flat_heads(q, k) if module is not None and q.dtype == k.dtype == cos.dtype else None
    if flat is None:
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
        return rope_reference(q, c, s), rope_reference(k, c, s)
    d = cos.shape[-1]
    lead = q.shape[:-2]  # cos/sin may be [T, D] for a [B, T] batch: one table row per token
    c, s = cos.expand(*lead, d).reshape(-1, d), sin.expand(*lead, d).reshape(-1, d)
    for x in flat:
        module.rope_(x, c, s, _variant())
    return q, k


def _flat_heads(*tensors: torch.Tensor) -> list[torch.Tensor] | None:
    """[..., H, D] tensors as [rows, H, D] views of the same memory, or None where that needs a copy
    (an in-place op on a copy would be lost)."""
    views = []
    for x in tensors:
        try:
            views.append(x.view(-1, x.shape[-2], x.shape[-1]))
        except RuntimeError:
            return None
        if x.stride(-1) != 1:
            return None
    return views


def _act_mul(name: str, reference, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """act(gate) * up through the native op `name` where it can take the tensors, else `reference`."""
    module = _use_native(gate, up)
    if module is None or gate.dtype != up.dtype or gate.shape != up.shape:
        return reference(gate, up)
    size = gate.shape[-1]
    try:
        g, u = gate.view(-1, size), up.view(-1, size)
    except RuntimeError:
        return reference(gate, up)
    return getattr(module, name)(g, u, _variant()).view(gate.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; gate and up may be the two halves of one fused projection's output."""
    return _act_mul("silu_mul", silu_mul_reference, gate, up)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): gelu(gate) * up, gelu's tanh approximation; as silu_mul."""
    return _act_mul("gelu_tanh_mul", gelu_tanh_mul_reference, gate, up)


def decode_attention_contiguous(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """q [B, Hq, D]; keys/values [B, Hkv, L, D] (the contiguous cache up to the new token, or the
    part of it a sliding window sees); scale None: D ** -0.5."""
    module = _use_native(q, keys)
    if module is None or keys.stride(-1) != 1:
        return decode_attention_reference(q, keys, values, scale=scale)
    b, _, length, d = keys.shape
    lengths = torch.full((b,), length, dtype=torch.long)
    scale = d**-0.5 if scale is None else scale
    return module.decode_attention(q, keys.transpose(1, 2), values.transpose(1, 2), None, lengths, scale, _variant())


def prefill_attention_contiguous(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int | None = None, scale: float | None = None
) -> torch.Tensor:
    """q [B, T, Hq, D] new tokens; keys/values [B, L, Hkv, D] (views of the contiguous cache, D
    contiguous) every key they see, the T new ones last; causal, with a sliding window if given.
    Natively: flash-style blocks reading the cache in place (prefill_attention.h); else torch's SDPA."""
    module = _use_native(q, keys)
    if module is None or keys.stride(-1) != 1 or keys.stride() != values.stride():
        return prefill_attention_reference(q, keys, values, window, scale)
    d = q.shape[-1]
    return module.prefill_attention(
        q, keys, values, None, keys.shape[1], window or 0, d**-0.5 if scale is None else scale, _variant()
    )


def prefill_attention_paged(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    window: int | None = None,
    scale: float | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] one sequence's new tokens; caches [S, Hkv, D]; slots [L] the slots of every key
    they see, the T new ones last; causal, with a sliding window if given. An int8 cache comes with
    its row scales [S, Hkv]. Natively the keys are read in their slots; the reference gathers them
    (dequantized) for SDPA."""
    int8 = key_scale is not None
    if int8 != (value_scale is not None):
        raise ValueError("prefill_attention_paged: an int8 cache needs both its key and its value scales")
    module = _use_native(q) if int8 else _use_native(q, key_cache)
    if module is None:
        keys, values = key_cache[slots], value_cache[slots]
        if key_scale is not None and value_scale is not None:
            from cpuserve.engine.kv_int8 import dequantize_kv  # the cache's own format

            keys = dequantize_kv(keys, key_scale[slots], q.dtype)
            values = dequantize_kv(values, value_scale[slots], q.dtype)
        return prefill_attention_reference(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), window, scale)[0]
    d = q.shape[-1]
    out = module.prefill_attention(
        q.unsqueeze(0),
        key_cache.unsqueeze(0),
        value_cache.unsqueeze(0),
        slots,
        slots.shape[0],
        window or 0,
        d**-0.5 if scale is None else scale,
        _variant(),
        None if key_scale is None else key_scale.unsqueeze(0),
        None if value_scale is None else value_scale.unsqueeze(0),
    )
    return out[0]


def decode_attention_paged(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [N, Hq, D]; caches [S, Hkv, D]; slots [N, L] each sequence's context slots, padded;
    lengths [N] its real context lengths (the native twin reads only those, the reference masks);
    scale None: D ** -0.5. An int8 cache comes with its row scales [S, Hkv] (key_scale, value_scale):
    each row is read as int8 * scale in fp32."""
    int8 = key_scale is not None
    if int8 != (value_scale is not None):
        raise ValueError("decode_attention_paged: an int8 cache needs both its key and its value scales")
    module = _use_native(q) if int8 else _use_native(q, key_cache)
    if module is None:
        n, length = slots.shape
        valid = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
        flat = slots.view(-1)
        keys, values = key_cache[flat], value_cache[flat]
        if int8:
            keys, values = (
                keys.float() * key_scale[flat].unsqueeze(-1),
                values.float() * value_scale[flat].unsqueeze(-1),
            )
        keys = keys.view(n, length, *key_cache.shape[1:]).transpose(1, 2)
        values = values.view(n, length, *value_cache.shape[1:]).transpose(1, 2)
        return decode_attention_reference(q, keys, values, valid, scale)
    d = q.shape[-1]
    return module.decode_attention(
        q,
        key_cache.unsqueeze(0),
        value_cache.unsqueeze(0),
        slots,
        lengths,
        d**-0.5 if scale is None else scale,
        _variant(),
        None if key_scale is None else key_scale.unsqueeze(0),
        None if value_scale is None else value_scale.unsqueeze(0),
    )
