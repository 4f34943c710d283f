"""A 16-bit KV cache under a float32 model (--kv-cache-dtype bfloat16 / float16 with --dtype float32, what
a CPU without native bf16 dot products computes in): attention over the stored rows on every path,
the served model against transformers in float32 (budgets measured), the memory plan counting 2 bytes
a value, and the names the flag takes. The native decode step writes the same bits as the Python
path (tests/test_native_decode.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cpuserve.engine.llm import run_to_completion
from cpuserve.engine.llm_engine import EngineConfig, LLMEngine
from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.errors import ConfigError
from cpuserve.kernels import selected_variant
from cpuserve.kv_cache_dtype import is_int8, kv_cache_storage
from cpuserve.model import ops
from cpuserve.tokenizer import GenerationDefaults, Tokenizer

# Against transformers in float32 on 600 tokens of GPL-3 (prompt logprobs), measured on SmolLM2:
# mean |logprob difference| bf16 0.0073, fp16 0.0009 (int8's, tests/test_kv_int8.py: 0.039); mean
# logprob within 0.0011 and 0.0001. Budgets: about twice those.
BUDGETS = {"bfloat16": (0.015, 0.003), "float16": (0.002, 0.0005)}  # mean |difference|, difference of means


@pytest.fixture(autouse=True)
def _fresh_variant():
    selected_variant.cache_clear()
    yield
    selected_variant.cache_clear()


def test_the_names_the_flag_takes():
    names = ("auto", "bfloat16", "bf16", "float16", "fp16", "half", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
    assert [kv_cache_storage(n) for n in names] == [None, "bfloat16", "bfloat16"] + ["float16"] * 3 + ["int8"] * 4
    assert [is_int8(n) for n in names] == [False] * 6 + [True] * 4
    with pytest.raises(ConfigError, match="--kv-cache-dtype float32: one of auto"):
        kv_cache_storage("float32")  # vLLM has no float32 cache dtype either


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["selected", "avx2", "portable", "reference"])
def test_float32_queries_over_16bit_rows_equal_sdpa_over_the_rows_widened(monkeypatch, dtype, path):
    """Decode and prefill attention, fp32 queries, a paged 16-bit cache: the rows as stored, widened
    (exactly) to fp32, through SDPA; fp32 arithmetic on both sides."""
    from cpuserve.kernels import runnable_variants

    if path == "avx2" and "avx2" not in runnable_variants():
        pytest.skip("this CPU lacks AVX2")
    if path in ("avx2", "portable"):
        monkeypatch.setenv("CPUSERVE_ISA", "generic" if path == "portable" else path)
    if path == "reference":  # the torch path reads a 16-bit cache under fp32 queries too
        monkeypatch.setattr(ops, "_use_native", lambda *t: None)
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, slots_total = 9, 3, 64, 400
    k = torch.randn(slots_total, hkv, d, generator=gen).to(dtype)
    v = torch.randn(slots_total, hkv, d, generator=gen).to(dtype)
    lengths = torch.tensor([37, 250, 1])
    slots = torch.stack([torch.randperm(slots_total, generator=gen)[:250] for _ in lengths])
    q = torch.randn(len(lengths), hq, d, generator=gen)
    out = ops.decode_attention_paged(q, k, v, slots, lengths)
    assert out.dtype == torch.float32
    for i, n in enumerate(lengths.tolist()):
        keys, values = k[slots[i, :n]].float().unsqueeze(0), v[slots[i, :n]].float().unsqueeze(0)
        ref = ops.prefill_attention_reference(q[i : i + 1].unsqueeze(0), keys, values)[0, 0]
        assert (out[i] - ref).abs().max() < 1e-5, (path, i)
    chunk = torch.randn(40, hq, d, generator=gen)  # the last 40 of 100 context slots are the new tokens
    context = slots[1, :100]
    out = ops.prefill_attention_paged(chunk, k, v, context, window=64)
    keys, values = k[context].float().unsqueeze(0), v[context].float().unsqueeze(0)
    ref = ops.prefill_attention_reference(chunk.unsqueeze(0), keys, values, window=64)[0]
    assert (out - ref).abs().max() < 1e-5, path


@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
def test_served_logprobs_stay_close_to_transformers_in_float32(kv, smol_dir, our_smol, hf_smol):
    tokenizer = Tokenizer(smol_dir)
    text = tokenizer.encode(Path("/usr/share/common-licenses/GPL-3").read_text()[:6000], add_special_tokens=False)
    prompts = {
        "text": text[:600],
        "fr": tokenizer.encode("The capital of France is"),
        "chat": tokenizer.encode_chat([{"role": "user", "content": "Write a haiku about the sea."}]),
    }
    # The long prompt in 3 chunks: later chunks read the earlier ones' rows back from the cache.
    config = EngineConfig(num_kv_blocks=96, max_num_seqs=4, max_num_batched_tokens=256, kv_cache_dtype=kv)
    engine = LLMEngine(our_smol, tokenizer, config, GenerationDefaults.load(smol_dir))
    cache = engine.core.runner.cache
    assert our_smol.dtype == torch.float32 and cache.k[0].dtype == getattr(torch, kv) and not cache.int8
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    done = {o.request_id: o for o in run_to_completion(engine, prompts, params)}
    with torch.inference_mode():
        ref = torch.log_softmax(hf_smol(torch.tensor([prompts["text"]])).logits[0], -1)
    ours = torch.tensor([e.logprob for e in done["text"].prompt_logprobs[1:]])
    theirs = ref[:-1].gather(1, torch.tensor(prompts["text"][1:]).unsqueeze(1))[:, 0]
    mean_abs, shift = BUDGETS[kv]
    assert (ours - theirs).abs().mean() < mean_abs
    assert abs(ours.mean() - theirs.mean()) < shift
    for name in ("fr", "chat"):  # greedy: the first 8 tokens transformers' argmax after the ones before
        ids = prompts[name] + list(done[name].outputs[0].token_ids)
        with torch.inference_mode():
            logits = hf_smol(torch.tensor([ids])).logits[0]
        assert logits[len(prompts[name]) - 1 : -1].argmax(-1).tolist() == ids[len(prompts[name]) :], name


def test_the_memory_plan_counts_two_bytes_a_value(smol_dir, monkeypatch):
    """The same VLLM_CPU_KVCACHE_SPACE holds twice the tokens in a bf16 cache under a float32 model,
    and the facts the log and doctor print say what the cache holds."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    f32 = LLMEngine.from_model_dir(smol_dir, EngineConfig(max_model_len=2048), "float32")
    bf16 = LLMEngine.from_model_dir(smol_dir, EngineConfig(max_model_len=2048, kv_cache_dtype="bf16"), "float32")
    spec = f32.model.spec
    assert f32.facts["kv_bytes_per_token"] == 2 * spec.num_layers * spec.num_kv_heads * 64 * 4
    assert bf16.facts["kv_bytes_per_token"] == 2 * spec.num_layers * spec.num_kv_heads * 64 * 2
    assert f32.facts["kv_cache_dtype"] == "float32"
    assert bf16.facts["kv_cache_dtype"] == "bfloat16 (--kv-cache-dtype bf16; the model computes in float32)"
    blocks = [e.core.runner.cache.num_blocks for e in (f32, bf16)]
    assert blocks[1] == pytest.approx(blocks[0] * 2, abs=1)
    assert bf16.core.runner.cache.k[0].dtype == torch.bfloat16 and bf16.model.dtype == torch.float32


