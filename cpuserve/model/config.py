"""The model spec: an HF `config.json` checked and reduced to what the decoder needs.

Every supported architecture is a Llama-family decoder that differs in a few switches (biases,
q/k norms, MiniCPM scalings); naming those switches here keeps the decoder free of model names.
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
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: 'rope_scaling' is {params!r}, expected an object or null")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
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
    if act != "silu":
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported (expected 'silu')")
    if cfg.get("use_sliding_window"):
        raise ConfigError(f"{source}: sliding-window attention (use_sliding_window) is not supported")

    hidden = _field(cfg, "hidden_size", int, source)
    layers = _field(cfg, "num_hidden_layers", int, source)
    heads = _field(cfg, "num_attention_heads", int, source)
    kv_heads = _field(cfg, "num_key_value_heads", int, source, default=heads)
    if heads % kv_heads:
        raise ConfigError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = _field(cfg, "head_dim", int, source, default=None) or hidden // heads
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

    tied_default = arch == "MiniCPMForCausalLM"
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
        rope=_rope_spec(cfg, source),
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
