"""Tiny random-weight checkpoints of every supported architecture against an independent reference:
transformers for Llama, Qwen2 and Qwen3; a small loop-based implementation written here for MiniCPM
(transformers has no MiniCPM without remote code)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cpuserve.model.loader import load_model

transformers = pytest.importorskip("transformers")

LOGIT_ABS_BUDGET = 1e-4  # fp32, tiny models: differences are rounding only
TINY = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=128,
    max_position_embeddings=256,
)


def _randomize(model: torch.nn.Module) -> None:
    """Every parameter random (biases and norms included), so each one matters."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if "norm" in name else 0.08
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + scale * torch.randn(p.shape, generator=gen))


CASES = {
    "llama-untied": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama-linear-rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            "rope_theta": 500000.0,
        },
    ),
    "llama-bias-headdim": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"attention_bias": True, "mlp_bias": True, "head_dim": 24},
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
}


def _make(case: str, out: Path, **save_kwargs) -> torch.nn.Module:
    cfg_name, cls_name, extra = CASES[case]
    cfg = getattr(transformers, cfg_name)(**TINY, **extra)
    model = getattr(transformers, cls_name)(cfg).eval()
    _randomize(model)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(out, **save_kwargs)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    ref = _make(case, tmp_path)
    ours = load_model(tmp_path, "float32")
    ids = torch.randint(0, TINY["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = ref(ids).logits
    got = ours(ids)
    err = (got - expected).abs().max().item()
    assert err < LOGIT_ABS_BUDGET, f"{case}: max |logit diff| {err:.2e}"
    # Prefill in chunks through the KV cache gives the same logits as one pass.
    cache = ours.new_cache(2, 64)
    chunks = [ours(ids[:, a:b], cache) for a, b in ((0, 17), (17, 18), (18, 33), (33, 40))]
    err = (torch.cat(chunks, dim=1) - expected).abs().max().item()
    assert err < LOGIT_ABS_BUDGET, f"{case}: chunked prefill max |logit diff| {err:.2e}"


def test_sharded_checkpoint_loads(tmp_path):
    ref = _make("llama-untied", tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ours = load_model(tmp_path, "float32")
    ids = torch.arange(20).unsqueeze(0)
    with torch.inference_mode():
        assert (ours(ids) - ref(ids).logits).abs().max().item() < LOGIT_ABS_BUDGET


# ---- MiniCPM -----------------------------------------------------------------------------------

MINICPM = dict(
    architectures=["MiniCPMForCausalLM"],
    model_type="minicpm",
    hidden_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=80,
    vocab_size=96,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    scale_emb=12.0,
    scale_depth=1.4,
    dim_model_base=16,
    tie_word_embeddings=True,
    hidden_act="silu",
)


def _minicpm_weights(cfg: dict) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    h, i, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    w = {
        "model.embed_tokens.weight": 0.1 * torch.randn(cfg["vocab_size"], h, generator=gen),
        "model.norm.weight": 1 + 0.2 * torch.randn(h, generator=gen),
    }
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes = {
            "self_attn.q_proj.weight": (h, h),
            "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, h),
            "mlp.gate_proj.weight": (i, h),
            "mlp.up_proj.weight": (i, h),
            "mlp.down_proj.weight": (h, i),
        }
        for name, shape in shapes.items():
            w[p + name] = 0.15 * torch.randn(shape, generator=gen)
        w[p + "input_layernorm.weight"] = 1 + 0.2 * torch.randn(h, generator=gen)
        w[p + "post_attention_layernorm.weight"] = 1 + 0.2 * torch.randn(h, generator=gen)
    return w


def _minicpm_reference(cfg: dict, w: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """Token-by-token float64 MiniCPM, written from the published formulas: explicit softmax over
    past positions, rope as a rotation of each (j, j + d/2) pair."""
    w = {k: v.double() for k, v in w.items()}
    h_size, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, layers, eps = h_size // heads, cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    depth = cfg["scale_depth"] / math.sqrt(layers)

    def rms(x, weight):
        return weight * x / torch.sqrt((x * x).mean() + eps)

    def rotate(vec, pos):
        out = vec.clone()
        for j in range(d // 2):
            angle = pos / cfg["rope_theta"] ** (2 * j / d)
            a, b = vec[j], vec[j + d // 2]
            out[j] = a * math.cos(angle) - b * math.sin(angle)
            out[j + d // 2] = b * math.cos(angle) + a * math.sin(angle)
        return out

    keys = [[[] for _ in range(kv_heads)] for _ in range(layers)]
    values = [[[] for _ in range(kv_heads)] for _ in range(layers)]
    logits = []
    for pos, tok in enumerate(ids):
        x = w["model.embed_tokens.weight"][tok] * cfg["scale_emb"]
        for n in range(layers):
            p = f"model.layers.{n}."
            a = rms(x, w[p + "input_layernorm.weight"])
            q = w[p + "self_attn.q_proj.weight"] @ a
            k = w[p + "self_attn.k_proj.weight"] @ a
            v = w[p + "self_attn.v_proj.weight"] @ a
            for g in range(kv_heads):
                keys[n][g].append(rotate(k[g * d : (g + 1) * d], pos))
                values[n][g].append(v[g * d : (g + 1) * d])
            out = []
            for head in range(heads):
                g = head // (heads // kv_heads)
                qh = rotate(q[head * d : (head + 1) * d], pos)
                scores = torch.stack([qh @ key / math.sqrt(d) for key in keys[n][g]])
                probs = torch.exp(scores - scores.max())
                probs = probs / probs.sum()
                out.append(sum(pr * val for pr, val in zip(probs, values[n][g], strict=True)))
            x = x + depth * (w[p + "self_attn.o_proj.weight"] @ torch.cat(out))
            m = rms(x, w[p + "post_attention_layernorm.weight"])
            gate = w[p + "mlp.gate_proj.weight"] @ m
            act = gate / (1 + torch.exp(-gate)) * (w[p + "mlp.up_proj.weight"] @ m)
            x = x + depth * (w[p + "mlp.down_proj.weight"] @ act)
        final = rms(x, w["model.norm.weight"]) / (h_size / cfg["dim_model_base"])
        logits.append(w["model.embed_tokens.weight"] @ final)
    return torch.stack(logits)


def test_minicpm_matches_independent_reference(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MINICPM))
    weights = _minicpm_weights(MINICPM)
    save_file(weights, str(tmp_path / "model.safetensors"))
    ours = load_model(tmp_path, "float32")
    assert ours.spec.embedding_scale == 12.0 and ours.spec.logit_scale == 16 / 48
    ids = [5, 17, 3, 88, 42, 0, 61, 9, 9, 30]
    expected = _minicpm_reference(MINICPM, weights, ids).float()
    got = ours(torch.tensor([ids]))[0]
    err = (got - expected).abs().max().item()
    assert err < LOGIT_ABS_BUDGET, f"max |logit diff| {err:.2e}"
