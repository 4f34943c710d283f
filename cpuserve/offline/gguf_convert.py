"""`cpuserve convert`: a llama-, qwen2-, qwen3-, gemma3- or phi3-architecture GGUF becomes an HF directory
(bf16 safetensors).

llama.cpp stores each architecture its own way: llama q/k rows permuted for its rope layout (undone
here), Gemma 3 norm weights with the 1 of `x * (1 + w)` added in (taken off here), and Gemma's
hyper-parameters llama.cpp hard-codes (layer pattern, local rope base, attention scale) written
back into the config. Phi-3 keeps HF's fused `attn_qkv` / `ffn_up` (gate rows, then up) and rows
(rotate-half rope: nothing permuted); its longrope factors are tensors (`rope_factors_short` /
`rope_factors_long`), read back into config.json's rope_scaling.

The output is written beside the target under a `.partial` name and renamed into place only when
complete, so an interrupted conversion never leaves a directory that looks finished.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tqdm import tqdm

from cpuserve.errors import CheckpointError
from cpuserve.model.checkpoint import ShardWriter, atomic_directory
from cpuserve.offline.gguf_tokenizer import build_tokenizer, special_token_flags

log = logging.getLogger(__name__)

SUPPORTED_TYPES = {
    gguf.GGMLQuantizationType.F32,
    gguf.GGMLQuantizationType.F16,
    gguf.GGMLQuantizationType.BF16,
    gguf.GGMLQuantizationType.Q8_0,
    gguf.GGMLQuantizationType.Q4_0,
    gguf.GGMLQuantizationType.Q4_1,
    gguf.GGMLQuantizationType.Q5_0,
    gguf.GGMLQuantizationType.Q5_1,
    gguf.GGMLQuantizationType.Q4_K,
    gguf.GGMLQuantizationType.Q5_K,
    gguf.GGMLQuantizationType.Q6_K,
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


# Gemma 3 (gguf-py's tensor map): ffn_norm is the MLP's input norm, the sandwich norms have names of their own.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Phi-3 (gguf-py's tensor map): HF's fused projections under llama.cpp's names; ffn_up holds gate then up.
_PHI3_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if k not in ("ffn_gate.weight", "ffn_up.weight")},
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
# Qwen2 (q/k/v biases) and Qwen3 (q/k RMSNorm): llama's names and more; llama.cpp runs both with
# rotate-half (neox) rope, so their q/k rows are stored as HF has them (nothing to undo).
_QWEN2_LAYER_NAMES = {
    **_LAYER_NAMES,
    **{f"attn_{p}.bias": f"self_attn.{p}_proj.bias" for p in "qkv"},
}
_QWEN3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Global tensors that are hyper-parameters, not weights: they go into config.json.
ROPE_FACTOR_TENSORS = {"rope_factors_short.weight": "short_factor", "rope_factors_long.weight": "long_factor"}
_ARCH_LAYER_NAMES = {
    "llama": _LAYER_NAMES,
    "qwen2": _QWEN2_LAYER_NAMES,
    "qwen3": _QWEN3_LAYER_NAMES,
    "gemma3": _GEMMA3_LAYER_NAMES,
    "phi3": _PHI3_LAYER_NAMES,
}
# The llama-shaped architectures' transformers class and model_type.
_LLAMA_LIKE = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
SUPPORTED_ARCHITECTURES = tuple(_ARCH_LAYER_NAMES)
OUTPUT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

# What llama.cpp fixes for every Gemma 3 rather than storing (llama-model.cpp, LLM_ARCH_GEMMA3): every
# 6th layer global, the rest sliding; sliding layers' rope base 10000 (never scaled).
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA3_27B_LAYERS = 62  # the one size whose attention scale is (hidden / heads) ** -0.5, not head_dim ** -0.5


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF tensor name for a GGUF tensor name of this architecture, or None when it has none."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _ARCH_LAYER_NAMES[arch]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
    return None


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rope pairs back to HF's rotate-half)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order from HF's (the inverse of unpermute_rope)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str | None:
    """The llama GGUF tensor name for an HF tensor name (inverse of hf_name)."""
    for g, h in _GLOBAL_NAMES.items():
        if h == hf:
            return g
    parts = hf.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        for g, h in _LAYER_NAMES.items():
            if h == parts[3]:
                return f"blk.{parts[2]}.{g}"
    return None


def open_gguf(path: Path) -> gguf.GGUFReader:
    """A GGUF reader, or one clear CheckpointError for a missing, corrupt or truncated file."""
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found (expected a .gguf file)")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises a variety of types on a bad or truncated file
        raise CheckpointError(f"{path}: not a readable GGUF file, truncated or corrupt ({exc})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise CheckpointError(
                f"{path}: truncated: tensor '{t.name}' needs bytes up to {t.data_offset + t.n_bytes}, "
                f"the file has {size}"
            )
    return reader


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    meta = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except Exception:
            continue
    return meta


def _f32(value: Any) -> float:
    """GGUF stores floats as float32: write the shortest decimal that reads back the same."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def _require(meta: dict[str, Any], key: str, source: Path) -> Any:
    if key not in meta:
        raise CheckpointError(f"{source}: metadata '{key}' is missing")
    return meta[key]


