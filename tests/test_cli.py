"""`cpuserve generate` end to end, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.gguf_fixtures import write_tiny_llama


def _run(args, env_extra=None, timeout=300):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-m", "cpuserve", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_bundled_model_answers_the_readme_question(cache_dir, smol_dir):
    """With no model argument the bundled SmolLM2 is used, its Q4_1 file on the kernels. (Asked
    just "What is the capital of France?", the file answers "L'Étoile, ..." greedily, as llama.cpp
    does on it; its bf16 conversion's numerics happened to pick "The capital ... Paris".)"""
    proc = _run(
        ["generate", "--chat", "--prompt", "What is the capital of France? Answer in one word.", "--max-tokens", "24"],
        {"CPUSERVE_CACHE_DIR": str(cache_dir)},
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "converting" not in proc.stderr  # served from the GGUF, never converted
    assert "tok/s" in proc.stderr


def test_gguf_argument_is_served_from_the_file(tmp_path):
    """A GGUF is not converted: its config and tokenizer are read once into a small cache
    directory, its weights stay in the file."""
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_llama(gguf_path)
    args = ["generate", str(gguf_path), "--cache-dir", str(tmp_path / "cache"), "--prompt", "the", "--max-tokens", "4"]
    first = _run(args)
    assert first.returncode == 0, first.stderr
    assert "metadata once" in first.stderr and "converting" not in first.stderr
    assert not list((tmp_path / "cache").rglob("*.safetensors"))
    second = _run(args)
    assert second.returncode == 0 and "metadata once" not in second.stderr
    assert first.stdout == second.stdout  # greedy: same text both times


def test_quantize_without_a_source_quantizes_the_bundled_model(cache_dir, smol_dir, tmp_path):
    """The bundled model is a GGUF: quantize takes its float conversion (the cached one), never the
    GGUF serving directory (which holds no safetensors), and writes a checkpoint that serves. With
    no text given it calibrates on text the model writes itself (four short windows here)."""
    out = tmp_path / "w8a8"
    args = ["quantize", "--scheme", "w8a8", "--calibration-tokens", "256", "--calibration-window", "64", str(out)]
    proc = _run(args, {"CPUSERVE_CACHE_DIR": str(cache_dir)})
    assert proc.returncode == 0, proc.stderr
    assert "[calibration] sampling 4 sequences of up to 64 tokens from the model itself" in proc.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    gen = _run(["generate", str(out), "--prompt", "The capital of France is", "--max-tokens", "4"])
    assert gen.returncode == 0 and "Paris" in gen.stdout, gen.stderr


def test_calibration_flags_without_effect_are_refused(tmp_path):
    """Round-to-nearest takes no calibration settings, and user texts no seed: refused, not ignored."""
    out = str(tmp_path / "q")
    proc = _run(["quantize", "--scheme", "w8a8", "--no-calibration", "--smoothquant", "0.5", "--no-gptq", out])
    assert proc.returncode == 1 and proc.stderr.strip() == (
        "cpuserve: error: --smoothquant, --gptq/--no-gptq: no effect with --no-calibration (round-to-nearest)"
    )
    proc = _run(["quantize", "--scheme", "w8a8", "--calibration", out, "--calibration-seed", "3", out])
    assert proc.returncode == 1 and "--calibration-seed: no effect with --calibration" in proc.stderr
    proc = _run(["quantize", "--scheme", "w8a8", "--no-gptq", "--act-order", out])
    assert proc.returncode == 1 and proc.stderr.strip() == (
        "cpuserve: error: --act-order/--no-act-order: no effect with --no-gptq"
    )
    assert not (tmp_path / "q").exists()


def test_invalid_flags_are_user_errors(smol_dir):
    proc = _run(["generate", str(smol_dir), "--prompt", "hi", "--max-tokens", "0"])
    assert proc.returncode == 1 and proc.stderr.strip() == "cpuserve: error: --max-tokens must be at least 1, got 0"
    proc = _run(["generate", str(smol_dir), "--prompt", "hi", "--max-tokens", "9000"])
    assert proc.returncode == 1 and "exceeds the model's context of 8192 tokens" in proc.stderr
    proc = _run(["generate", str(smol_dir), "--prompt", "hi", "--dtype", "int3"])
    assert proc.returncode == 1 and "--dtype 'int3' is not supported" in proc.stderr


def test_a_kv_cache_dtype_it_does_not_know_is_refused(smol_dir):
    proc = _run(["serve", str(smol_dir), "--kv-cache-dtype", "fp4", "--port", "0"])
    assert proc.returncode == 1
    assert proc.stderr.strip().endswith(
        "--kv-cache-dtype fp4: one of auto (the model's dtype), bfloat16, float16, int8 "
        "(also spelled fp8, fp8_e4m3, fp8_e5m2: int8 rows with per-row scales)"
    )


def test_vllm_spellings_of_serve_flags_parse():
    """`vllm serve` reads `--max_model_len` as `--max-model-len` (values untouched), and vLLM 0.10+
    spells request logging --enable-log-requests / --no-enable-log-requests."""
    from cpuserve.cli import build_parser, dashed_flags

    parser = build_parser()
    args = parser.parse_args(
        dashed_flags(["serve", "m", "--max_model_len", "512", "--served_model_name=my_model", "--chat-template", "a_b"])
    )
    assert (args.max_model_len, args.served_model_name, args.chat_template) == (512, ["my_model"], "a_b")
    assert parser.parse_args(["serve", "m"]).disable_log_requests is False
    assert parser.parse_args(["serve", "m", "--no-enable-log-requests"]).disable_log_requests is True
    assert parser.parse_args(["serve", "m", "--disable-log-requests"]).disable_log_requests is True
    assert parser.parse_args(["serve", "m", "--enable-log-requests"]).disable_log_requests is False
