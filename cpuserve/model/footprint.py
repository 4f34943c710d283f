"""What a model costs on this machine, from config and safetensors headers (no weights read):
parameters, bytes, KV bytes per token, scheme and kernels, and the memory plan that follows.
Used by `doctor` (to explain), by the engine (to size the KV cache) and by `generate` (to refuse
a model that cannot fit before reading it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from cpuserve.engine.kv_int8 import int8_row_bytes
from cpuserve.kv_cache_dtype import kv_cache_storage
from cpuserve.model.config import ModelSpec
from cpuserve.model.loader import auto_dtype, resolve_dtype
from cpuserve.model.source import ModelSource
from cpuserve.platform.machine import Machine
from cpuserve.platform.overrides import Overrides
from cpuserve.platform.plan import MemoryPlan, plan_memory
from cpuserve.quant.config import QuantConfig

FLOAT_DTYPES = ("BF16", "F16", "F32")
INT_BYTES = {"I8": 1, "U8": 1, "I32": 4, "I64": 8}
CODE_BYTES = {"I8": 1, "U8": 1, "F16": 2, "F32": 4}  # quant/scale_codes.py
CODED_PARTS = ("weight_scale_code", "weight_scale_super", "weight_offset_code", "weight_offset_super")


def model_facts(
    model: Path | ModelSource, dtype: str, kv_cache_dtype: str = "auto"
) -> tuple[ModelSpec, torch.dtype, dict[str, Any]]:
    """Spec, compute dtype and size facts, from config and safetensors headers (no weights read);
    the KV bytes per token as `--kv-cache-dtype kv_cache_dtype` stores them."""
    source = ModelSource.of(model)
    model_dir, spec, qc = source.model_dir, source.spec, source.quant_config
    compute = resolve_dtype(dtype, spec)
    elem = torch.empty((), dtype=compute).element_size()
    with source.checkpoint as ckpt:
        params, weight_bytes, native_bytes = 0, 0, 0
        # A GGUF's tied head: its own packed copy (values, coded scales and offsets), no parameters of its
        # own; the embedding is looked up in it (model/quantized_embedding.py), no bytes of its own.
        aliases = getattr(ckpt, "aliases", set())
        embedding_in_head = "lm_head.weight" in aliases
        head = qc.scheme_for("lm_head") if qc and aliases else None
        per_value = 0.5 if head is not None and head.bits == 4 else 1  # an int4 head's values as nibbles
        for n in ckpt.names():
            count = int(torch.Size(ckpt.shape(n)).numel())
            if n.endswith(CODED_PARTS):  # a GGUF's coded scales and offsets, held as coded
                held = count * CODE_BYTES[ckpt.stored_dtype(n)]
                native_bytes += held
                weight_bytes += held
                continue
            if n in aliases:  # in memory as the kernel holds it: what the plan reserves for the table
                held = int(count * (per_value if ckpt.stored_dtype(n) == "I8" else 4))
                native_bytes += held
                weight_bytes += held
                continue
            stored = ckpt.stored_dtype(n)
            if embedding_in_head and n == "model.embed_tokens.weight":
                params += count
                continue
            if stored in FLOAT_DTYPES:
                per_group = n.endswith(("weight_scale", "weight_offset"))  # fp32 per group, not parameters
                held = 4 if per_group else elem
                widened = n == "model.embed_tokens.weight" and stored != "F32" and not spec.tie_word_embeddings
                if widened and not hasattr(ckpt, "quantized_table"):  # a GGUF's float tables read as float32
                    held = min(held, 2)  # kept 16-bit, rows widened (quantized_embedding.WidenedEmbedding)
                weight_bytes += count * held
                native_bytes += count * held
                params += 0 if per_group else count
            elif not n.endswith("weight_shape"):  # int8 values, or int32 words of packed values
                weight_bytes += count * INT_BYTES.get(stored, 1)
                quant = qc.scheme_for(n.rsplit(".", 1)[0]) if qc else None
                params += count * (32 // quant.bits if quant and stored == "I32" else 1)
                # The native kernels hold int4 as nibbles whichever way the checkpoint stored it.
                native_bytes += (
                    count * INT_BYTES.get(stored, 1) // (2 if quant and quant.bits == 4 and stored != "I32" else 1)
                )
        dtypes = sorted({str(ckpt.stored_dtype(n)) for n in ckpt.names()})
        files = sorted({ckpt.file_of(n).name for n in ckpt.names()})
    facts = {
        "path": str(model_dir),
        "architecture": spec.architecture,
        "format": getattr(ckpt, "format_description", None)
        or f"HF safetensors ({len(files)} file{'s' * (len(files) > 1)}, stored as {', '.join(dtypes)})",
        "scheme": _scheme(qc, compute),
        "compute_dtype": str(compute).removeprefix("torch."),
        "compute_dtype_reason": auto_dtype(spec).reason if dtype == "auto" else f"--dtype {dtype}",
        "layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "parameters": params,
        "weights_bytes": weight_bytes,
        "weights_bytes_native": native_bytes,  # as the native kernels hold them (int4 as nibbles)
        **_kv_cache_facts(spec, kv_cache_dtype, dtype, compute, elem),
        "max_position_embeddings": spec.max_position_embeddings,
        "kernels": {
            "linear (q/k/v/o, gate/up/down, lm_head)": _linear_kernels(qc, compute),
            **_float_op_kernels(spec),
        },
    }
    return spec, compute, facts


def auto_kv_storage(spec: ModelSpec, dtype: str, compute: torch.dtype) -> str | None:
    """What `--kv-cache-dtype auto` stores where `--dtype auto` computes a 16-bit checkpoint in float32
    (a CPU without native 16-bit dot products): the checkpoint's dtype, as vLLM's auto (the model's
    dtype, which is the checkpoint's there) stores it. Half the bytes decode attention reads and the
    memory plan reserves a token; the kernels widen rows to float32 as they read them. None: the
    compute dtype (an explicit --dtype, or a CPU computing in the checkpoint's dtype)."""
    stored = spec.torch_dtype if spec.torch_dtype in ("bfloat16", "float16") else None
    if dtype != "auto" or compute != torch.float32 or stored is None:
        return None
    return stored


def _kv_cache_facts(
    spec: ModelSpec, kv_cache_dtype: str, dtype: str, compute: torch.dtype, elem: int
) -> dict[str, Any]:
    """What one token's K and V rows cost in every layer, what the cache holds them as, and (as
    `kv_cache_storage`, kv_cache_dtype.kv_cache_storage's names) what the engine stores."""
    name = str(compute).removeprefix("torch.")
    storage = kv_cache_storage(kv_cache_dtype)
    if storage is None and (auto := auto_kv_storage(spec, dtype, compute)) is not None:
        return {
            "kv_bytes_per_token": 2 * spec.num_layers * spec.kv_size * 2,
            "kv_cache_dtype": f"{auto} (--kv-cache-dtype auto: the checkpoint's dtype; the model computes in {name})",
            "kv_cache_storage": auto,
        }
    if storage is None or storage == name:
        return {"kv_bytes_per_token": 2 * spec.num_layers * spec.kv_size * elem, "kv_cache_dtype": name}
    if storage != "int8":  # a 16-bit cache, the model computing in another dtype
        return {
            "kv_bytes_per_token": 2 * spec.num_layers * spec.kv_size * 2,
            "kv_cache_dtype": f"{storage} (--kv-cache-dtype {kv_cache_dtype}; the model computes in {name})",
            "kv_cache_storage": storage,
        }
    asked = "" if kv_cache_dtype == "int8" else f", for --kv-cache-dtype {kv_cache_dtype}"
    return {
        "kv_bytes_per_token": 2 * spec.num_layers * spec.num_kv_heads * int8_row_bytes(spec.head_dim),
        "kv_cache_dtype": f"int8 (one fp32 scale per token and KV head{asked})",
        "kv_cache_storage": "int8",
    }


def plan_model_memory(
    machine: Machine,
    ov: Overrides,
    spec: ModelSpec,
    facts: dict[str, Any],
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> MemoryPlan:
    """The memory plan for one model; raises ConfigError when it does not fit."""
    # fp32 activations per batched token: residual, normed input, q/k/v, attention out, gate/up/act.
    activation = 4 * (4 * spec.hidden_size + 3 * spec.intermediate_size + spec.q_size + 2 * spec.kv_size)
    return plan_memory(
        machine.resources,
        ov,
        weights=facts["weights_bytes"],
        kv_bytes_per_token=facts["kv_bytes_per_token"],
        model_max_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        activation_bytes_per_token=activation,
    )


def _scheme(qc: QuantConfig | None, compute: torch.dtype) -> str:
    dense = str(compute).removeprefix("torch.")
    if qc is None:
        return f"unquantized, computed in {dense}"
    names = sorted({g.weight.name for g in qc.groups})
    acts = (
        "int8 activations per group (K-quants: per 256-input super-block)"
        if all(g.weight.act_groups for g in qc.groups)
        else "int8 per-token activations"
    )
    return f"{qc.label} {', '.join(names)}, {acts}; the rest in {dense}"


def _float_op_kernels(spec: ModelSpec) -> dict[str, str]:
    """What runs around the linears (the same switches as model/ops.py and model/native_decode.py)."""
    from cpuserve.model import native_decode, ops

    if not ops.native_ops_enabled():
        return {
            "attention": "decode: grouped fp32 matmuls per KV head (torch); prefill: torch SDPA",
            "norm, rope, activation": "torch",
            "decode step": "Python layer loop",
        }
    whole = native_decode.enabled() and native_decode.layer_is_native(spec)
    return {
        "attention": (
            "decode and prefill: native, read the KV cache in place (prefill in query and key blocks; "
            "a bf16 model on a bf16 cache: bf16 pair products where the CPU has AVX512_BF16, else fp32)"
        ),
        "norm, rope, activation": "native (residual add fused with the next norm)",
        "decode step": "native, all layers in one call" if whole else "Python layer loop (native ops)",
    }


def _linear_kernels(qc: QuantConfig | None, compute: torch.dtype) -> str:
    dense = f"torch matmul, {str(compute).removeprefix('torch.')}"
    if qc is None:
        return dense
    from cpuserve.kernels import native, selected_variant

    schemes = sorted({q.name for g in qc.groups for q in [g.weight]})
    variant = selected_variant()
    runs = f"native {variant}" if variant != "reference" and native() is not None else "pure-torch reference"
    return f"{', '.join(schemes)}: {runs}; unquantized ones ({', '.join(qc.ignore) or 'none'}): {dense}"
