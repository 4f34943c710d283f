"""A model directory read once at start: config.json (the spec), its quantization config and every
safetensors header. The footprint (doctor, the KV cache size) and the loader both take this, so
nothing is parsed twice."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cpuserve.model.checkpoint import SafetensorsCheckpoint
from cpuserve.model.config import ModelSpec, load_spec
from cpuserve.quant.config import QuantConfig


@dataclass(frozen=True)
class ModelSource:
    model_dir: Path
    spec: ModelSpec
    quant_config: QuantConfig | None
    checkpoint: SafetensorsCheckpoint

    @classmethod
    def open(cls, model_dir: Path) -> ModelSource:
        spec = load_spec(model_dir)
        source = str(model_dir / "config.json")
        qc = QuantConfig.from_hf(spec.quantization_config, source) if spec.quantization_config else None
        return cls(model_dir, spec, qc, SafetensorsCheckpoint(model_dir))

    @staticmethod
    def of(model: Path | ModelSource) -> ModelSource:
        return model if isinstance(model, ModelSource) else ModelSource.open(model)
