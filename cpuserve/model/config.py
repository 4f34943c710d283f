"""The model spec: an HF `config.json` checked and reduced to what the decoder needs.

Every supported architecture is a Llama-family decoder that differs in a few switches (biases,
q/k norms, MiniCPM scalings, Gemma's norms, GeGLU, sliding windows and per-layer-type rope);
naming those switches here keeps the decoder free of model names.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cpuserve.errors import ConfigError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MiniCPMForCausalLM",
    "Gemma3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
ACTIVATIONS = ("silu", "gelu_tanh")  # SwiGLU, GeGLU with the tanh approximation of GELU


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters (HF `rope_parameters` / `rope_scaling` + `rope_theta`)."""

    theta: float
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    """What the decoder needs to know about a checkpoint, validated once at load."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # MiniCPM (1/2) scalings; 1.0 everywhere else.
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    logit_scale: float = 1.0
    # Gemma 3 switches; the defaults are the Llama layer.
    embedding_scale_in_dtype: bool = False  # the scale rounded to the compute dtype before multiplying
    norm_unit_offset: bool = False  # RMSNorm weights w stored as offsets: x * (1 + w), fp32 math
    sandwich_norms: bool = False  # attention and MLP outputs normed too; pre_feedforward_layernorm before the MLP
    activation: str = "silu"  # one of ACTIVATIONS
    attention_scale: float | None = None  # None: head_dim ** -0.5
    layer_types: tuple[str, ...] = ()  # per layer, from LAYER_TYPES; empty: every layer full attention
    sliding_window: int | None = None  # a sliding layer's query sees the keys with q - k < sliding_window
    local_rope: RopeSpec | None = None  # rope of sliding layers (None: `rope`)
    final_logit_softcapping: float | None = None  # logits -> tanh(logits / cap) * cap
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quantization_config: dict[str, Any] | None = field(default=None, compare=False, hash=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING_ATTENTION

    def layer_window(self, layer: int) -> int | None:
        """How many most recent keys (the query's own included) a layer's query sees; None: all."""
        return self.sliding_window if self.is_sliding(layer) else None

    def layer_rope(self, layer: int) -> RopeSpec:
        return self.local_rope if self.local_rope is not None and self.is_sliding(layer) else self.rope


def _field(cfg: dict[str, Any], name: str, kind: type, source: str, default: Any = ...) -> Any:
    value = cfg.get(name)
    if value is None:
        if default is ...:
            raise ConfigError(f"{source}: field '{name}' is missing (expected {kind.__name__})")
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ConfigError(f"{source}: field '{name}' is {value!r}, expected {kind.__name__}")
    if kind in (int, float) and value <= 0:
        raise ConfigError(f"{source}: field '{name}' is {value!r}, expected a positive number")
    return value


def _rope_spec(cfg: dict[str, Any], source: str) -> RopeSpec:
    # transformers 5 writes `rope_parameters` (theta inside); older configs `rope_theta` + `rope_scaling`.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return _rope_from(params, cfg.get("rope_theta", 10000.0), source)


def _rope_from(params: Any, default_theta: Any, source: str) -> RopeSpec:
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: 'rope_scaling' is {params!r}, expected an object or null")
    theta = params.get("rope_theta", default_theta)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{source}: rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    fields = {"theta": _field({"rope_theta": theta}, "rope_theta", float, source), "type": rope_type}
    if rope_type in ("linear", "llama3"):
        fields["factor"] = _field(params, "factor", float, source)
    if rope_type == "llama3":
        fields["low_freq_factor"] = _field(params, "low_freq_factor", float, source)
        fields["high_freq_factor"] = _field(params, "high_freq_factor", float, source)
        fields["original_max_position_embeddings"] = _field(params, "original_max_position_embeddings", int, source)
    return RopeSpec(**fields)


def _gemma3_ropes(cfg: dict[str, Any], source: str) -> tuple[RopeSpec, RopeSpec]:
    """(full-attention rope, sliding-attention rope). transformers 5 writes `rope_parameters` keyed
    by layer type; older configs `rope_theta` + `rope_scaling` (global layers only) and
    `rope_local_base_freq`. Gemma3TextConfig's defaults: 1e6 global, 1e4 local."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and set(params) & set(LAYER_TYPES):
        full = _rope_from(params.get(FULL_ATTENTION) or {}, cfg.get("rope_theta", 1_000_000.0), source)
        local = _rope_from(params.get(SLIDING_ATTENTION) or {}, cfg.get("rope_local_base_freq", 10_000.0), source)
        return full, local
    full = _rope_from(cfg.get("rope_scaling") or {}, cfg.get("rope_theta", 1_000_000.0), source)
    local = _rope_from({}, cfg.get("rope_local_base_freq", 10_000.0), source)
    return full, local


def _gemma3_layer_types(cfg: dict[str, Any], layers: int, source: str) -> tuple[str, ...]:
    """`layer_types`, or Gemma3TextConfig's default: every `sliding_window_pattern`-th layer global."""
    types = cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern <= 0:
            raise ConfigError(f"{source}: field 'sliding_window_pattern' is {pattern!r}, expected a positive int")
        return tuple(SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(layers))
    if not isinstance(types, list) or len(types) != layers:
        raise ConfigError(f"{source}: field 'layer_types' is {types!r}, expected a list of {layers} layer types")
    for i, kind in enumerate(types):
        if kind not in LAYER_TYPES:
            supported = ", ".join(LAYER_TYPES)
            raise ConfigError(f"{source}: layer_types[{i}] is {kind!r}, an unknown layer type (supported: {supported})")
    return tuple(types)


def _gemma3_switches(cfg: dict[str, Any], source: str, hidden: int, layers: int) -> dict[str, Any]:
    act = cfg.get("hidden_activation", cfg.get("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"{source}: hidden_activation {act!r} is not supported (expected 'gelu_pytorch_tanh')")
    if cfg.get("attn_logit_softcapping") is not None:
        raise ConfigError(f"{source}: attn_logit_softcapping is not supported (expected null, as Gemma 3 has)")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError(f"{source}: use_bidirectional_attention is not supported (a causal LM is served)")
    cap = cfg.get("final_logit_softcapping")
    types = _gemma3_layer_types(cfg, layers, source)
    window = None
    if SLIDING_ATTENTION in types:
        if "sliding_window" in cfg and cfg["sliding_window"] is None:
            raise ConfigError(f"{source}: field 'sliding_window' is null, but layer_types has sliding_attention layers")
        window = _field(cfg, "sliding_window", int, source, default=4096)
    full, local = _gemma3_ropes(cfg, source)
    return {
        "qk_norm": True,
        "norm_unit_offset": True,
        "sandwich_norms": True,
        "activation": "gelu_tanh",
        "embedding_scale": math.sqrt(hidden),
        "embedding_scale_in_dtype": True,
        "attention_scale": _field(cfg, "query_pre_attn_scalar", float, source, default=256.0) ** -0.5,
        "layer_types": types,
        "sliding_window": window,
        "rope": full,
        "local_rope": local,
        "final_logit_softcapping": None if cap is None else _field(cfg, "final_logit_softcapping", float, source),
    }


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def spec_from_config(cfg: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """Validate an HF config dict; raise ConfigError naming the field on anything unsupported."""
    archs = cfg.get("architectures") or []
    if not archs:
        raise ConfigError(f"{source}: field 'architectures' is missing")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"{source}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    quant = cfg.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise ConfigError(f"{source}: quantization_config must be an object")
    act = cfg.get("hidden_act", "silu")
    if act != "silu" and arch != "Gemma3ForCausalLM":  # Gemma's is checked with its other fields
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported (expected 'silu')")
    if cfg.get("use_sliding_window"):
        raise ConfigError(f"{source}: sliding-window attention (use_sliding_window) is not supported")

    hidden = _field(cfg, "hidden_size", int, source)
    layers = _field(cfg, "num_hidden_layers", int, source)
    heads = _field(cfg, "num_attention_heads", int, source)
    kv_heads = _field(cfg, "num_key_value_heads", int, source, default=heads)
    if heads % kv_heads:
        raise ConfigError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    # Gemma3TextConfig's head_dim defaults to 256, everyone else's to hidden / heads.
    head_dim = _field(cfg, "head_dim", int, source, default=None) or (
        256 if arch == "Gemma3ForCausalLM" else hidden // heads
    )
    if head_dim % 2:
        raise ConfigError(f"{source}: head_dim {head_dim} must be even for rotary embeddings")

    attention_bias = bool(cfg.get("attention_bias", False))
    switches: dict[str, Any] = {
        "qkv_bias": attention_bias,
        "o_bias": attention_bias,
        "mlp_bias": bool(cfg.get("mlp_bias", False)),
    }
    if arch == "Qwen2ForCausalLM":
        switches.update(qkv_bias=True, o_bias=False)
    elif arch == "Qwen3ForCausalLM":
        switches["qk_norm"] = True
    elif arch == "MiniCPMForCausalLM":
        scale_depth = _field(cfg, "scale_depth", float, source)
        dim_model_base = _field(cfg, "dim_model_base", float, source)
        switches.update(
            embedding_scale=_field(cfg, "scale_emb", float, source),
            residual_scale=scale_depth / math.sqrt(layers),
            logit_scale=dim_model_base / hidden,
        )
    elif arch == "Gemma3ForCausalLM":
        switches.update(_gemma3_switches(cfg, source, hidden, layers))

    tied_default = arch in ("MiniCPMForCausalLM", "Gemma3ForCausalLM")
    rope = switches.pop("rope", None) or _rope_spec(cfg, source)
    return ModelSpec(
        architecture=arch,
        vocab_size=_field(cfg, "vocab_size", int, source),
        hidden_size=hidden,
        intermediate_size=_field(cfg, "intermediate_size", int, source),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_field(cfg, "rms_norm_eps", float, source, default=1e-6),
        rope=rope,
        max_position_embeddings=_field(cfg, "max_position_embeddings", int, source, default=2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", tied_default)),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
        quantization_config=quant,
        **switches,
    )


def load_spec(model_dir: Path) -> ModelSpec:
    """Read and validate `<model_dir>/config.json`."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: missing (expected an HF config.json in the model directory)")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return spec_from_config(cfg, str(path))
