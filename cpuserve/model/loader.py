"""Build the decoder from an HF directory, checking every tensor against the spec.

The model is built on the meta device with each linear's quant method chosen (model/linears.py);
every checkpoint tensor is then checked (name, shape, dtype) and read once into its place: float
tensors into the model's parameters, each linear's shards into its layer, which its method packs
for the chosen kernel as soon as the layer is complete (one layer's unpacked copy at a time). An
untied float head to be quantized is read as stored and quantized from that; an untied 16-bit
embedding served in float32 stays 16-bit (quantized_embedding.WidenedEmbedding).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from cpuserve.errors import CheckpointError, ConfigError
from cpuserve.model.config import ModelSpec
from cpuserve.model.decoder import CausalLM
from cpuserve.model.linears import LinearFactory
from cpuserve.model.quantized_embedding import HeadRowsEmbedding, QuantizedEmbedding, WidenedEmbedding
from cpuserve.model.source import ModelSource
from cpuserve.model.weight_pages import weight_pages
from cpuserve.platform.compute_dtype import DtypeChoice, host_auto_dtype
from cpuserve.quant.config import WeightQuant
from cpuserve.quant.gguf_blocks import DECODE_CHUNK_WEIGHTS
from cpuserve.quant.linear import Linear
from cpuserve.quant.methods import IntWeightMethod, KernelChoice, fetch_float, select_kernel
from cpuserve.quant.rtn import quantize_weight_in_chunks

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Tensors some exporters write that carry nothing the model needs.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
EMBEDDING = "model.embed_tokens.weight"


def resolve_dtype(name: str, spec: ModelSpec) -> torch.dtype:
    """`auto`: the checkpoint's 16-bit dtype where this CPU has native dot products for it, float32
    elsewhere (platform/compute_dtype.py says why)."""
    if name == "auto":
        name = auto_dtype(spec).dtype
    aliases = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
    name = aliases.get(name, name)
    if name not in DTYPES:
        raise ConfigError(f"--dtype {name!r} is not supported (expected auto, bfloat16, float16 or float32)")
    return DTYPES[name]


def auto_dtype(spec: ModelSpec) -> DtypeChoice:
    """What `--dtype auto` computes this checkpoint in here, and why."""
    stored = spec.torch_dtype if spec.torch_dtype in DTYPES else "bfloat16"
    return host_auto_dtype(stored)


LM_HEAD_KINDS = ("int8", "int4")
# What a served model's float output head becomes unless told otherwise: a decode step reads the
# whole head, and int8 halves a bf16 head's bytes (a quarter of float32's) for a KL of 0.007 on
# SmolLM2 (docs/benchmarks.md). "none" keeps it as the checkpoint has it.
DEFAULT_LM_HEAD = "int8"


def lm_head_setting(flag: str | None, env_value: str | None) -> str | None:
    """The head's scheme for --quantize-lm-head `flag` and CPUSERVE_QUANTIZE_LM_HEAD `env_value`
    (the flag wins, then the variable, then DEFAULT_LM_HEAD); None keeps it as stored. The default
    applies only where the native kernels run: on the pure-torch path an int8 head is slower."""
    kind = flag or env_value
    if kind is None:
        return DEFAULT_LM_HEAD if select_kernel() is not None else None
    return None if kind == "none" else kind


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


def _quantized_lm_head(
    head: Linear, kind: str, dtype: torch.dtype, kernel: KernelChoice | None, weight: torch.Tensor | None = None
) -> Linear:
    """Opt-in: the output head quantized like the body's linears, per-token int8 activations. A
    decode step reads the whole head (49152 x 576 for SmolLM2, 130560 x 2048 for MiniCPM5-2B): int8
    halves a bf16 head's bytes, int4 quarters them; logits move by the quantization error
    (tests/test_lm_head.py bounds it). weight: an untied head as the checkpoint stores it, not
    converted to the compute dtype first: quantization works in float32 from any float dtype, so
    where the compute dtype holds the stored values exactly (bf16 or fp16 served in float32, or the
    same dtype) the result is the same, and closer to the checkpoint where it is narrower (float32
    stored, served in bf16); a float32 copy of a 2B head was 1 GB of the load's peak."""
    quant = lm_head_quant(kind, head.in_features)
    # int8: the absmax scale. The least-error search (eight candidate scales, eight passes) gains
    # nothing measurable with 255 levels (tests/test_lm_head.py) and took ~23 s of a 2B load.
    w = head.weight if weight is None else weight
    q, scale = quantize_weight_in_chunks(w, quant, "minmax" if quant.bits == 8 else "mse")
    method = IntWeightMethod(quant, dtype)
    with torch.device("meta"):
        new = Linear(head.in_features, [head.out_features], False, method)
    method.set_weights(new, q, scale)
    method.process_weights_after_loading(new, kernel)
    log.info("lm_head quantized to %s: logits carry its rounding error", quant.name)
    return new


