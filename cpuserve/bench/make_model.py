"""`cpuserve bench make-model`: a checkpoint with a real model's exact shapes and random weights.

The seed's model (MiniCPM5-2B) cannot be downloaded here; its shapes are public. Weights are
drawn with a small std so activations stay in a sane range through 42 layers, and the bundled
SmolLM2 tokenizer is copied (ids past its vocabulary decode to nothing).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from tqdm import tqdm

from cpuserve.errors import CpuserveError
from cpuserve.model.checkpoint import ShardWriter, atomic_directory

SHAPES = {
    "minicpm5-2b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 42,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "vocab_size": 130560,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "rope_theta": 5000000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    },
    # MiniCPM5-2B's layout (untied float head, 8 query heads a KV head, head_dim 128, llama rope)
    # at test size, with SmolLM2's vocabulary so the copied tokenizer covers every id.
    "minicpm5-tiny": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 2,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "vocab_size": 49152,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 5000000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _layer_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }


def make_model(shape: str, out: Path, tokenizer_dir: Path, seed: int = 0, force: bool = False) -> Path:
    if shape not in SHAPES:
        raise CpuserveError(f"--shape {shape!r} is unknown (known: {', '.join(SHAPES)})")
    cfg = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        f"model.layers.{n}.{k}": v for n in range(cfg["num_hidden_layers"]) for k, v in _layer_shapes(cfg).items()
    }
    shapes["model.embed_tokens.weight"] = (cfg["vocab_size"], cfg["hidden_size"])
    shapes["model.norm.weight"] = (cfg["hidden_size"],)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], cfg["hidden_size"])
    with atomic_directory(out, force) as partial:
        writer = ShardWriter(partial)
        for name in tqdm(list(shapes), desc=f"random {shape}", unit="tensor"):
            dims = shapes[name]
            if len(dims) == 1:
                t = torch.ones(dims)
            elif name == "model.embed_tokens.weight":
                t = torch.randn(dims, generator=gen) * 0.02
            else:  # std 1/sqrt(fan_in): each projection keeps the activation scale
                t = torch.randn(dims, generator=gen) / dims[1] ** 0.5
            writer.add(name, t.to(torch.bfloat16))
        writer.finish()
        (partial / "config.json").write_text(json.dumps(cfg, indent=2))
        (partial / "generation_config.json").write_text(json.dumps({"eos_token_id": cfg["eos_token_id"]}))
        for fname in TOKENIZER_FILES:
            if (tokenizer_dir / fname).is_file():
                shutil.copy(tokenizer_dir / fname, partial / fname)
    return out