def gguf_architecture(meta: dict[str, Any], source: Path) -> str:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        expected = " or ".join(repr(a) for a in SUPPORTED_ARCHITECTURES)
        raise CheckpointError(f"{source}: general.architecture {arch!r} is not supported (expected {expected})")
    return arch


def hf_config(
    meta: dict[str, Any], tied: bool, source: Path, rope_factors: dict[str, list[float]] | None = None
) -> dict[str, Any]:
    """config.json for the GGUF's architecture (rope_factors: the ROPE_FACTOR_TENSORS' values by
    GGUF name, which a phi3 file's longrope needs)."""
    arch = gguf_architecture(meta, source)
    if arch == "phi3":
        return _phi3_config(meta, tied, source, rope_factors or {})
    return _gemma3_config(meta, tied, source) if arch == "gemma3" else _llama_config(meta, tied, source, arch)


def _phi3_config(meta: dict[str, Any], tied: bool, source: Path, factors: dict[str, list[float]]) -> dict[str, Any]:
    """Phi3Config's fields. longrope when the file has the factor tensors; llama.cpp's converter
    stores transformers' attention factor as rope.scaling.attn_factor, written back only where it is
    not what transformers derives from the context lengths anyway."""
    heads = int(_require(meta, "phi3.attention.head_count", source))
    hidden = int(_require(meta, "phi3.embedding_length", source))
    head_dim = hidden // heads
    if int(meta.get("phi3.rope.dimension_count", head_dim)) != head_dim:
        raise CheckpointError(
            f"{source}: phi3.rope.dimension_count {meta['phi3.rope.dimension_count']} is not the head size "
            f"{head_dim} (partial rotary embeddings are not supported)"
        )
    ctx = int(meta.get("phi3.context_length", 4096))
    original = int(meta.get("phi3.rope.scaling.original_context_length", ctx))
    rope: dict[str, Any] | None = None
    if factors or meta.get("phi3.rope.scaling.attn_factor") is not None:
        missing = [n for n in ROPE_FACTOR_TENSORS if n not in factors]
        if missing:
            raise CheckpointError(f"{source}: tensor '{missing[0]}' is missing (longrope needs both factor tensors)")
        rope = {
            "rope_type": "longrope",
            **{key: [_f32(x) for x in factors[n]] for n, key in ROPE_FACTOR_TENSORS.items()},
        }
        attn = meta.get("phi3.rope.scaling.attn_factor")
        scale = ctx / original
        derived = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
        if attn is not None and abs(float(attn) - derived) > 1e-6 * derived:
            rope["attention_factor"] = _f32(attn)
    window = meta.get("phi3.attention.sliding_window")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    theta = _f32(meta.get("phi3.rope.freq_base", 10000.0))
    return {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "hidden_size": hidden,
        "intermediate_size": int(_require(meta, "phi3.feed_forward_length", source)),
        "num_hidden_layers": int(_require(meta, "phi3.block_count", source)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("phi3.attention.head_count_kv", heads)),
        "rms_norm_eps": _f32(meta.get("phi3.attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": ctx,
        "original_max_position_embeddings": original,
        "vocab_size": int(meta.get("phi3.vocab_size", len(tokens))),
        "hidden_act": "silu",
        "rope_theta": theta,
        "rope_scaling": rope,
        "sliding_window": int(window) if window else None,
        "tie_word_embeddings": tied,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "bfloat16",
    }


def _llama_config(meta: dict[str, Any], tied: bool, source: Path, arch: str = "llama") -> dict[str, Any]:
    """The config of a llama-shaped GGUF (llama, qwen2, qwen3: the same keys under the arch's prefix)."""
    heads = int(_require(meta, f"{arch}.attention.head_count", source))
    hidden = int(_require(meta, f"{arch}.embedding_length", source))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": _f32(meta.get(f"{arch}.rope.freq_base", 10000.0))}
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=_f32(_require(meta, f"{arch}.rope.scaling.factor", source)))
    elif scaling not in ("none", None):
        raise CheckpointError(f"{source}: {arch}.rope.scaling.type {scaling!r} is not supported")
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    if int(meta.get(f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise CheckpointError(f"{source}: {arch}.attention.value_length differs from key_length ({head_dim})")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    architecture, model_type = _LLAMA_LIKE[arch]
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(_require(meta, f"{arch}.feed_forward_length", source)),
        "num_hidden_layers": int(_require(meta, f"{arch}.block_count", source)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "vocab_size": int(meta.get(f"{arch}.vocab_size", len(tokens))),
        "hidden_act": "silu",
        "rope_parameters": rope,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": None if rope["rope_type"] == "default" else rope,
        "tie_word_embeddings": tied,
        "attention_bias": arch == "qwen2",  # Qwen2's q/k/v biases (its class always has them)
        "use_sliding_window": False,
        "mlp_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "bfloat16",
    }


def _gemma3_config(meta: dict[str, Any], tied: bool, source: Path) -> dict[str, Any]:
    """Gemma3TextConfig's fields: the GGUF's hyper-parameters and what llama.cpp assumes for the rest."""
    if meta.get("gemma3.attn_logit_softcapping"):
        raise CheckpointError(f"{source}: gemma3.attn_logit_softcapping is not supported")
    heads = int(_require(meta, "gemma3.attention.head_count", source))
    hidden = int(_require(meta, "gemma3.embedding_length", source))
    layers = int(_require(meta, "gemma3.block_count", source))
    head_dim = int(meta.get("gemma3.attention.key_length", 256))
    if int(meta.get("gemma3.attention.value_length", head_dim)) != head_dim:
        raise CheckpointError(f"{source}: gemma3.attention.value_length differs from key_length ({head_dim})")
    window = int(meta.get("gemma3.attention.sliding_window", 0))  # 0 / absent: no sliding layers
    layer_types = [
        "sliding_attention" if window and (i + 1) % _GEMMA3_PATTERN else "full_attention" for i in range(layers)
    ]
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": _f32(meta.get("gemma3.rope.freq_base", 1e6))}
    scaling = meta.get("gemma3.rope.scaling.type", "none")
    if scaling == "linear":
        full.update(rope_type="linear", factor=_f32(_require(meta, "gemma3.rope.scaling.factor", source)))
    elif scaling not in ("none", None):
        raise CheckpointError(f"{source}: gemma3.rope.scaling.type {scaling!r} is not supported")
    local = {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_BASE}
    cap = meta.get("gemma3.final_logit_softcapping")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "intermediate_size": int(_require(meta, "gemma3.feed_forward_length", source)),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("gemma3.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(meta.get("gemma3.attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(meta.get("gemma3.context_length", 131072)),
        "vocab_size": int(meta.get("gemma3.vocab_size", len(tokens))),
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // heads if layers == _GEMMA3_27B_LAYERS else head_dim,
        "sliding_window": window or None,
        "layer_types": layer_types,
        "rope_parameters": {"full_attention": full, "sliding_attention": local},
        # The same, in the names configs before transformers 5 use.
        "rope_theta": full["rope_theta"],
        "rope_local_base_freq": local["rope_theta"],
        "rope_scaling": None if full["rope_type"] == "default" else {"rope_type": "linear", "factor": full["factor"]},
        "final_logit_softcapping": _f32(cap) if cap else None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else sorted(set(eos)) or None,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "bfloat16",
    }


def tokenizer_files(meta: dict[str, Any], config: dict[str, Any], source: Path) -> dict[str, str]:
    tokens = _require(meta, "tokenizer.ggml.tokens", source)

    def token(key: str) -> str | None:
        idx = meta.get(key)
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    template = meta.get("tokenizer.chat_template") or _fallback_template(meta, source)
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        **special_token_flags(meta),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    if template:
        tok_config["chat_template"] = template
    files = {
        "tokenizer.json": build_tokenizer(meta, str(source)).to_str(pretty=True),
        "tokenizer_config.json": json.dumps(tok_config, indent=2, ensure_ascii=False),
        "generation_config.json": _generation_config(meta),
    }
    if template:
        files["chat_template.jinja"] = template
    return files


# Chat formats fixed by an architecture, for GGUFs that carry no template (the Gemma 3 files do
# not): Gemma's turns are `<start_of_turn>ROLE\nTEXT<end_of_turn>\n`, the assistant's role named
# "model", the system messages' text put at the start of the next user turn (Gemma has no system
# role; several system messages, such as Responses' instructions and a developer item, all kept). A
# system message after the last turn has no turn to go in: refused (it was dropped), as Gemma's own
# template refuses any system message but the first.
ARCH_TEMPLATES = {
    "gemma3": (
        "{{ bos_token }}{% set ns = namespace(prefix='') %}"
        "{% for m in messages %}{% set text = m['content'] if m['content'] is string else "
        "m['content'] | map(attribute='text') | join('') %}"
        "{% if m['role'] == 'system' %}{% set ns.prefix = ns.prefix ~ text | trim ~ '\n\n' %}"
        "{% else %}{{ '<start_of_turn>' ~ ('model' if m['role'] == 'assistant' else m['role']) ~ '\n' ~ ns.prefix"
        " ~ (text | trim) ~ '<end_of_turn>\n' }}{% set ns.prefix = '' %}{% endif %}{% endfor %}"
        "{% if ns.prefix %}{{ raise_exception('a system message after the last user or assistant message: "
        "Gemma has no system role, and no turn follows it to carry its text') }}{% endif %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
    ),
}
# Tokens that end a turn in an architecture's chat format, stop tokens beside the file's EOS.
_ARCH_TURN_ENDS = {"gemma3": ("<end_of_turn>",)}


def _fallback_template(meta: dict[str, Any], source: Path) -> str | None:
    template = ARCH_TEMPLATES.get(meta.get("general.architecture", ""))
    if template:
        log.warning("%s carries no chat template: using the %s turn format", source, meta["general.architecture"])
    return template


def _generation_config(meta: dict[str, Any]) -> str:
    eos_ids = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    tokens = meta.get("tokenizer.ggml.tokens") or []
    for end in _ARCH_TURN_ENDS.get(meta.get("general.architecture", ""), ()):
        if end in tokens:
            eos_ids.append(tokens.index(end))
    generation = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": sorted(set(eos_ids))}
    if len(generation["eos_token_id"]) == 1:
        generation["eos_token_id"] = generation["eos_token_id"][0]
    return json.dumps(generation, indent=2)


def _dequantize(t: Any, source: Path) -> np.ndarray:
    if t.tensor_type not in SUPPORTED_TYPES:
        raise CheckpointError(
            f"{source}: tensor '{t.name}' has type {t.tensor_type.name}, expected one of "
            + ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
        )
    shape = tuple(int(d) for d in reversed(t.shape))  # GGML lists the fastest dimension first
    if t.tensor_type == gguf.GGMLQuantizationType.F32:
        data = np.asarray(t.data, dtype=np.float32)
    elif t.tensor_type == gguf.GGMLQuantizationType.F16:
        data = np.asarray(t.data, dtype=np.float16).astype(np.float32)
    else:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
    return data.reshape(shape)


def to_hf_layout(arch: str, name: str, data: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """Undo what llama.cpp's converter did to this tensor: llama's q/k row permutation (Gemma's
    rows are stored as HF has them), Gemma's +1 on every norm weight."""
    if arch == "llama":
        if name.endswith("attn_q.weight"):
            return unpermute_rope(data, config["num_attention_heads"])
        if name.endswith("attn_k.weight"):
            return unpermute_rope(data, config["num_key_value_heads"])
    elif name.endswith("norm.weight") and stored_norm_offset(arch):
        return np.asarray(data, dtype=np.float32) - np.float32(stored_norm_offset(arch))
    return data


def stored_norm_offset(arch: str) -> float:
    """What llama.cpp added to every norm weight of this architecture (HF weight = stored - this):
    Gemma's norms scale by (1 + w), and llama.cpp stores 1 + w."""
    return 1.0 if arch == "gemma3" else 0.0


def convert_gguf(src: Path, out: Path, force: bool = False, progress: bool = True, dtype: str = "bfloat16") -> Path:
    """Convert; on success `out` is a complete HF directory, on any failure it does not exist."""
    return _convert(src, out, force, progress, dtype, with_tokenizer=True)


def convert_gguf_weights(
    src: Path, out: Path, force: bool = False, progress: bool = True, dtype: str = "bfloat16"
) -> Path:
    """config.json, generation_config.json and the weights without the tokenizer files: for a GGUF
    whose tokenizer cannot be converted (yet), when the tokenizer comes from elsewhere."""
    return _convert(src, out, force, progress, dtype, with_tokenizer=False)


def _convert(src: Path, out: Path, force: bool, progress: bool, dtype: str, with_tokenizer: bool) -> Path:
    if dtype not in OUTPUT_DTYPES:
        raise CheckpointError(f"output dtype {dtype!r} is not supported (expected one of {', '.join(OUTPUT_DTYPES)})")
    if out.exists() and not force:  # checked before the (long) read as well
        raise CheckpointError(f"{out}: already exists (pass --force to replace it)")
    reader = open_gguf(src)
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    arch = gguf_architecture(meta, src)
    factors = {
        t.name: _dequantize(t, src).reshape(-1).tolist() for t in reader.tensors if t.name in ROPE_FACTOR_TENSORS
    }
    config = hf_config(meta, tied="output.weight" not in names, source=src, rope_factors=factors)
    config["torch_dtype"] = dtype
    if "rope_freqs.weight" in names:
        raise CheckpointError(f"{src}: tensor 'rope_freqs.weight' (llama3 rope scaling) is not supported yet")
    unknown = sorted(n for n in names if hf_name(n, arch) is None and n not in ROPE_FACTOR_TENSORS)
    if unknown:
        raise CheckpointError(f"{src}: tensor '{unknown[0]}' has no place in a {arch} model")

    with atomic_directory(out, force) as partial:
        files = tokenizer_files(meta, config, src) if with_tokenizer else {}
        files.setdefault("generation_config.json", _generation_config(meta))
        for fname, text in files.items():
            (partial / fname).write_text(text)
        (partial / "config.json").write_text(json.dumps(config, indent=2))
        writer = ShardWriter(partial)
        for t in tqdm(reader.tensors, desc=f"converting {src.name}", unit="tensor", disable=not progress):
            if t.name in ROPE_FACTOR_TENSORS:
                continue  # in config.json
            data = to_hf_layout(arch, t.name, _dequantize(t, src), config)
            writer.add(
                hf_name(t.name, arch), torch.from_numpy(np.array(data, dtype=np.float32)).to(OUTPUT_DTYPES[dtype])
            )
        writer.finish()
    return out
