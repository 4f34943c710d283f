"""The decoder. With CPUSERVE_ISA=reference (or CPUSERVE_NATIVE_OPS=0 for the float ops) it is plain
torch: the reference every faster path is checked against; otherwise its float ops run natively
(model/ops.py) and decode steps take one native call for all layers (model/native_decode.py).

One module tree for Llama, Qwen2, Qwen3, MiniCPM, Gemma 3, Mistral and Phi-3; the ModelSpec
switches decide biases, q/k norms, MiniCPM scalings, the norm flavour and placement, the MLP
activation, the attention scale, each layer's window and rope. Parameter names equal the HF
checkpoint names, so loading is a lookup.

The attention core (where K/V are kept and how queries see them) is a pluggable
`AttentionBackend`: the contiguous cache here for the reference path, the paged cache in the
engine. Everything else (projections, norms, rope, MLP) is shared.
"""

from __future__ import annotations

import logging
from typing import ClassVar, Protocol

import torch
from torch import nn

from cpuserve.model import native_decode, ops
from cpuserve.model.config import ModelSpec
from cpuserve.model.linears import LinearFactory
from cpuserve.model.native_decode import DecodeCache
from cpuserve.model.rope import Rotary

log = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """q [..., T, Hq, D], new k/v [..., T, Hkv, D] -> attention output [..., T, Hq, D]. window: a
        query sees only the keys less than `window` positions back (None: all); scale None: D ** -0.5."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if unit_offset else torch.ones(size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, self.unit_offset)

    def add(self, h: torch.Tensor, delta: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta * scale, this norm of it): a residual add fused with the norm that follows it."""
        return ops.add_rms_norm(h, delta, scale, self.weight, self.eps, self.unit_offset)


class KVCache:
    """Contiguous per-layer K/V for a batch of equally long sequences (the reference path)."""

    def __init__(self, spec: ModelSpec, batch: int, max_len: int, dtype: torch.dtype) -> None:
        shape = (batch, spec.num_kv_heads, max_len, spec.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(spec.num_layers)]
        # The same memory as [B, S, Hkv, D] views, as the native decode step addresses caches.
        self.k_by_position = [k.transpose(1, 2) for k in self.k]
        self.v_by_position = [v.transpose(1, 2) for v in self.v]
        self.max_len = max_len
        self.length = 0


