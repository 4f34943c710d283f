"""A model directory read once at start: config.json (the spec), its quantization config and every
safetensors header (or, for a GGUF served as it is, the file's tensor table). The footprint
(doctor, the KV cache size) and the loader both take this, so nothing is parsed twice."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cpuserve.model.checkpoint import SafetensorsCheckpoint
from cpuserve.model.config import ModelSpec, load_spec
from cpuserve.model.gguf_source import GGUFCheckpoint, open_gguf_weights, read_pointer
from cpuserve.model.prefused import SplitFusedCheckpoint, split_prefused
from cpuserve.quant.config import QuantConfig


@dataclass(frozen=True)
class ModelSource:
    model_dir: Path
    spec: ModelSpec
    quant_config: QuantConfig | None
    checkpoint: SafetensorsCheckpoint | GGUFCheckpoint | SplitFusedCheckpoint  # under the decoder's names

    @classmethod
    def open(cls, model_dir: Path) -> ModelSource:
        spec = load_spec(model_dir)
        gguf_path = read_pointer(model_dir)
        if gguf_path is not None:  # a GGUF served as it is (model/gguf_source.py)
            qc, checkpoint = open_gguf_weights(gguf_path, spec)
            return cls(model_dir, spec, qc, checkpoint)
        source = str(model_dir / "config.json")
        qc = QuantConfig.from_hf(spec.quantization_config, source) if spec.quantization_config else None
        return cls(model_dir, spec, qc, split_prefused(SafetensorsCheckpoint(model_dir), spec))

    @staticmethod
    def of(model: Path | ModelSource) -> ModelSource:
        return model if isinstance(model, ModelSource) else ModelSource.open(model)
