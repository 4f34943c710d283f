"""`--dtype auto`: 16-bit activations only where the CPU (and torch on it) has native dot products."""

from __future__ import annotations

import pytest

from cpuserve.platform.compute_dtype import choose_auto_dtype

ZEN3 = frozenset({"avx2", "fma", "f16c"})
SAPPHIRE_RAPIDS = frozenset({"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "avx512_fp16"})
ZEN4 = frozenset({"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"})
CORTEX_A76 = frozenset({"asimd", "asimdhp", "asimddp"})
CORTEX_A720 = frozenset({"asimd", "asimdhp", "asimddp", "i8mm", "bf16", "sve2"})


@pytest.mark.parametrize(
    ("stored", "arch", "features", "capability", "expected"),
    [
        ("bfloat16", "x86_64", ZEN3, "AVX2", "float32"),
        ("float16", "x86_64", ZEN3, "AVX2", "float32"),
        ("bfloat16", "x86_64", ZEN4, "AVX512", "bfloat16"),
        ("float16", "x86_64", ZEN4, "AVX512", "bfloat16"),  # no AVX512-FP16: its bf16 instead
        ("float16", "x86_64", SAPPHIRE_RAPIDS, "AVX512", "float16"),
        ("bfloat16", "x86_64", SAPPHIRE_RAPIDS, "AVX512", "bfloat16"),
        ("bfloat16", "x86_64", SAPPHIRE_RAPIDS, "AVX2", "float32"),  # torch held to AVX2
        ("bfloat16", "x86_64", ZEN4, "DEFAULT", "float32"),
        ("float32", "x86_64", SAPPHIRE_RAPIDS, "AVX512", "float32"),
        ("bfloat16", "aarch64", CORTEX_A720, "SVE256", "bfloat16"),
        ("bfloat16", "aarch64", CORTEX_A76, "DEFAULT", "float32"),
        ("float16", "aarch64", CORTEX_A76, "DEFAULT", "float16"),
    ],
)
def test_auto_dtype_by_cpu(stored, arch, features, capability, expected):
    choice = choose_auto_dtype(stored, arch, features, capability)
    assert choice.dtype == expected
    assert choice.reason


def test_the_reason_names_what_decided():
    assert "avx512_bf16" in choose_auto_dtype("bfloat16", "x86_64", ZEN4, "AVX512").reason
    held = choose_auto_dtype("bfloat16", "x86_64", SAPPHIRE_RAPIDS, "AVX2").reason
    assert "torch runs at AVX2" in held
    assert "no native bfloat16 dot products" in choose_auto_dtype("bfloat16", "x86_64", ZEN3, "AVX2").reason


def test_load_model_auto_follows_the_host(smol_dir):
    """The loaded model computes in what the host's choice says, and the doctor's facts say why."""
    import torch

    from cpuserve.model.footprint import model_facts
    from cpuserve.model.loader import auto_dtype, load_model
    from cpuserve.model.source import ModelSource

    spec = ModelSource.open(smol_dir).spec
    choice = auto_dtype(spec)
    model = load_model(smol_dir, "auto")
    assert model.dtype == getattr(torch, choice.dtype)
    _, compute, facts = model_facts(smol_dir, "auto")
    assert compute == model.dtype
    assert facts["compute_dtype"] == choice.dtype and facts["compute_dtype_reason"] == choice.reason
    assert model_facts(smol_dir, "float32")[2]["compute_dtype_reason"] == "--dtype float32"
