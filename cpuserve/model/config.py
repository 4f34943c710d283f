"""The model spec: an HF `config.json` checked and reduced to what the decoder needs.

Every supported architecture is a Llama-family decoder that differs in a few switches (biases,
q/k norms, MiniCPM scalings, Gemma's norms, GeGLU, sliding windows and per-layer-type rope,
Phi-3's pre-fused projections and longrope); naming those switches here keeps the decoder free of
model names.
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
    "MistralForCausalLM",
    "Phi3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")  # longrope: Phi-3 only (_phi3_rope)
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
    original_max_position_embeddings: int = 8192  # llama3; longrope: where the long factors start
    # longrope (Phi-3): per rotary pair divisors of the frequencies, for positions before / from
    # original_max_position_embeddings, and the factor cos and sin are multiplied by.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


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
    # Phi-3: the checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`
    # (model/prefused.py presents them under the separate names the decoder asks for).
    prefused_projections: bool = False
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


def _check_full_rotary(cfg: dict[str, Any], source: str) -> None:
    """A partial rotary factor below 1 rotates only part of each head, which the decoder does not
    do: refused, never ignored."""
    found: list[tuple[str, Any]] = [("partial_rotary_factor", cfg.get("partial_rotary_factor"))]
    for key in ("rope_parameters", "rope_scaling"):
        params = cfg.get(key)
        if isinstance(params, dict):
            nested = [(f"{key}.{k}.", v) for k, v in params.items() if isinstance(v, dict)]
            for where, d in [(f"{key}.", params), *nested]:
                found.append((f"{where}partial_rotary_factor", d.get("partial_rotary_factor")))
    for name, value in found:
        if value is not None and value != 1.0:
            raise ConfigError(f"{source}: field '{name}' is {value!r}; only 1.0 (whole heads rotated) is supported")


def _factor_list(params: dict[str, Any], name: str, length: int, source: str) -> tuple[float, ...]:
    value = params.get(name)
    good = isinstance(value, list) and len(value) == length
    good = good and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in value
    )
    if not good:
        raise ConfigError(
            f"{source}: rope_scaling field '{name}' is {value!r}, expected a list of {length} positive numbers "
            "(one per rotary pair: head_dim / 2)"
        )
    return tuple(float(x) for x in value)


def _phi3_rope(cfg: dict[str, Any], source: str, head_dim: int) -> RopeSpec:
    """Phi3Config's rope, as transformers computes it: default, or longrope ("su" in older configs).

    longrope: `original_max_position_embeddings` is the top-level field (default 4096; transformers
    prefers it to a copy inside rope_scaling, so a differing copy is refused); `factor` defaults to
    max_position_embeddings / original; `attention_factor` (multiplying cos and sin) to
    sqrt(1 + ln(factor) / ln(original)), or 1 when factor <= 1. Which factors a position gets:
    model/rope.py."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: 'rope_scaling' is {params!r}, expected an object or null")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return _rope_from(params, cfg.get("rope_theta", 10000.0), source)
    if rope_type not in ("longrope", "su"):
        raise ConfigError(
            f"{source}: rope type {rope_type!r} is not supported for Phi3ForCausalLM (expected default or longrope)"
        )
    theta_value = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    theta = _field({"rope_theta": theta_value}, "rope_theta", float, source)
    original = _field(cfg, "original_max_position_embeddings", int, source, default=4096)
    inner = params.get("original_max_position_embeddings")
    if inner is not None and inner != original:
        raise ConfigError(
            f"{source}: rope_scaling field 'original_max_position_embeddings' is {inner!r} but the top-level "
            f"original_max_position_embeddings is {original} (transformers uses the top-level one)"
        )
    if params.get("factor") is None:
        factor = _field(cfg, "max_position_embeddings", int, source, default=4096) / original
    else:
        factor = _field(params, "factor", float, source)
    if params.get("attention_factor") is not None:
        attention = _field(params, "attention_factor", float, source)
    elif factor <= 1.0:
        attention = 1.0
    elif original < 2:
        raise ConfigError(f"{source}: original_max_position_embeddings {original} leaves attention_factor undefined")
    else:
        attention = math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeSpec(
        theta=theta,
        type="longrope",
        factor=factor,
        original_max_position_embeddings=original,
        short_factor=_factor_list(params, "short_factor", head_dim // 2, source),
        long_factor=_factor_list(params, "long_factor", head_dim // 2, source),
        attention_factor=attention,
    )


def _uniform_window(cfg: dict[str, Any], source: str, layers: int, default: int | None) -> dict[str, Any]:
    """Mistral / Phi-3: one `sliding_window` for every layer (null: none; absent: the config class's
    default). transformers masks it as the decoder does: a query sees the keys with q - k < window,
    so the value is taken as it is."""
    window = cfg.get("sliding_window", default)
    if window is None:
        return {}
    window = _field({"sliding_window": window}, "sliding_window", int, source)
    return {"sliding_window": window, "layer_types": (SLIDING_ATTENTION,) * layers}


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


# The config classes' defaults where they differ from 2048.
_MAX_POSITIONS_DEFAULT = {"MistralForCausalLM": 4096 * 32, "Phi3ForCausalLM": 4096}


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
    if cfg.get("use_sliding_window"):  # Qwen2's switch (with max_window_layers); Mistral/Phi-3: sliding_window
        raise ConfigError(f"{source}: sliding-window attention (use_sliding_window) is not supported")
    _check_full_rotary(cfg, source)

    hidden = _field(cfg, "hidden_size", int, source)
    layers = _field(cfg, "num_hidden_layers", int, source)
    heads = _field(cfg, "num_attention_heads", int, source)
    kv_heads = _field(cfg, "num_key_value_heads", int, source, default=8 if arch == "MistralForCausalLM" else heads)
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
    elif arch == "MistralForCausalLM":
        # transformers' Mistral has no biases whatever the config says.
        switches.update(qkv_bias=False, o_bias=False, mlp_bias=False, **_uniform_window(cfg, source, layers, 4096))
    elif arch == "Phi3ForCausalLM":
        switches.update(qkv_bias=False, o_bias=False, mlp_bias=False, prefused_projections=True)
        switches.update(_uniform_window(cfg, source, layers, None), rope=_phi3_rope(cfg, source, head_dim))

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
        max_position_embeddings=_field(
            cfg, "max_position_embeddings", int, source, default=_MAX_POSITIONS_DEFAULT.get(arch, 2048)
        ),
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
