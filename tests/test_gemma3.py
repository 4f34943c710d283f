"""Gemma 3 (text only, Gemma3ForCausalLM) against transformers.

A tiny random model with every Gemma switch (sliding windows shorter than the prompts, two rope
bases, linear scaling on the global layers, query_pre_attn_scalar, GQA and MQA, tied and untied,
final soft-capping) from an HF directory: the reference decoder, and the engine's paged cache with
chunked prefill and mixed batches. A tiny Gemma 3 GGUF written the way llama.cpp writes one, and
the real Gemma 3 270M Q4_K_M GGUF converted by cpuserve against transformers reading the same
file (those are slow: a 1 GB fp32 model twice, and transformers' tokenizer of 262k pieces).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from cpuserve.engine import paged_attention
from cpuserve.engine.llm import run_to_completion
from cpuserve.engine.llm_engine import EngineConfig, LLMEngine
from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.errors import CheckpointError, ConfigError
from cpuserve.generate import SimpleSampling, generate_ids
from cpuserve.model.config import spec_from_config
from cpuserve.model.loader import load_model
from cpuserve.offline.gguf_convert import convert_gguf_weights
from cpuserve.tokenizer import GenerationDefaults, Tokenizer
from tests.gguf_fixtures import hf_decoder_writer
from tests.test_native_decode import _use_native_decode

transformers = pytest.importorskip("transformers")

# fp32 on models of 64 wide: the differences are rounding only (measured below 1e-5).
TINY_LOGIT_BUDGET = 1e-4
VOCAB = 128
SLIDING, FULL = "sliding_attention", "full_attention"
TINY = dict(
    hidden_size=64,
    num_hidden_layers=7,
    num_attention_heads=4,
    head_dim=32,
    intermediate_size=96,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    rope_theta=5000.0,
    rope_local_base_freq=300.0,
    query_pre_attn_scalar=24,
    # No stop token: transformers' generate then runs the full length, as the engine with ignore_eos.
    eos_token_id=None,
    bos_token_id=None,
)
CASES = {
    # Two global layers among five sliding ones, GQA, tied, a linear-scaled global rope.
    "gqa-tied": dict(
        num_key_value_heads=2,
        sliding_window=5,
        layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL, SLIDING],
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
    # The default 5:1 pattern (layer 5 global), one KV head, untied head, soft-capped logits.
    "mqa-untied-softcap": dict(
        num_key_value_heads=1, sliding_window=4, tie_word_embeddings=False, final_logit_softcapping=3.0
    ),
}


def _randomize(model: torch.nn.Module, seed: int = 7) -> None:
    """Every parameter random; norm weights are offsets from 1 in Gemma, so around 0 here."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((0.3 if "norm" in name else 0.08) * torch.randn(p.shape, generator=gen))


def _write_word_tokenizer(out: Path) -> None:
    """A tokenizer.json of VOCAB words `t0`.. (the engine needs one; prompts are given as ids)."""
    tok = HFTokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))