class ContiguousAttention:
    """Batched [B, T] attention over a KVCache (or over the new tokens alone without one)."""

    def __init__(self, cache: KVCache | None, start: int, new_tokens: int = 0) -> None:
        self.cache, self.start, self.new_tokens = cache, start, new_tokens

    def decode_cache(self) -> DecodeCache | None:
        """For the native decode step: one new token per sequence, written at position start."""
        if self.cache is None or self.new_tokens != 1:
            return None
        b, start = self.cache.k[0].shape[0], self.start

        def window(size: int) -> tuple[None, torch.Tensor, int]:  # the keys from start - size + 1 on
            first = max(0, start + 1 - size)
            return None, torch.full((b,), start + 1 - first), first

        return DecodeCache(
            k=self.cache.k_by_position,
            v=self.cache.v_by_position,
            write_batch=torch.arange(b),
            write_pos=torch.full((b,), start),
            lengths=torch.full((b,), start + 1),
            slots=None,
            window=window,
        )

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
        t, start = q.shape[2], self.start
        # The first cached position any query of the block sees (a window hides older ones).
        first = 0 if window is None else max(0, start - window + 1)
        if self.cache is not None:
            self.cache.k[layer][:, :, start : start + t] = k
            self.cache.v[layer][:, :, start : start + t] = v
            k = self.cache.k[layer][:, :, first : start + t]
            v = self.cache.v[layer][:, :, first : start + t]
        else:
            first = 0  # no cache: the block is the whole context
        if t == 1:  # decode: grouped matmuls, far faster than SDPA for a single query
            b, hq, _, d = q.shape
            return ops.decode_attention_contiguous(q.reshape(b, hq, d), k, v, scale).view(b, 1, hq, d)
        # Query i is key (start - first) + i of the keys kept.
        return ops.prefill_attention_contiguous(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window, scale)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, index: int, prefix: str, linear: LinearFactory) -> None:
        super().__init__()
        self.spec = spec
        self.window, self.scale = spec.layer_window(index), spec.attention_scale
        h, bias = spec.hidden_size, spec.qkv_bias
        sizes = [spec.q_size, spec.kv_size, spec.kv_size]
        self.qkv_proj = linear.fused(prefix, ["q_proj", "k_proj", "v_proj"], h, sizes, bias)
        if self.qkv_proj is None:
            self.q_proj = linear(f"{prefix}q_proj", h, spec.q_size, bias)
            self.k_proj = linear(f"{prefix}k_proj", h, spec.kv_size, bias)
            self.v_proj = linear(f"{prefix}v_proj", h, spec.kv_size, bias)
        self.o_proj = linear(f"{prefix}o_proj", spec.q_size, h, spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, spec.norm_unit_offset)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, spec.norm_unit_offset)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, backend: AttentionBackend
    ) -> torch.Tensor:
        spec = self.spec
        lead = x.shape[:-1]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(*lead, spec.num_heads, spec.head_dim)
        k = k.reshape(*lead, spec.num_kv_heads, spec.head_dim)
        v = v.reshape(*lead, spec.num_kv_heads, spec.head_dim)
        if spec.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.rope(q, k, cos, sin)
        out = backend(layer, q, k, v, window=self.window, scale=self.scale)
        return self.o_proj(out.reshape(*lead, spec.q_size))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, prefix: str, linear: LinearFactory) -> None:
        super().__init__()
        h, i, bias = spec.hidden_size, spec.intermediate_size, spec.mlp_bias
        self.act_mul = ops.gelu_tanh_mul if spec.activation == "gelu_tanh" else ops.silu_mul
        self.gate_up_proj = linear.fused(prefix, ["gate_proj", "up_proj"], h, [i, i], bias)
        if self.gate_up_proj is None:
            self.gate_proj = linear(f"{prefix}gate_proj", h, i, bias)
            self.up_proj = linear(f"{prefix}up_proj", h, i, bias)
        self.down_proj = linear(f"{prefix}down_proj", i, h, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act_mul(gate, up))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, index: int, prefix: str, linear: LinearFactory) -> None:
        super().__init__()
        self.residual_scale = spec.residual_scale
        eps, offset = spec.rms_norm_eps, spec.norm_unit_offset
        self.input_layernorm = RMSNorm(spec.hidden_size, eps, offset)
        self.self_attn = Attention(spec, index, f"{prefix}self_attn.", linear)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps, offset)
        self.mlp = MLP(spec, f"{prefix}mlp.", linear)
        # (attention output norm, MLP input norm, MLP output norm), a plain tuple so that no module is
        # registered twice. Llama: post_attention_layernorm is the MLP's input norm. Sandwich
        # (Gemma): it norms the attention output, and the MLP has a norm on each side.
        self.norm_roles: tuple[RMSNorm | None, RMSNorm, RMSNorm | None] = (None, self.post_attention_layernorm, None)
        if spec.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, eps, offset)
            self.norm_roles = (
                self.post_attention_layernorm,
                self.pre_feedforward_layernorm,
                self.post_feedforward_layernorm,
            )

    def step(
        self,
        h: torch.Tensor,
        normed: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer: int,
        backend: AttentionBackend,
        next_norm: RMSNorm | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Residual stream h and its input_layernorm(h) -> the new residual stream and next_norm of it:
        each residual add is fused with the norm that follows it (the next layer's, or the final)."""
        attn_out_norm, mlp_in_norm, mlp_out_norm = self.norm_roles
        attn = self.self_attn(normed, cos, sin, layer, backend)
        if attn_out_norm is not None:
            attn = attn_out_norm(attn)
        h, x = mlp_in_norm.add(h, attn, self.residual_scale)
        mlp = self.mlp(x)
        if mlp_out_norm is not None:
            mlp = mlp_out_norm(mlp)
        if next_norm is None:
            return (h + mlp * self.residual_scale if self.residual_scale != 1.0 else h + mlp), None
        return next_norm.add(h, mlp, self.residual_scale)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, backend: AttentionBackend
    ) -> torch.Tensor:
        return self.step(h, self.input_layernorm(h), cos, sin, layer, backend, None)[0]


class DecoderBody(nn.Module):
    """`model.*` in HF naming: embeddings, layers, final norm."""

    def __init__(self, spec: ModelSpec, linear: LinearFactory) -> None:
        super().__init__()
        # On the meta device (the loader's build) no random init: nn.Embedding's normal_ on a meta tensor
        # goes through torch._refs, which imports torch._dynamo, inductor and sympy (~70 MB of RSS).
        weight = torch.empty(spec.vocab_size, spec.hidden_size) if torch.get_default_device().type == "meta" else None
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, f"model.layers.{i}.", linear) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_unit_offset)


