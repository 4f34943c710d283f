"""Build the reference decoder from an HF directory, checking every tensor against the spec."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from cpuserve.errors import CheckpointError, ConfigError
from cpuserve.model.checkpoint import SafetensorsCheckpoint
from cpuserve.model.config import ModelSpec, load_spec
from cpuserve.model.decoder import CausalLM
from cpuserve.model.fusion import fuse_projections
from cpuserve.quant.config import QuantConfig, WeightQuant
from cpuserve.quant.schemes import QuantLinear, expected_tensors, load_quantized, use_native_kernels

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Tensors some exporters write that carry nothing the model needs.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def resolve_dtype(name: str, spec: ModelSpec) -> torch.dtype:
    """`auto` means the checkpoint's own dtype, as vLLM's --dtype auto does."""
    if name == "auto":
        name = spec.torch_dtype if spec.torch_dtype in DTYPES else "bfloat16"
    aliases = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
    name = aliases.get(name, name)
    if name not in DTYPES:
        raise ConfigError(f"--dtype {name!r} is not supported (expected auto, bfloat16, float16 or float32)")
    return DTYPES[name]


def quantize_modules(model: CausalLM, spec: ModelSpec, source: str) -> dict[str, QuantLinear]:
    """Swap the Linear modules the quantization_config covers for QuantLinear (on the meta device)."""
    if spec.quantization_config is None:
        return {}
    qc = QuantConfig.from_hf(spec.quantization_config, source)
    swapped: dict[str, QuantLinear] = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        quant = qc.scheme_for(name)
        if quant is None:
            continue
        if name == "lm_head" and spec.tie_word_embeddings:
            raise ConfigError(f"{source}: lm_head is tied to the embeddings and cannot be quantized; add it to ignore")
        if quant.group_size and module.in_features % quant.group_size:
            raise ConfigError(
                f"{source}: {name} ({quant.name}): input size {module.in_features} is not a multiple "
                f"of group_size {quant.group_size}"
            )
        with torch.device("meta"):
            q = QuantLinear(module.in_features, module.out_features, quant, module.bias is not None)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, q)
        swapped[name] = q
    return swapped


LM_HEAD_KINDS = ("int8", "int4")


def lm_head_quant(kind: str, hidden_size: int) -> WeightQuant:
    """The scheme --quantize-lm-head KIND gives a head of this width: int8 per channel, or int4 in
    groups of 128 (else 64, else 32)."""
    if kind not in LM_HEAD_KINDS:
        raise ConfigError(f"--quantize-lm-head {kind!r}: expected one of {', '.join(LM_HEAD_KINDS)}")
    if kind == "int8":
        return WeightQuant(bits=8, group_size=None, packed=False)
    group = next((g for g in (128, 64, 32) if hidden_size % g == 0), None)
    if group is None:
        raise ConfigError(f"--quantize-lm-head int4: hidden size {hidden_size} is not a multiple of 32")
    return WeightQuant(bits=4, group_size=group, packed=False)


def _quantize_lm_head(model: CausalLM, kind: str) -> None:
    """Opt-in: the output head quantized like the body's linears, per-token int8 activations. A
    decode step reads the whole head (49152 x 576 for SmolLM2, 130560 x 2048 for MiniCPM5-2B): int8
    halves a bf16 head's bytes, int4 quarters them; logits move by the quantization error
    (tests/test_lm_head.py bounds it)."""
    from cpuserve.quant.quantize import quantize_weight_in_chunks

    head = model.lm_head
    quant = lm_head_quant(kind, head.in_features)
    # int8: the absmax scale. The least-error search (eight candidate scales, eight passes) gains
    # nothing measurable with 255 levels (tests/test_lm_head.py) and took ~23 s of a 2B load.
    method = "minmax" if quant.bits == 8 else "mse"
    q, scale = quantize_weight_in_chunks(head.weight, quant, method)
    new = QuantLinear(head.in_features, head.out_features, quant, bias=False)
    new.qweight, new.scales = q, scale.float()
    model.lm_head = new
    log.info("lm_head quantized to %s: logits carry its rounding error", quant.name)


def load_model(
    model_dir: Path,
    dtype: str = "auto",
    progress: bool = False,
    quantize_lm_head: str | None = None,
    fuse: bool = True,
) -> CausalLM:
    """Load config and weights; raise CheckpointError naming the tensor on any mismatch. With fuse,
    q/k/v and gate/up become one linear each (model/fusion.py); tools that need the checkpoint's
    modules one by one (calibration, per-layer tests) pass fuse=False."""
    spec = load_spec(model_dir)
    torch_dtype = resolve_dtype(dtype, spec)
    with torch.device("meta"):
        model = CausalLM(spec)
    quantized = quantize_modules(model, spec, str(model_dir / "config.json"))
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if spec.tie_word_embeddings:
        expected.pop("lm_head.weight")
    quant_tensors = {
        name: shape
        for prefix, q in quantized.items()
        for name, shape in expected_tensors(prefix, q.quant, q.out_features, q.in_features).items()
    }

    state: dict[str, torch.Tensor] = {}
    with SafetensorsCheckpoint(model_dir) as ckpt:
        missing = [n for n in [*expected, *quant_tensors] if n not in ckpt]
        if missing:
            raise CheckpointError(
                f"{model_dir}: tensor '{missing[0]}' is missing"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                + f" for {spec.architecture}"
                + (f" with {spec.quantization_config.get('format')} quantization" if quantized else "")
            )
        extra = [n for n in ckpt.names() if n not in expected and n not in quant_tensors and not _IGNORED.search(n)]
        if spec.tie_word_embeddings and "lm_head.weight" in extra:
            extra.remove("lm_head.weight")  # tied: the embedding is the head
        if extra:
            raise CheckpointError(
                f"{ckpt.file_of(extra[0])}: unexpected tensor '{extra[0]}'"
                + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
                + f" for {spec.architecture}: does config.json describe this checkpoint?"
            )
        for name in tqdm(expected, desc="loading weights", unit="tensor", disable=not progress):
            shape = ckpt.shape(name)
            if shape != expected[name]:
                raise CheckpointError(
                    f"{ckpt.file_of(name)}: tensor '{name}' has shape {list(shape)}, "
                    f"expected {list(expected[name])} from config.json"
                )
            tensor = ckpt.get(name)
            if not tensor.is_floating_point():
                raise CheckpointError(
                    f"{ckpt.file_of(name)}: tensor '{name}' has dtype {tensor.dtype}, "
                    "expected a floating-point dtype (float32, bfloat16 or float16)"
                )
            state[name] = tensor.to(torch_dtype).contiguous()
        for prefix, q in quantized.items():
            load_quantized(q, prefix, ckpt.get, ckpt.file_of)
            state[f"{prefix}.scales"] = q.scales
            if q.qweight is not None:
                state[f"{prefix}.qweight"] = q.qweight
    if spec.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing_ok = {f"{p}.qweight" for p, q in quantized.items() if q.qweight is None}  # loaded as nibbles
    result = model.load_state_dict(state, strict=False, assign=True)
    unexpected = list(result.unexpected_keys) + [k for k in result.missing_keys if k not in missing_ok]
    if unexpected:
        raise RuntimeError(f"internal: state dict mismatch {unexpected[:3]}")
    if spec.tie_word_embeddings:  # one tensor, not two copies
        model.lm_head.weight = model.model.embed_tokens.weight
    model.requires_grad_(False)
    model.eval()
    lm_head = quantize_lm_head if quantize_lm_head is not None else os.environ.get("CPUSERVE_QUANTIZE_LM_HEAD")
    if lm_head:
        _quantize_lm_head(model, lm_head)
        quantized["lm_head"] = model.lm_head
    if quantized:
        log.info("quantized linears: %s", use_native_kernels(model))
    if fuse:
        fused = fuse_projections(model)
        log.debug("fused %d of %d q/k/v and gate/up groups", fused, 2 * spec.num_layers)
    log.info(
        "loaded %s from %s: %d layers, hidden %d, %s",
        spec.architecture,
        model_dir,
        spec.num_layers,
        spec.hidden_size,
        str(torch_dtype).removeprefix("torch."),
    )
    return model