def _make_tiny(out: Path, extra: dict, seed: int = 7):
    cfg = transformers.Gemma3TextConfig(**{**TINY, **extra})
    cfg.architectures = ["Gemma3ForCausalLM"]
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    _randomize(model, seed)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(out)
    _write_word_tokenizer(out)
    return transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """case -> (HF directory, transformers' model read back from it)."""
    made = {}
    for case, extra in CASES.items():
        out = tmp_path_factory.mktemp(case)
        made[case] = (out, _make_tiny(out, extra))
    return made


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("native", [True, False], ids=["native-ops", "torch-ops"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_tiny_logits_match_transformers(tiny, case, native, monkeypatch):
    monkeypatch.setenv("CPUSERVE_NATIVE_OPS", "1" if native else "0")
    path, ref = tiny[case]
    ours = load_model(path, "float32")
    spec = ours.spec
    assert spec.sliding_window == CASES[case]["sliding_window"] and spec.local_rope.theta == 300.0
    # decode_layers runs Gemma's layers (windows, local rope, sandwich and q/k norms) with native ops
    assert (ours.native_decode_plan() is not None) == native
    ids = _ids(2, 20)
    with torch.inference_mode():
        expected = ref(ids).logits
    err = (ours(ids) - expected).abs().max().item()
    assert err < TINY_LOGIT_BUDGET, f"{case}: max |logit diff| {err:.2e}"
    # Through the contiguous cache: chunks starting inside and beyond the window, single-token steps.
    cache = ours.new_cache(2, 32)
    chunks = [ours(ids[:, a:b], cache) for a, b in ((0, 7), (7, 8), (8, 13), (13, 14), (14, 15), (15, 20))]
    err = (torch.cat(chunks, dim=1) - expected).abs().max().item()
    assert err < TINY_LOGIT_BUDGET, f"{case}: chunked max |logit diff| {err:.2e}"


def test_the_window_and_the_local_rope_matter(tiny):
    """The comparisons above would not notice a window ignored or the wrong rope on sliding layers
    unless those change the logits at these lengths: they do, by far more than the budget."""
    path, ref = tiny["gqa-tied"]
    ids = _ids(2, 20)
    no_window = transformers.AutoConfig.from_pretrained(path, sliding_window=1000)
    global_rope_everywhere = transformers.AutoConfig.from_pretrained(path)
    global_rope_everywhere.rope_parameters[SLIDING] = dict(global_rope_everywhere.rope_parameters[FULL])
    with torch.inference_mode():
        expected = ref(ids).logits
        for config in (no_window, global_rope_everywhere):
            other = transformers.AutoModelForCausalLM.from_pretrained(
                path, config=config, dtype=torch.float32, attn_implementation="eager"
            ).eval()
            assert (other(ids).logits - expected).abs().max().item() > 100 * TINY_LOGIT_BUDGET


@pytest.mark.parametrize("native", [True, False], ids=["native-ops", "torch-ops"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_greedy_equals_transformers_generate(tiny, case, native, monkeypatch):
    """Paged cache in blocks of 4, chunked prefill of 8 tokens a step beside decodes, five prompts
    longer than the window (four running at once). transformers' generate keeps a sliding layer's
    last window - 1 keys and masks by q - k < window: the same keys the engine's queries see."""
    monkeypatch.setenv("CPUSERVE_NATIVE_OPS", "1" if native else "0")
    path, ref = tiny[case]
    model = load_model(path, "float32")
    config = EngineConfig(num_kv_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    engine = LLMEngine(model, Tokenizer(path), config, GenerationDefaults.load(path))
    seen = {"mixed": 0, "windowed decodes": 0}
    call = paged_attention.PagedAttention.__call__

    def recording(self, layer, q, k, v, window=None, scale=None):
        meta = self.meta
        if meta.prefills and meta.decode_rows is not None:
            seen["mixed"] += 1
        if window is not None and meta.decode_lengths is not None and int(meta.decode_lengths.max()) > window:
            seen["windowed decodes"] += 1
        return call(self, layer, q, k, v, window, scale)

    monkeypatch.setattr(paged_attention.PagedAttention, "__call__", recording)
    prompts = [_ids(1, n, seed=10 + n)[0].tolist() for n in (12, 17, 20, 9, 15)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = run_to_completion(engine, {f"r{i}": p for i, p in enumerate(prompts)}, params)
    assert seen["mixed"] and seen["windowed decodes"], seen
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :]
        assert out.outputs[0].token_ids == want.tolist(), prompt
    assert engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_native_decode_is_bit_identical_to_the_layer_loop(tiny, case, dtype, monkeypatch):
    """decode_layers with Gemma's switches against the Python loop of the same native ops, on the
    contiguous cache: 13 single-token steps after a 20-token prompt, far past the window."""
    path, _ = tiny[case]
    model = load_model(path, dtype)
    ids = _ids(2, 20)
    logits = {}
    for on in (True, False):
        calls = _use_native_decode(model, monkeypatch, on)
        cache = model.new_cache(2, 40)
        steps = [model(ids, cache)[:, -1]]
        for _ in range(13):
            steps.append(model(steps[-1].argmax(-1, keepdim=True), cache)[:, -1])
        assert calls[0] == (13 if on else 0)
        logits[on] = torch.stack(steps)
    assert torch.equal(logits[True], logits[False])


@pytest.mark.parametrize("kv", ["auto", "int8", "bfloat16", "float16"])
def test_engine_native_decode_equals_the_layer_loop(tiny, kv, monkeypatch):
    """Through the paged cache (blocks of 4, sliding layers reading their window's slots), int8 KV
    too: the same tokens and logprobs with and without the native step."""
    path, _ = tiny["gqa-tied"]
    model = load_model(path, "float32")
    prompts = {f"r{i}": _ids(1, n, seed=20 + n)[0].tolist() for i, n in enumerate((12, 17, 9))}
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=3)
    outputs = {}
    for on in (True, False):
        calls = _use_native_decode(model, monkeypatch, on)
        config = EngineConfig(
            num_kv_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, kv_cache_dtype=kv
        )
        engine = LLMEngine(model, Tokenizer(path), config, GenerationDefaults.load(path))
        done = run_to_completion(engine, prompts, params)
        outputs[on] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in done]
        assert (calls[0] > 5) == on
    assert outputs[True] == outputs[False]


def test_config_before_transformers_5_gives_the_same_spec(tiny):
    """Hub configs written before transformers 5: rope_theta / rope_local_base_freq / rope_scaling
    at the top level, and maybe sliding_window_pattern instead of layer_types."""
    path, _ = tiny["gqa-tied"]
    cfg = json.loads((path / "config.json").read_text())
    new = spec_from_config(cfg)
    del cfg["rope_parameters"]
    cfg.update(rope_theta=5000.0, rope_local_base_freq=300.0, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert spec_from_config(cfg) == new
    del cfg["layer_types"]
    cfg["sliding_window_pattern"] = 3
    assert spec_from_config(cfg).layer_types == (SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL, SLIDING)


# ---- bad checkpoints -------------------------------------------------------------------------------


@pytest.fixture
def bad_dir(tmp_path):
    _make_tiny(tmp_path, CASES["gqa-tied"])
    return tmp_path


def test_missing_gemma_tensor_is_named(bad_dir):
    weights = load_file(str(bad_dir / "model.safetensors"))
    del weights["model.layers.3.pre_feedforward_layernorm.weight"]
    save_file(weights, str(bad_dir / "model.safetensors"))
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'model\.layers\.3\.pre_feedforward_layernorm\.weight' is missing for Gemma3ForCausalLM",
    ):
        load_model(bad_dir)


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"layer_types": [SLIDING, "chunked_attention", *[FULL] * 5]}, r"layer_types\[1\] is 'chunked_attention'"),
        ({"layer_types": [SLIDING, FULL]}, r"field 'layer_types' .* expected a list of 7 layer types"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is not supported"),
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
        ({"sliding_window": None}, "field 'sliding_window' is null"),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}}, "rope type 'yarn'"),
    ],
)
def test_bad_gemma_config_is_one_clear_error(bad_dir, changes, message):
    cfg = json.loads((bad_dir / "config.json").read_text())
    cfg.update(changes)
    (bad_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=message):
        load_model(bad_dir)