def test_auto_stores_the_checkpoints_dtype_where_auto_computes_in_float32():
    """--kv-cache-dtype auto under --dtype auto: a 16-bit checkpoint computed in float32 (no native
    16-bit dot products) keeps its dtype in the cache, as vLLM's auto would; an explicit --dtype, a
    float32 checkpoint, or a CPU computing in the checkpoint's dtype keep the compute dtype."""
    from cpuserve.model.config import ModelSpec
    from cpuserve.model.footprint import auto_kv_storage

    def spec(stored: str | None) -> ModelSpec:
        return type("Spec", (), {"torch_dtype": stored})()  # type: ignore[return-value]

    assert auto_kv_storage(spec("bfloat16"), "auto", torch.float32) == "bfloat16"
    assert auto_kv_storage(spec("float16"), "auto", torch.float32) == "float16"
    assert auto_kv_storage(spec("bfloat16"), "float32", torch.float32) is None  # asked for float32
    assert auto_kv_storage(spec("bfloat16"), "auto", torch.bfloat16) is None  # the cache is bf16 anyway
    assert auto_kv_storage(spec("float32"), "auto", torch.float32) is None
    assert auto_kv_storage(spec(None), "auto", torch.float32) is None


def test_an_engine_computing_in_float32_by_auto_gets_the_checkpoints_cache_dtype(smol_dir, monkeypatch):
    """What an AVX2 host does with the bundled model: --dtype auto chooses float32 (forced here, as
    the host's choice), the cache holds bf16 (the checkpoint's dtype) and the log says why."""
    from cpuserve.model import loader
    from cpuserve.platform.compute_dtype import DtypeChoice

    monkeypatch.setattr(loader, "host_auto_dtype", lambda stored: DtypeChoice("float32", "no native bf16 (test)"))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    config = EngineConfig(max_model_len=2048)
    engine = LLMEngine.from_model_dir(smol_dir, config, "auto")
    assert engine.model.dtype == torch.float32 and engine.core.runner.cache.k[0].dtype == torch.bfloat16
    assert config.kv_cache_dtype == "bfloat16"
    assert engine.facts["kv_cache_dtype"] == (
        "bfloat16 (--kv-cache-dtype auto: the checkpoint's dtype; the model computes in float32)"
    )
    done = run_to_completion(engine, {"fr": "The capital of France is"}, SamplingParams(temperature=0.0, max_tokens=6))
    assert "Paris" in done[0].outputs[0].text
    asked = LLMEngine.from_model_dir(smol_dir, EngineConfig(max_model_len=2048), "float32")  # explicit: as vLLM
    assert asked.core.runner.cache.k[0].dtype == torch.float32


