"""Write an (unquantized) HF llama directory as a llama.cpp GGUF, F16 / Q8_0 / Q4_0, so llama.cpp
can be measured on exactly the weights cpuserve runs. Tokenizer metadata is copied from a
reference GGUF (for the bundled model: the file it was converted from)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from tqdm import tqdm

from cpuserve.errors import CpuserveError
from cpuserve.model.checkpoint import SafetensorsCheckpoint
from cpuserve.model.config import load_spec
from cpuserve.offline.gguf_convert import gguf_name, open_gguf, permute_rope, read_metadata

TYPES = {
    "f16": gguf.GGMLQuantizationType.F16,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
}
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre")


def export_gguf(model_dir: Path, out: Path, qtype: str, tokenizer_gguf: Path) -> Path:
    """Linear weights in `qtype`; token embedding and output head in Q8_0 when quantized (llama-quantize
    keeps them at 6 bits or more: Q6_K), norms in F32."""
    if qtype not in TYPES:
        raise CpuserveError(f"{qtype}: expected one of {', '.join(TYPES)}")
    spec = load_spec(model_dir)
    if spec.architecture != "LlamaForCausalLM" or spec.quantization_config is not None:
        raise CpuserveError(f"{model_dir}: only unquantized LlamaForCausalLM directories can be exported")
    meta = read_metadata(open_gguf(tokenizer_gguf))
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(spec.num_layers)
    w.add_context_length(spec.max_position_embeddings)
    w.add_embedding_length(spec.hidden_size)
    w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.num_heads)
    w.add_head_count_kv(spec.num_kv_heads)
    w.add_rope_freq_base(spec.rope.theta)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    w.add_vocab_size(spec.vocab_size)
    w.add_file_type({"f16": 1, "q8_0": 7, "q4_0": 2}[qtype])
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta.get("tokenizer.ggml.pre", "default"))
    tokens, types = list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.token_type"])
    if len(tokens) > spec.vocab_size:
        raise CpuserveError(f"{tokenizer_gguf}: {len(tokens)} tokens for a model of {spec.vocab_size}")
    padding = spec.vocab_size - len(tokens)  # random-weight models pad the bundled vocabulary
    tokens += [f"<|cpuserve_pad_{i}|>" for i in range(padding)]
    types += [5] * padding  # UNUSED
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    for key, add in (
        ("bos", w.add_bos_token_id),
        ("eos", w.add_eos_token_id),
        ("unknown", w.add_unk_token_id),
        ("padding", w.add_pad_token_id),
    ):
        if f"tokenizer.ggml.{key}_token_id" in meta:
            add(meta[f"tokenizer.ggml.{key}_token_id"])
    w.add_add_bos_token(bool(meta.get("tokenizer.ggml.add_bos_token", False)))
    with SafetensorsCheckpoint(model_dir) as ckpt:
        for name in tqdm(ckpt.names(), desc=f"GGUF {qtype}", unit="tensor"):
            target = gguf_name(name)
            if target is None:
                raise CpuserveError(f"{name}: no llama GGUF name")
            data = ckpt.get(name).to(torch.float32).numpy()
            if name.endswith("q_proj.weight"):
                data = permute_rope(data, spec.num_heads)
            elif name.endswith("k_proj.weight"):
                data = permute_rope(data, spec.num_kv_heads)
            if data.ndim == 1:
                w.add_tensor(target, data.astype(np.float32))
                continue
            kind = TYPES[qtype]
            if target in ("token_embd.weight", "output.weight") and qtype != "f16":
                kind = gguf.GGMLQuantizationType.Q8_0  # llama-quantize keeps these at >= 6 bits too
            if kind == gguf.GGMLQuantizationType.F16:
                w.add_tensor(target, data.astype(np.float16))
            else:
                w.add_tensor(target, gguf.quants.quantize(data, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