# ---- a tiny GGUF written as llama.cpp writes Gemma 3 -------------------------------------------------


def _write_gemma3_gguf(ref, path: Path) -> None:
    """Metadata as llama.cpp's converter writes it; tensor names from gguf-py's map; every norm
    weight stored with +1 (llama.cpp's convention for Gemma), q/k rows as HF has them."""
    cfg = ref.config
    writer = hf_decoder_writer(path, "gemma3", cfg)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_vocab_size(cfg.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, cfg.num_hidden_layers)
    for name, tensor in ref.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, suffix = name.rsplit(".", 1)
        data = tensor.numpy().astype(np.float32)
        if name.endswith("norm.weight"):
            data = data + np.float32(1.0)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tiny_gemma3_gguf_converts_to_the_model_it_was_made_from(tmp_path):
    # Only what a GGUF can say: the 5:1 pattern, local rope base 10000, query_pre_attn_scalar = head_dim.
    extra = dict(num_key_value_heads=2, sliding_window=4, rope_local_base_freq=10000.0, query_pre_attn_scalar=32)
    ref = _make_tiny(tmp_path / "hf", extra, seed=3)
    path = tmp_path / "tiny-gemma3.gguf"
    _write_gemma3_gguf(ref, path)

    out = convert_gguf_weights(path, tmp_path / "fp32", dtype="float32", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert cfg["layer_types"] == ref.config.layer_types and cfg["sliding_window"] == 4
    ours = load_model(out, "float32")
    ids = _ids(2, 20)
    with torch.inference_mode():
        expected = ref(ids).logits
    err = (ours(ids) - expected).abs().max().item()
    assert err < TINY_LOGIT_BUDGET, f"max |logit diff| {err:.2e}"

    # transformers' own GGUF loader (norm weights - 1, no q/k permutation) reads the same tensors.
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    converted = load_file(str(out / "model.safetensors"))
    for name, tensor in converted.items():
        assert torch.equal(tensor, theirs.state_dict()[name]), name

    # The default output: the same tensors in bf16.
    bf16 = load_file(str(convert_gguf_weights(path, tmp_path / "bf16", progress=False) / "model.safetensors"))
    assert {n: t.dtype for n, t in bf16.items()} == dict.fromkeys(converted, torch.bfloat16)
    for name, tensor in converted.items():
        assert torch.equal(bf16[name], tensor.to(torch.bfloat16)), name


# ---- the real Gemma 3 270M Q4_K_M GGUF ------------------------------------------------------------------

# fp32 weights bit-equal to transformers' dequantization (the conversion's only rounding is the output
# dtype, float32 here), so what is left is the order of float ops in 18 layers (SDPA vs eager matmuls,
# fused vs separate adds, rope frequencies from float64 vs float32): measured 3e-5 to 6e-5 on logits up to 32.
GGUF_LOGIT_BUDGET = 5e-4
PROMPTS = [
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village at the edge of a great forest, there lived a",
]


@pytest.fixture(scope="module")
def gemma_dir(gemma_gguf, tmp_path_factory) -> Path:
    """Converted once per session: weights and config only (the GGUF's SentencePiece tokenizer is
    not converted yet; the prompts' ids come from transformers' tokenizer)."""
    out = tmp_path_factory.mktemp("gemma3-270m") / "hf"
    return convert_gguf_weights(gemma_gguf, out, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def hf_gemma(hf_gemma_gguf):
    return hf_gemma_gguf


@pytest.fixture(scope="module")
def prompt_ids(gemma_gguf_tokenizer) -> list[list[int]]:
    tok = gemma_gguf_tokenizer
    ids = [tok(p).input_ids for p in PROMPTS]
    assert all(len(i) >= 16 and i[0] == 2 for i in ids)  # <bos> first, as llama.cpp adds it
    return ids


@pytest.fixture(scope="module")
def our_gemma(gemma_dir):
    return load_model(gemma_dir, "float32")


@pytest.mark.slow
def test_gemma3_270m_config(our_gemma):
    spec = our_gemma.spec
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (18, 640, 4, 1, 256)
    assert spec.vocab_size == 262144 and spec.tie_word_embeddings and spec.sliding_window == 512
    assert [i for i in range(18) if not spec.is_sliding(i)] == [5, 11, 17]
    assert (spec.rope.theta, spec.local_rope.theta, spec.attention_scale) == (1e6, 1e4, 1 / 16)


@pytest.mark.slow
def test_gemma3_270m_logits_match_transformers_on_the_gguf(our_gemma, hf_gemma, prompt_ids):
    for ids in prompt_ids:
        x = torch.tensor([ids[:16]])
        with torch.inference_mode():
            expected = hf_gemma(x).logits[0]
        got = our_gemma(x)[0]
        err = (got - expected).abs().max().item()
        assert err < GGUF_LOGIT_BUDGET, f"max |logit diff| {err:.2e} (logits up to {expected.abs().max():.1f})"
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.slow
def test_gemma3_270m_greedy_tokens_match_transformers(our_gemma, hf_gemma, prompt_ids):
    for ids in prompt_ids:
        with torch.inference_mode():
            want = hf_gemma.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids) :].tolist()
        got = list(generate_ids(our_gemma, ids, SimpleSampling(max_tokens=32)))
        assert len(want) == 32, want  # no stop token inside 32 tokens for these prompts
        assert got == want
