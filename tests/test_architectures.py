"""Tiny random-weight checkpoints of every supported architecture against an independent reference:
transformers for Llama, Qwen2, Qwen3, Mistral and Phi-3 (Gemma 3: tests/test_gemma3.py); a small
loop-based implementation written here for MiniCPM (transformers has no MiniCPM without remote code)."""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from cpuserve.engine.llm import run_to_completion
from cpuserve.engine.llm_engine import EngineConfig, LLMEngine
from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.errors import CheckpointError, ConfigError
from cpuserve.model import ops
from cpuserve.model.config import spec_from_config
from cpuserve.model.loader import load_model
from cpuserve.tokenizer import GenerationDefaults, Tokenizer

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


NO_SPECIAL_IDS = {"pad_token_id": None, "eos_token_id": None, "bos_token_id": None}
LONGROPE_ORIGINAL = 16

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
    # No special ids: Phi-3's default pad id (32000) is outside the tiny vocabulary, and without an
    # EOS transformers' generate runs the full length, as the engine with ignore_eos.
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None, **NO_SPECIAL_IDS}),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8, **NO_SPECIAL_IDS}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", NO_SPECIAL_IDS),
    "phi3-window": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 8, **NO_SPECIAL_IDS}),
    "phi3-longrope": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {
            "rope_scaling": {
                "type": "longrope",
                # head_dim 16: one factor per rotary pair, far enough apart that the choice shows.
                "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0, 4.1, 5.5],
                "long_factor": [1.0, 1.9, 3.6, 6.8, 12.5, 21.0, 33.0, 47.0],
            },
            "original_max_position_embeddings": LONGROPE_ORIGINAL,
            **NO_SPECIAL_IDS,
        },
    ),
}
# transformers picks longrope's factors per forward call (long when the call's last position is
# past the original length), cpuserve per position (model/rope.py): one pass agrees up to there.
SEQ_LEN = {"phi3-longrope": LONGROPE_ORIGINAL}


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
    n = SEQ_LEN.get(case, 40)
    ids = torch.randint(0, TINY["vocab_size"], (2, n), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = ref(ids).logits
    got = ours(ids)
    err = (got - expected).abs().max().item()
    assert err < LOGIT_ABS_BUDGET, f"{case}: max |logit diff| {err:.2e}"
    # Prefill in chunks through the KV cache gives the same logits as one pass (chunks starting
    # inside and beyond a window, a single-token step).
    cache = ours.new_cache(2, 64)
    bounds = [0, n * 17 // 40, n * 17 // 40 + 1, n * 33 // 40, n]
    chunks = [ours(ids[:, a:b], cache) for a, b in itertools.pairwise(bounds)]
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


# ---- Mistral and Phi-3 -------------------------------------------------------------------------


def _ids(length: int, seed: int = 1, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def test_mistral_window_matters(tmp_path):
    """The window comparisons above would pass with the window ignored unless it changed the
    logits at 40 tokens: it does, by far more than the budget."""
    ref = _make("mistral-window", tmp_path)
    assert load_model(tmp_path, "float32").spec.layer_window(0) == 8
    unwindowed = transformers.MistralForCausalLM(
        transformers.MistralConfig(**TINY, **{**CASES["mistral-window"][2], "sliding_window": None})
    ).eval()
    unwindowed.load_state_dict(ref.state_dict())
    ids = _ids(40)
    with torch.inference_mode():
        assert (unwindowed(ids).logits - ref(ids).logits).abs().max().item() > 100 * LOGIT_ABS_BUDGET


def test_phi3_longrope_beyond_the_original_length_matches_transformers_decoding(tmp_path):
    """Past original_max_position_embeddings: transformers' forward calls, prefilling 10 tokens then
    decoding one token a call, rotate each position >= 16 with the long factors (and the keys cached
    before with the short ones), which is cpuserve's per-position rule: equal in one pass and in
    chunks. (transformers' one pass over 40 tokens, and its `generate` past 16, use the long factors
    everywhere instead: model/rope.py's Rotary says where that differs.)"""
    ref = _make("phi3-longrope", tmp_path)
    ours = load_model(tmp_path, "float32")
    assert ours.spec.rope.type == "longrope" and ours.spec.rope.original_max_position_embeddings == LONGROPE_ORIGINAL
    # factor 256 / 16 -> attention factor sqrt(1 + ln 16 / ln 16)
    assert math.isclose(ours.spec.rope.attention_factor, math.sqrt(2.0))
    ids = _ids(40)
    with torch.inference_mode():
        out = ref(ids[:, :10], use_cache=True)
        steps, past = [out.logits], out.past_key_values
        for t in range(10, 40):
            out = ref(ids[:, t : t + 1], past_key_values=past, use_cache=True)
            steps.append(out.logits)
            past = out.past_key_values
        expected = torch.cat(steps, dim=1)
        one_pass_all_long = ref(ids).logits  # transformers' one pass: long factors at every position
    err = (ours(ids) - expected).abs().max().item()
    assert err < LOGIT_ABS_BUDGET, f"max |logit diff| {err:.2e}"
    cache = ours.new_cache(2, 64)
    chunks = [ours(ids[:, a:b], cache) for a, b in ((0, 9), (9, 16), (16, 17), (17, 30), (30, 40))]
    err = (torch.cat(chunks, dim=1) - expected).abs().max().item()
    assert err < LOGIT_ABS_BUDGET, f"chunked max |logit diff| {err:.2e}"
    # The two factor sets differ enough that using the wrong one would show.
    assert (one_pass_all_long[:, :16] - expected[:, :16]).abs().max().item() > 100 * LOGIT_ABS_BUDGET


def test_phi3_checkpoint_is_stored_fused(tmp_path):
    ref = _make("phi3", tmp_path)
    names = set(ref.state_dict())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    unfused = load_model(tmp_path, "float32", fuse=False)  # the parts one by one, as calibration asks
    assert unfused.model.layers[0].self_attn.qkv_proj is None
    ids = _ids(12)
    with torch.inference_mode():
        assert (unfused(ids) - ref(ids).logits).abs().max().item() < LOGIT_ABS_BUDGET


def test_phi3_quantized_or_misshapen_fused_tensor_is_named(tmp_path):
    _make("phi3", tmp_path)
    path = tmp_path / "model.safetensors"
    weights = load_file(str(path))
    name = "model.layers.1.self_attn.qkv_proj.weight"
    weights[name] = weights[name][:-2]
    save_file(weights, str(path))
    with pytest.raises(CheckpointError, match=r"qkv_proj\.weight' has shape \[126, 64\], expected \[128, "):
        load_model(tmp_path, "float32")
    weights[name] = torch.zeros(128, 64, dtype=torch.int8)
    save_file(weights, str(path))
    with pytest.raises(CheckpointError, match=r"qkv_proj\.weight' \(I8\): a pre-fused qkv_proj is read only as a"):
        load_model(tmp_path, "float32")
    del weights[name]
    save_file(weights, str(path))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.1\.self_attn\.qkv_proj\.weight' is missing"):
        load_model(tmp_path, "float32")


PHI3_CONFIG = dict(
    architectures=["Phi3ForCausalLM"],
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=128,
    max_position_embeddings=64,
    original_max_position_embeddings=16,
    rope_scaling={"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
)


def test_phi3_config_spellings():
    spec = spec_from_config(PHI3_CONFIG)
    assert spec.rope.type == "longrope" and spec.prefused_projections and spec.sliding_window is None
    assert math.isclose(spec.rope.factor, 4.0) and math.isclose(spec.rope.attention_factor, math.sqrt(1.5))
    given = spec_from_config({**PHI3_CONFIG, "rope_scaling": {**PHI3_CONFIG["rope_scaling"], "attention_factor": 1.2}})
    assert given.rope.attention_factor == 1.2
    assert spec_from_config({**PHI3_CONFIG, "rope_scaling": None, "sliding_window": 2047}).layer_window(1) == 2047
    mistral = {**PHI3_CONFIG, "architectures": ["MistralForCausalLM"], "rope_scaling": None}
    assert spec_from_config(mistral).layer_window(0) == 4096  # MistralConfig's default window
    assert spec_from_config({**mistral, "sliding_window": None}).layer_types == ()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"rope_scaling": {"type": "su", "short_factor": [1.0] * 7, "long_factor": [2.0] * 8}}, "'short_factor'"),
        ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8}}, "'long_factor'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope type 'linear' is not supported for Phi3"),
        ({"partial_rotary_factor": 0.75}, "'partial_rotary_factor' is 0.75"),
        (
            {"rope_scaling": {**PHI3_CONFIG["rope_scaling"], "partial_rotary_factor": 0.5}},
            "'rope_scaling.partial_rotary_factor' is 0.5",
        ),
        (
            {"rope_scaling": {**PHI3_CONFIG["rope_scaling"], "original_max_position_embeddings": 32}},
            "'original_max_position_embeddings' is 32",
        ),
        ({"sliding_window": 0}, "'sliding_window' is 0"),
        ({"architectures": ["LlamaForCausalLM"]}, "rope type 'su' is not supported"),
        ({"architectures": ["Qwen2ForCausalLM"], "rope_scaling": None, "use_sliding_window": True}, "use_sliding"),
    ],
)
def test_bad_phi3_or_mistral_config_is_one_clear_error(changes, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        spec_from_config({**PHI3_CONFIG, **changes})


def _write_word_tokenizer(out: Path) -> None:
    """A tokenizer.json of words `t0`.. (the engine needs one; prompts are given as ids)."""
    tok = HFTokenizer(models.WordLevel({f"t{i}": i for i in range(TINY["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))


@pytest.mark.parametrize("native", [True, False], ids=["native-ops", "torch-ops"])
@pytest.mark.parametrize("case", ["mistral-window", "phi3-longrope"])
def test_engine_greedy_equals_transformers_generate(case, native, tmp_path, monkeypatch):
    """The paged cache in blocks of 4, prefill chunks of 8 beside decodes: a window of 8 over
    prompts longer than it (every Mistral layer sliding), and longrope (its attention factor in the
    tables the native decode step gets) up to the original 16 positions, where transformers'
    generate and cpuserve agree (beyond, generate recomputes everything with the long factors)."""
    monkeypatch.setenv("CPUSERVE_NATIVE_OPS", "1" if native else "0")
    ref = _make(case, tmp_path)
    _write_word_tokenizer(tmp_path)
    model = load_model(tmp_path, "float32")
    if case == "phi3-longrope" and native and ops._native() is not None:
        assert model.native_decode_plan() is not None  # Phi-3 is Llama-shaped: decode steps run natively
    config = EngineConfig(num_kv_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    engine = LLMEngine(model, Tokenizer(tmp_path), config, GenerationDefaults.load(tmp_path))
    lengths = (6, 9, 4, 8, 5) if case == "phi3-longrope" else (12, 17, 20, 9, 15)
    new_tokens = LONGROPE_ORIGINAL - max(lengths) if case == "phi3-longrope" else 12
    prompts = [_ids(n, seed=10 + n, batch=1)[0].tolist() for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outs = run_to_completion(engine, {f"r{i}": p for i, p in enumerate(prompts)}, params)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)[0, len(prompt) :]
        assert out.outputs[0].token_ids == want.tolist(), prompt
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_phi3_quantizes_to_separate_projections(tmp_path):
    """`cpuserve quantize` reads the fused tensors as their parts and writes those; the result loads."""
    from cpuserve.offline.quantize import quantize_checkpoint

    src = tmp_path / "phi3"
    ref = _make("phi3", src)
    out = quantize_checkpoint(src, tmp_path / "w8a8", "w8a8", progress=False)
    assert "model.layers.0.self_attn.k_proj.weight_scale" in load_file(str(out / "model.safetensors"))
    ids = _ids(12)
    with torch.inference_mode():
        expected = ref(ids).logits
    err = (load_model(out, "float32")(ids) - expected).abs().max().item()
    assert err < 0.05 * expected.abs().max().item(), err


@pytest.mark.parametrize("native", [True, False], ids=["native-ops", "torch-ops"])
def test_engine_longrope_past_the_original_length_equals_transformers_forward_calls(native, tmp_path, monkeypatch):
    """Generation from prompts within the original 16 positions to 30: the engine's greedy tokens
    (paged cache, decodes natively where they can) equal a greedy loop over transformers' forward
    calls, prompt then one token a call, which rotate each position as cpuserve does."""
    monkeypatch.setenv("CPUSERVE_NATIVE_OPS", "1" if native else "0")
    ref = _make("phi3-longrope", tmp_path)
    _write_word_tokenizer(tmp_path)
    model = load_model(tmp_path, "float32")
    config = EngineConfig(num_kv_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    engine = LLMEngine(model, Tokenizer(tmp_path), config, GenerationDefaults.load(tmp_path))
    prompts = [_ids(n, seed=30 + n, batch=1)[0].tolist() for n in (7, 12, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True)
    outs = run_to_completion(engine, {f"r{i}": p for i, p in enumerate(prompts)}, params)
    for prompt, out in zip(prompts, outs, strict=True):
        want: list[int] = []
        with torch.inference_mode():
            step = ref(torch.tensor([prompt]), use_cache=True)
            for _ in range(18):
                want.append(int(step.logits[0, -1].argmax()))
                step = ref(torch.tensor([want[-1:]]), past_key_values=step.past_key_values, use_cache=True)
        assert out.outputs[0].token_ids == want, prompt


def test_a_16_bit_untied_embedding_stays_16_bit_in_float32_and_a_quantized_head_is_the_same(tmp_path, monkeypatch):
    """Served in float32 (an AVX2 host's --dtype auto), a bfloat16 checkpoint's untied embedding is
    kept in bfloat16 and widened per row: logits equal transformers' float32 model of the same
    weights. An output head quantized at load is quantized from the stored bfloat16, never a float32
    copy, and gives the same int8 values and scales as the head quantized in a bfloat16 load."""
    from cpuserve.model import loader
    from cpuserve.model.quantized_embedding import WidenedEmbedding

    quantized_from = []
    quantize = loader.quantize_weight_in_chunks

    def spy(w, *args):
        quantized_from.append(w.dtype)
        return quantize(w, *args)

    monkeypatch.setattr(loader, "quantize_weight_in_chunks", spy)
    _make("llama-untied", tmp_path / "fp32").to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    # read back in float32 (rope tables made anew: a model cast to bfloat16 and back has rounded ones)
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "bf16", torch_dtype=torch.float32).eval()
    ours = load_model(tmp_path / "bf16", "float32")
    table = ours.model.embed_tokens
    assert isinstance(table, WidenedEmbedding) and table.weight.dtype == torch.bfloat16
    assert ours.dtype == torch.float32
    ids = torch.randint(0, TINY["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = ref(ids).logits
    err = (ours(ids) - expected).abs().max().item()
    assert err < LOGIT_ABS_BUDGET, f"max |logit diff| {err:.2e}"
    tied = _make("llama-tied", tmp_path / "tied")
    tied.to(torch.bfloat16).save_pretrained(tmp_path / "tied-bf16")
    assert isinstance(load_model(tmp_path / "tied-bf16", "float32").model.embed_tokens, torch.nn.Embedding)
    heads = [load_model(tmp_path / "bf16", dtype, quantize_lm_head="int8").lm_head for dtype in ("float32", "bfloat16")]
    assert quantized_from == [torch.bfloat16, torch.bfloat16]
    assert torch.equal(heads[0].int_weight(), heads[1].int_weight())
    assert torch.equal(heads[0].weight_scales().float(), heads[1].weight_scales().float())
