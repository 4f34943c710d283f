"""Start-up reads the model directory once: each safetensors header is parsed exactly once from
the footprint to the loaded engine, and environment settings are validated once with the others."""

from __future__ import annotations

import pytest

from cpuserve.engine import EngineConfig, LLMEngine
from cpuserve.errors import ConfigError
from cpuserve.model import checkpoint
from cpuserve.platform.overrides import read_overrides


def test_each_header_is_parsed_once_from_footprint_to_engine(smol_dir, monkeypatch):
    seen = []
    real = checkpoint.read_header

    def counting(path):  # type: ignore[no-untyped-def]
        seen.append(path.name)
        return real(path)

    monkeypatch.setattr(checkpoint, "read_header", counting)
    engine = LLMEngine.from_model_dir(smol_dir, EngineConfig(max_model_len=256), "float32")
    assert sorted(seen) == sorted(p.name for p in smol_dir.glob("*.safetensors")) and len(seen) >= 1
    assert engine.facts is not None and engine.facts["layers"] == engine.model.spec.num_layers


def test_quantize_lm_head_is_read_from_the_environment_once_and_checked():
    assert read_overrides({"CPUSERVE_QUANTIZE_LM_HEAD": "int8"}).quantize_lm_head == "int8"
    assert read_overrides({}).quantize_lm_head is None
    with pytest.raises(ConfigError, match=r"CPUSERVE_QUANTIZE_LM_HEAD='int3': expected one of int8, int4"):
        read_overrides({"CPUSERVE_QUANTIZE_LM_HEAD": "int3"})


def test_the_environment_reaches_the_loader_through_the_overrides(smol_dir, monkeypatch):
    monkeypatch.setenv("CPUSERVE_QUANTIZE_LM_HEAD", "int8")
    engine = LLMEngine.from_model_dir(smol_dir, EngineConfig(max_model_len=256), "float32")
    assert engine.model.lm_head.quant is not None and engine.model.lm_head.quant.bits == 8


def test_a_served_head_is_int8_unless_told_otherwise(smol_dir, monkeypatch):
    """The engine's default head is int8 (loader.DEFAULT_LM_HEAD); "none" by flag or environment keeps it."""
    monkeypatch.delenv("CPUSERVE_QUANTIZE_LM_HEAD", raising=False)
    config = EngineConfig(max_model_len=256)
    default = LLMEngine.from_model_dir(smol_dir, config, "float32").model.lm_head
    assert default.quant is not None and default.quant.bits == 8
    assert LLMEngine.from_model_dir(smol_dir, config, "float32", quantize_lm_head="none").model.lm_head.quant is None
    monkeypatch.setenv("CPUSERVE_QUANTIZE_LM_HEAD", "none")
    assert LLMEngine.from_model_dir(smol_dir, config, "float32").model.lm_head.quant is None
    head = LLMEngine.from_model_dir(smol_dir, config, "float32", quantize_lm_head="int4").model.lm_head
    assert head.quant is not None and head.quant.bits == 4  # the flag wins over the variable