def _loaded_in_slices(layer: Linear, shards: list, ckpt: Any, kernel: KernelChoice | None) -> bool:
    """The output head of a GGUF, decoded and packed a few MB of rows at a time (GGUFCheckpoint.row_slices,
    IntWeightMethod.load_packed): the largest linear's decoded copy, its int8 copy and its packed one
    at once were the load's peak. False: load it the ordinary way."""
    if kernel is None or layer.quant is None or len(shards) != 1 or not hasattr(ckpt, "row_slices"):
        return False
    prefix = shards[0][0]
    rows = max(16, DECODE_CHUNK_WEIGHTS // layer.in_features // 16 * 16)  # whole panels, a decode chunk
    slices = ckpt.row_slices(prefix, rows)
    return slices is not None and layer.method.load_packed(layer, prefix, ckpt, slices, kernel)


def _stays_16_bit(table: torch.Tensor, dtype: torch.dtype, spec: ModelSpec) -> bool:
    """An untied 16-bit embedding served in float32 is kept 16-bit, its rows widened on lookup
    (WidenedEmbedding): exact, at half the bytes. A tied table is also the head's weight."""
    return dtype == torch.float32 and table.dtype in (torch.bfloat16, torch.float16) and not spec.tie_word_embeddings


def _shard_prefixes(model: CausalLM, name: str) -> list[str]:
    """The checkpoint modules a layer is loaded from: itself, or a fused layer's parts in order."""
    parent, _, child = name.rpartition(".")
    parts = model.packed_modules_mapping.get(child)
    return [f"{parent}.{p}" for p in parts] if parts else [name]


def load_model(
    model: Path | ModelSource,
    dtype: str = "auto",
    progress: bool = False,
    quantize_lm_head: str | None = None,
    fuse: bool = True,
    pack_float: bool | None = None,
) -> CausalLM:
    """Load config and weights (a directory, or a ModelSource already read at start); raise
    CheckpointError naming the tensor on any mismatch. With fuse, q/k/v and gate/up become one
    linear each where their methods agree; tools that need the checkpoint's modules one by one
    (calibration, per-layer tests) pass fuse=False. With pack_float (and native kernels), unquantized
    linears run on the native float kernel and their weights are packed for it; tools that edit
    weights (calibration) pass pack_float=False to keep them as torch tensors. Unset, it is on unless
    CPUSERVE_NATIVE_FLOAT=0 (torch's matmul kept, for A/B measurements)."""
    src = ModelSource.of(model)
    model_dir, spec, qc = src.model_dir, src.spec, src.quant_config
    torch_dtype = resolve_dtype(dtype, spec)
    source = str(model_dir / "config.json")
    if quantize_lm_head is not None:
        lm_head_quant(quantize_lm_head, spec.hidden_size)  # refuse a bad kind before reading anything
    factory = LinearFactory(torch_dtype, qc, fuse, spec.tie_word_embeddings, source)
    with torch.device("meta"):
        model = CausalLM(spec, factory)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    if spec.tie_word_embeddings:
        del linears["lm_head"]  # the embedding is the head
    owned = {f"{name}.{p}" for name, m in linears.items() for p, _ in m.state_dict(keep_vars=True).items()}
    expected = {
        n: tuple(p.shape) for n, p in model.named_parameters() if n not in owned and not n.startswith("lm_head.")
    }
    shards: dict[str, list[tuple[str, dict[str, tuple[int, ...]]]]] = {}
    for name, layer in linears.items():
        shards[name] = []
        for i, prefix in enumerate(_shard_prefixes(model, name)):
            n = layer.output_sizes[i]
            tensors = layer.method.checkpoint_tensors(prefix, n, layer.in_features)
            if layer.bias is not None:
                tensors[f"{prefix}.bias"] = (n,)
            shards[name].append((prefix, tensors))
    linear_tensors = {t: s for parts in shards.values() for _, ts in parts for t, s in ts.items()}
    if pack_float is None:
        pack_float = os.environ.get("CPUSERVE_NATIVE_FLOAT", "1") != "0"
    kernel = select_kernel() if qc is not None or quantize_lm_head or pack_float else None
    dense_kernel = kernel if pack_float else None
    pages = weight_pages() if kernel is not None else None  # each linear moved into them once packed

    def settle(layer: Linear) -> None:
        if pages is not None:
            pages.settle(layer)

    state: dict[str, torch.Tensor] = {}
    with src.checkpoint as ckpt:
        missing = [n for n in [*expected, *linear_tensors] if n not in ckpt]
        if missing:
            stored_name = getattr(ckpt, "stored_name", lambda n: n)  # a pre-fused checkpoint's name for it
            raise CheckpointError(
                f"{model_dir}: tensor '{stored_name(missing[0])}' is missing"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                + f" for {spec.architecture}"
                + (f" with {(spec.quantization_config or {}).get('format') or qc.label} quantization" if qc else "")
            )
        extra = [n for n in ckpt.names() if n not in expected and n not in linear_tensors and not _IGNORED.search(n)]
        if spec.tie_word_embeddings and "lm_head.weight" in extra:
            extra.remove("lm_head.weight")  # tied: the embedding is the head
        if extra:
            raise CheckpointError(
                f"{ckpt.file_of(extra[0])}: unexpected tensor '{extra[0]}'"
                + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
                + f" for {spec.architecture}: does config.json describe this checkpoint?"
            )
        bar = tqdm(total=len(expected) + len(linears), desc="loading weights", unit="tensor", disable=not progress)
        # A table the file holds quantized stays so (an untied one: a tied head reads the float table);
        # one the output head repeats (a GGUF's tied table on the kernels) is read from the head.
        head = linears.get("lm_head")
        from_head = (
            EMBEDDING in expected
            and "lm_head.weight" in getattr(ckpt, "aliases", ())
            and head is not None
            and head.quant is not None
            and ckpt.shape(EMBEDDING) == (head.out_features, head.in_features)
        )
        embedding = None
        if from_head:
            pass  # built once the head is packed
        elif not spec.tie_word_embeddings and EMBEDDING in expected and hasattr(ckpt, "quantized_table"):
            table = ckpt.quantized_table(EMBEDDING)
            if table is not None and tuple(table.values.shape) != expected[EMBEDDING]:
                raise CheckpointError(
                    f"{ckpt.file_of(EMBEDDING)}: tensor '{EMBEDDING}' has shape {tuple(table.values.shape)}, "
                    f"expected {expected[EMBEDDING]} from config.json"
                )
            if table is not None:  # built now: the decoded table goes before the linears load
                embedding = QuantizedEmbedding(
                    table.values, table.scales, table.offsets, torch_dtype, table.codes, table.scheme.coding
                )
                del table
        for name in expected:
            if name != EMBEDDING or (embedding is None and not from_head):
                t = fetch_float(ckpt, name, expected[name])
                if name == EMBEDDING and _stays_16_bit(t, torch_dtype, spec):
                    embedding = WidenedEmbedding(t, torch_dtype)
                else:
                    state[name] = t.to(torch_dtype).contiguous()
                del t
            bar.update()
        head_weight = None  # an untied float head to be quantized: as stored, read once
        for name, layer in linears.items():
            if _loaded_in_slices(layer, shards[name], ckpt, kernel):
                settle(layer)
                bar.update()
                continue
            if name == "lm_head" and quantize_lm_head and layer.quant is None:  # (the head has no bias)
                ((prefix, tensors),) = shards[name]
                head_weight = fetch_float(ckpt, f"{prefix}.weight", tensors[f"{prefix}.weight"])
                bar.update()
                continue
            for i, (prefix, tensors) in enumerate(shards[name]):
                layer.method.load_shard(layer, i, prefix, ckpt)
                if layer.bias is not None:
                    bias = f"{prefix}.bias"
                    layer.load_bias(i, fetch_float(ckpt, bias, tensors[bias]))
            layer.method.process_weights_after_loading(layer, kernel if layer.quant else dense_kernel)  # once
            settle(layer)
            bar.update()
        bar.close()
    if from_head:
        embedding = HeadRowsEmbedding(model.lm_head, torch_dtype)
    result = model.load_state_dict(state, strict=False, assign=True)
    missing_keys = [k for k in result.missing_keys if k not in owned and not k.startswith("lm_head.")]
    if embedding is not None:
        missing_keys.remove(EMBEDDING)
        model.model.embed_tokens = embedding
        log.info("token embedding: %s", model.model.embed_tokens.extra_repr())
    if result.unexpected_keys or missing_keys:
        raise RuntimeError(f"internal: state dict mismatch {[*result.unexpected_keys, *missing_keys][:3]}")
    if spec.tie_word_embeddings:  # one tensor, not two copies
        model.lm_head.weight = model.model.embed_tokens.weight
    model.requires_grad_(False)
    model.eval()
    if quantize_lm_head and model.lm_head.quant is not None:
        log.info("lm_head is already quantized (%s): --quantize-lm-head leaves it", model.lm_head.quant.name)
    elif quantize_lm_head:
        model.lm_head = _quantized_lm_head(model.lm_head, quantize_lm_head, torch_dtype, kernel, head_weight)
        head_weight = None
        linears["lm_head"] = model.lm_head
        settle(model.lm_head)
    elif spec.tie_word_embeddings and dense_kernel is not None:  # the head's own panels; the embedding stays
        model.lm_head.method.process_weights_after_loading(model.lm_head, dense_kernel)
        linears["lm_head"] = model.lm_head
        settle(model.lm_head)
    if pages is not None:
        log.info("packed weights: %s; CPUSERVE_HUGE_PAGES=0 keeps 4 KB pages", pages.summary())
    dense = [m for m in linears.values() if m.quant is None]
    if dense:
        kinds = sorted({m.method.storage(m) for m in dense})
        log.info("float linears: %s (%d layers)", "; ".join(kinds), len(dense))
    quantized = [m for m in linears.values() if m.quant is not None]
    if quantized:
        on_kernel = sum(m.kernel is not None for m in quantized)
        runs = f"native {kernel.variant}" if kernel is not None else "reference (pure torch)"
        log.info("quantized linears: %s (%d/%d layers; the rest reference)", runs, on_kernel, len(quantized))
        int6 = sum(m.packed_layout == "int6_panel" for m in quantized)
        if int6:
            log.info("  %d of them held as int6 panels (8-bit values within [-32, 31], 6 bits a weight)", int6)
        elif kernel is not None and any(m.quant.int6 for m in quantized):
            log.info("  held as int8: %s has no int6 panels, or the shapes are not whole panels", kernel.variant)
    log.info(
        "loaded %s from %s: %d layers, hidden %d, %s%s",
        spec.architecture,
        model_dir,
        spec.num_layers,
        spec.hidden_size,
        str(torch_dtype).removeprefix("torch."),
        f" (--dtype auto: {auto_dtype(spec).reason})" if dtype == "auto" else "",
    )
    return model
