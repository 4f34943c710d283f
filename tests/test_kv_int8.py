"""The int8 KV cache (--kv-cache-dtype int8, engine/kv_int8.py): its rows against their definition,
the native decode attention over int8 rows against SDPA over the same rows dequantized (every path),
the native decode step writing the same bytes as the Python path, and the served model's logprobs
against the same engine with a float cache (budgets measured on SmolLM2, stated below)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cpuserve.engine.kv_int8 import dequantize_kv, quantize_kv
from cpuserve.engine.llm import run_to_completion
from cpuserve.engine.llm_engine import EngineConfig, LLMEngine
from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.kernels import selected_variant
from cpuserve.model import ops
from cpuserve.model.loader import load_model
from cpuserve.tokenizer import GenerationDefaults, Tokenizer


@pytest.fixture(autouse=True)
def _fresh_variant():
    selected_variant.cache_clear()
    yield
    selected_variant.cache_clear()


def _select(monkeypatch, path: str) -> None:
    """Which attention runs: "selected" (this CPU's variant), "avx2" or "portable" (CPUSERVE_ISA)."""
    from cpuserve.kernels import runnable_variants

    if path == "avx2" and "avx2" not in runnable_variants():
        pytest.skip("this CPU lacks AVX2")
    if path in ("avx2", "portable"):
        monkeypatch.setenv("CPUSERVE_ISA", "generic" if path == "portable" else path)


def test_rows_round_to_the_nearest_step_of_their_own_scale():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=gen) * torch.tensor([0.01, 1.0, 300.0]).view(1, 3, 1)
    x[2, 1] = 0.0  # a zero row keeps scale 1 and zeros
    q, s = quantize_kv(x.bfloat16())
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (5, 3)
    top = x.bfloat16().float().abs().amax(-1)
    assert torch.equal(s[top > 0], (top / 127)[top > 0]) and s[2, 1] == 1 and not q[2, 1].any()
    assert q.abs().amax(-1)[top > 0].eq(127).all()  # each row's largest value takes the full range
    back = dequantize_kv(q, s, torch.float32)
    assert ((back - x.bfloat16().float()).abs() <= s.unsqueeze(-1) / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize(
    "hq,hkv,d,lengths",
    [
        (9, 3, 64, [37, 250, 1]),
        (16, 2, 128, [37, 250, 1]),
        (4, 4, 40, [37, 250, 1]),  # d not a multiple of 16: AVX-512 runs the portable loops, AVX2 its blocks of 8
        (4, 2, 36, [37, 250, 1]),  # d not a multiple of 8: the portable loops on every path
        (9, 3, 64, [300]),  # one sequence, 3 KV heads: the AVX-512 path splits its keys into parts
    ],
)
@pytest.mark.parametrize("path", ["selected", "avx2", "portable", "reference"])
def test_paged_decode_attention_over_int8_rows_equals_sdpa(monkeypatch, hq, hkv, d, lengths, path):
    """SDPA in fp32 over the dequantized rows is the reference: the kernels read the same values, so
    only summation order differs (fp32 budget). "selected": the variant this CPU gets (AVX-512's
    key blocks where it has them); "avx2": AVX2's key blocks of 8; "portable": the template loops
    (CPUSERVE_ISA=generic)."""
    _select(monkeypatch, path)
    if path == "reference":
        monkeypatch.setattr(ops, "_use_native", lambda *t: None)
    else:
        assert ops._native() is not None, "native kernels are not built: ./run setup builds them"
    gen = torch.Generator().manual_seed(hq + d)
    n, capacity = len(lengths), 320
    q = torch.randn(n, hq, d, generator=gen)
    kc, ks = quantize_kv(torch.randn(capacity, hkv, d, generator=gen) * 3)
    vc, vs = quantize_kv(torch.randn(capacity, hkv, d, generator=gen))
    perm = torch.randperm(capacity, generator=gen)
    seq_slots = [perm[sum(lengths[:i]) : sum(lengths[: i + 1])] for i in range(n)]
    longest = max(lengths)
    slots = torch.stack([torch.cat((s, s[:1].expand(longest - len(s)))) for s in seq_slots])
    unused = perm[sum(lengths) :]
    ks[unused], vs[unused] = float("nan"), float("nan")  # nobody may read a row outside its context
    got = ops.decode_attention_paged(q, kc, vc, slots, torch.tensor(lengths), None, ks, vs)
    for i, s in enumerate(seq_slots):
        k, v = dequantize_kv(kc[s], ks[s], torch.float32), dequantize_kv(vc[s], vs[s], torch.float32)
        want = F.scaled_dot_product_attention(
            q[i][None, :, None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], enable_gqa=hq != hkv
        )[0, :, 0]
        assert (got[i] - want).abs().max() <= 4e-6, i


@pytest.mark.parametrize("path", ["selected", "avx2", "portable"])
def test_contiguous_int8_cache_reads_each_batchs_own_scales(monkeypatch, path):
    """The contiguous layout (no slots: batch b, positions 0..L-1) addresses scales by batch too."""
    _select(monkeypatch, path)
    kernels = ops._native()
    assert kernels is not None
    gen = torch.Generator().manual_seed(3)
    b, cap, hq, hkv, d, length = 2, 90, 8, 2, 64, 77
    q = torch.randn(b, hq, d, generator=gen)
    k, ks = quantize_kv(torch.randn(b, cap, hkv, d, generator=gen))
    v, vs = quantize_kv(torch.randn(b, cap, hkv, d, generator=gen) * 5)
    ks[:, length:], vs[:, length:] = float("nan"), float("nan")
    lengths = torch.full((b,), length)
    got = kernels.decode_attention(q, k, v, None, lengths, d**-0.5, ops._variant(), ks, vs)
    for i in range(b):
        kf = dequantize_kv(k[i, :length], ks[i, :length], torch.float32).transpose(0, 1)
        vf = dequantize_kv(v[i, :length], vs[i, :length], torch.float32).transpose(0, 1)
        want = F.scaled_dot_product_attention(q[i][None, :, None], kf[None], vf[None], enable_gqa=True)[0, :, 0]
        assert (got[i] - want).abs().max() <= 4e-6, i


def test_an_int8_cache_needs_its_scales():
    kernels = ops._native()
    assert kernels is not None
    q, k = torch.randn(1, 2, 16), torch.zeros(1, 4, 2, 16, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="an int8 cache needs its k and v scales"):
        kernels.decode_attention(q, k, k, None, torch.tensor([2]), 1.0, ops._variant())
    with pytest.raises(RuntimeError, match="scales must be fp32"):
        scales = torch.ones(1, 4, 3)  # one short: [B, S, Hkv] is [1, 4, 2]
        kernels.decode_attention(q, k, k, None, torch.tensor([2]), 1.0, ops._variant(), scales, scales)
    f = torch.zeros(1, 4, 2, 16)
    with pytest.raises(RuntimeError, match="a float cache none"):
        kernels.decode_attention(q, f, f, None, torch.tensor([2]), 1.0, ops._variant(), torch.ones(1, 4, 2), None)
    with pytest.raises(ValueError, match="needs both its key and its value scales"):
        ops.decode_attention_paged(q, k[0], k[0], torch.tensor([[0, 1]]), torch.tensor([2]), None, torch.ones(4, 2))


def _engine(model, smol_dir, kv: str, **config) -> LLMEngine:
    config = EngineConfig(num_kv_blocks=96, max_num_seqs=4, kv_cache_dtype=kv, **config)
    return LLMEngine(model, Tokenizer(smol_dir), config, GenerationDefaults.load(smol_dir))


def test_served_logprobs_with_an_int8_cache_stay_close_to_the_float_cache(smol_dir):
    """Measured on SmolLM2 fp32 (600 tokens of GPL-3): mean |logprob difference| 0.039 nats, mean
    logprob within 0.003; the short prompts' 32 greedy tokens equal. Budgets: 0.06, 0.015, 8 tokens."""
    model = load_model(smol_dir, "float32")
    tokenizer = Tokenizer(smol_dir)
    text = tokenizer.encode(Path("/usr/share/common-licenses/GPL-3").read_text()[:6000], add_special_tokens=False)[:600]
    prompts = {"text": text, "fr": tokenizer.encode("The capital of France is"), "py": tokenizer.encode("def fib(n):")}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    runs = {}
    for kv in ("auto", "int8"):
        engine = _engine(model, smol_dir, kv, max_num_batched_tokens=256)  # the long prompt in 3 chunks
        cache = engine.core.runner.cache
        assert cache.k[0].dtype == (torch.int8 if kv == "int8" else torch.float32) and cache.int8 == (kv == "int8")
        runs[kv] = {o.request_id: o for o in run_to_completion(engine, prompts, params)}
    lp = {kv: torch.tensor([e.logprob for e in runs[kv]["text"].prompt_logprobs[1:]]) for kv in runs}
    assert (lp["int8"] - lp["auto"]).abs().mean() < 0.06
    assert abs(lp["int8"].mean() - lp["auto"].mean()) < 0.015
    for name in ("fr", "py"):
        assert runs["int8"][name].outputs[0].token_ids == runs["auto"][name].outputs[0].token_ids, name


def test_an_int8_cache_holds_about_twice_a_bf16_caches_tokens(smol_dir, monkeypatch):
    """The memory plan counts an int8 row as D bytes + a 4-byte scale (SmolLM2, D 64: 68 of 128), so
    the same VLLM_CPU_KVCACHE_SPACE gives it 128/68 as many blocks."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    bf16 = LLMEngine.from_model_dir(smol_dir, EngineConfig(max_model_len=2048), "bfloat16")
    int8 = LLMEngine.from_model_dir(smol_dir, EngineConfig(max_model_len=2048, kv_cache_dtype="fp8"), "bfloat16")
    spec = bf16.model.spec
    assert bf16.facts["kv_bytes_per_token"] == 2 * spec.num_layers * spec.num_kv_heads * 64 * 2
    assert int8.facts["kv_bytes_per_token"] == 2 * spec.num_layers * spec.num_kv_heads * 68
    assert "for --kv-cache-dtype fp8" in int8.facts["kv_cache_dtype"]
    blocks = [e.core.runner.cache.num_blocks for e in (bf16, int8)]
    assert blocks[1] == pytest.approx(blocks[0] * 128 / 68, abs=1)
    cache = int8.core.runner.cache
    assert cache.k[0].dtype == torch.int8 and cache.k_scale is not None and len(cache.k_scale) == spec.num_layers


def test_serve_checks_the_flag_without_importing_torch():
    """serve validates flags before its thread plan, which must come before torch is imported."""
    code = (
        "import argparse, sys\n"
        "from cpuserve.server.serve_flags import add_serve_args, check_serve_args\n"
        "p = argparse.ArgumentParser(); add_serve_args(p)\n"
        "check_serve_args(p.parse_args(['--kv-cache-dtype', 'fp8']))\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_doctor_reports_the_int8_cache_and_its_capacity(smol_dir):
    from cpuserve.doctor import build_report
    from cpuserve.platform.machine import detect_machine

    machine, env = detect_machine(), {"VLLM_CPU_KVCACHE_SPACE": "1"}
    auto, int8 = (build_report(machine, env, smol_dir, "bfloat16", kv_cache_dtype=kv) for kv in ("auto", "int8"))
    assert auto["model"]["kv_cache_dtype"] == "bfloat16" and int8["model"]["kv_cache_dtype"].startswith("int8")
    tokens = [r["decisions"]["memory"]["kv_tokens"] for r in (auto, int8)]
    assert tokens[1] == pytest.approx(tokens[0] * 128 / 68, rel=0.01)
    bad = build_report(machine, env, smol_dir, "bfloat16", kv_cache_dtype="fp4")
    assert bad["problems"] == [
        "--kv-cache-dtype fp4: one of auto (the model's dtype), bfloat16, float16, int8 "
        "(also spelled fp8, fp8_e4m3, fp8_e5m2: int8 rows with per-row scales)"
    ]