@pytest.mark.parametrize("native", [True, False])
def test_bf16_queries_over_fp16_rows_read_the_rows_exactly(monkeypatch, native):
    """A bf16 model with --kv-cache-dtype float16: both paths widen the fp16 rows exactly (the torch
    path must not round them to bf16 first) and compute in fp32; the output is rounded to bf16."""
    if not native:
        monkeypatch.setattr(ops, "_use_native", lambda *t: None)
    gen = torch.Generator().manual_seed(5)
    k = (torch.randn(80, 2, 64, generator=gen) * 4).half()
    v = torch.randn(80, 2, 64, generator=gen).half()
    q = torch.randn(30, 8, 64, generator=gen).bfloat16()
    slots = torch.randperm(80, generator=gen)[:50]
    out = ops.prefill_attention_paged(q, k, v, slots)
    ref = ops.prefill_attention_reference(q.float()[None], k[slots].float()[None], v[slots].float()[None])[0]
    assert out.dtype == torch.bfloat16
    # within the output's own rounding (half a bf16 step: 2^-8 of each value); rows rounded to bf16 on
    # the way (the bug this guards against) were 0.019 over it
    assert ((out.float() - ref).abs() - 2**-8 * ref.abs()).max() <= 1e-5


@pytest.mark.parametrize("native", [True, False])
def test_the_contiguous_cache_holds_16bit_rows_as_the_paged_one_does(our_smol, smol_dir, monkeypatch, native):
    """`generate` and the single-stream benchmark's contiguous cache in bf16 under the float32 model
    (what serve's paged cache holds on a float32-auto host): 10 greedy tokens equal the engine's, the
    first step's top-5 logprobs within 1e-3 of the paged path's; on the native kernels and on the
    torch path."""
    from cpuserve.generate import SimpleSampling, generate_ids

    if not native:
        monkeypatch.setattr(ops, "_use_native", lambda *t: None)
    tokenizer = Tokenizer(smol_dir)
    prompt = tokenizer.encode("Once upon a time, in a small village,")
    ours = list(generate_ids(our_smol, prompt, SimpleSampling(max_tokens=10), torch.bfloat16))
    cache = our_smol.new_cache(1, 32, torch.bfloat16)
    assert cache.k[0].dtype == torch.bfloat16 and our_smol.dtype == torch.float32
    contiguous = our_smol.logits(our_smol.hidden_states(torch.tensor([prompt]), cache)[0, -1])
    config = EngineConfig(num_kv_blocks=16, max_num_seqs=1, kv_cache_dtype="bfloat16")
    engine = LLMEngine(our_smol, tokenizer, config, GenerationDefaults.load(smol_dir))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5)
    out = run_to_completion(engine, {"r": prompt}, params)[0].outputs[0]
    assert ours == list(out.token_ids)
    first = torch.log_softmax(contiguous.float(), -1)
    for token, logprob in out.logprobs[0].top.items():
        assert abs(first[token].item() - logprob) < 1e-3