class CausalLM(nn.Module):
    """A Llama-family causal LM with the HF parameter names (`model.*`, `lm_head.weight`).

    `linear` decides each linear's quant method and whether q/k/v and gate/up are fused (default:
    float32, unfused, as the checkpoint names them)."""

    # A fused layer's shards, in order, by the checkpoint names of the modules they come from.
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, spec: ModelSpec, linear: LinearFactory | None = None) -> None:
        super().__init__()
        linear = linear or LinearFactory(tied_lm_head=spec.tie_word_embeddings)
        self.spec = spec
        self.model = DecoderBody(spec, linear)
        self.lm_head = linear("lm_head", spec.hidden_size, spec.vocab_size, False)
        with torch.device("cpu"):  # real even when the module is built on the meta device
            self.rotary = Rotary(spec.rope, spec.head_dim)
            # Sliding layers with a rope of their own (Gemma's local base frequency).
            self.local_rotary = Rotary(spec.local_rope, spec.head_dim) if spec.local_rope is not None else None

    @property
    def dtype(self) -> torch.dtype:
        embedding = self.model.embed_tokens
        return embedding.weight.dtype if isinstance(embedding, nn.Embedding) else embedding.dtype

    def native_decode_plan(self) -> list | None:
        """The native decode plans, built on first use (after loading: every layer is packed and fused by then)."""
        if not hasattr(self, "_native_plan"):
            self._native_plan = native_decode.build_plan(self)
            log.info("decode steps: %s", "native (one call per step)" if self._native_plan else "Python layer loop")
        return self._native_plan

    def reset_native_decode_plan(self) -> None:
        """For A/B tests that switch native decode on and off on one loaded model."""
        self.__dict__.pop("_native_plan", None)

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        """A contiguous cache in the model's dtype, or `dtype` (a 16-bit cache under a float32 model)."""
        return KVCache(self.spec, batch, max_len, dtype or self.dtype)

    def rope_tables(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cos/sin tables [*positions.shape, head_dim] (one table unless sliding
        layers have a rope of their own)."""
        tables = self.rotary(positions, self.dtype)
        if self.local_rotary is None:
            return [tables] * self.spec.num_layers
        local = self.local_rotary(positions, self.dtype)
        return [local if self.spec.is_sliding(i) else tables for i in range(self.spec.num_layers)]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        scale = self.spec.embedding_scale
        if scale != 1.0:
            if self.spec.embedding_scale_in_dtype:  # as HF's Gemma: the fp32 scale rounded to the dtype first
                h = h * torch.tensor(scale, dtype=torch.float32).to(h.dtype)
            else:
                h = h * scale
        return h

    @torch.inference_mode()
    def forward_tokens(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        """Final-norm hidden states [..., H] for token ids [...] at the given positions."""
        decode_cache = getattr(backend, "decode_cache", lambda: None)()
        if decode_cache is not None:
            plans = self.native_decode_plan()
            if plans is not None:
                flat = positions.expand(input_ids.shape).reshape(-1)  # one position per token
                return native_decode.decode(self, plans, input_ids, flat, decode_cache)
        tables = self.rope_tables(positions)
        h = self.embed(input_ids)
        layers = self.model.layers
        normed = layers[0].input_layernorm(h)
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            h, normed = layer.step(h, normed, *tables[i], i, backend, next_norm)
        return normed

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Final-norm hidden states [B, T, H] for input_ids [B, T] appended after the cached tokens."""
        t = input_ids.shape[1]
        start = cache.length if cache is not None else 0
        if cache is not None and start + t > cache.max_len:
            raise ValueError(f"KV cache holds {cache.max_len} tokens; {start + t} requested")
        backend = ContiguousAttention(cache, start, new_tokens=t)
        h = self.forward_tokens(input_ids, torch.arange(start, start + t), backend)
        if cache is not None:
            cache.length = start + t
        return h

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits for hidden states [..., H] (soft-capped in fp32 where the spec says so)."""
        if self.spec.logit_scale != 1.0:
            hidden = hidden * self.spec.logit_scale
        logits = self.lm_head(hidden).float()
        cap = self.spec.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        return self.logits(self.hidden_states(input_ids, cache))
