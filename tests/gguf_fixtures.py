"""A tiny llama GGUF written in the test, with the quant types `convert` must read, and a slow
dequantizer written from the format description (not from the gguf package)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 96, 2
HEAD_DIM = HIDDEN // HEADS

# Which GGUF type each tensor is stored as: one of each required type appears.
LAYER_TYPES = {
    "attn_q.weight": Q.F32,
    "attn_k.weight": Q.F16,
    "attn_v.weight": Q.Q8_0,
    "attn_output.weight": Q.Q4_0,
    "ffn_gate.weight": Q.Q4_1,
    "ffn_up.weight": Q.BF16,
    "ffn_down.weight": Q.Q4_0,
}


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *byte_alphabet()]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    tokens += [m.replace(" ", "") for m in merges]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return tokens, types, merges


def llama_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (pairs interleaved), from an HF-layout weight."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_SKIP: set[str] = set()


def decoder_writer(
    path: Path, arch: str, layers: int, context: int, hidden: int, ffn: int, heads: int, kv_heads: int
) -> gguf.GGUFWriter:
    """A GGUFWriter with the shape keys llama.cpp writes for every decoder architecture."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    return writer


def hf_decoder_writer(path: Path, arch: str, cfg: Any) -> gguf.GGUFWriter:
    """decoder_writer with the shape of a transformers config."""
    return decoder_writer(
        path,
        arch,
        cfg.num_hidden_layers,
        cfg.max_position_embeddings,
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
    )


def add_tiny_tokenizer(writer: gguf.GGUFWriter) -> int:
    """tiny_vocab() as a byte-level BPE tokenizer (SmolLM2's pre-tokenizer), BOS 1, EOS 2; its size."""
    tokens, types, merges = tiny_vocab()
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    return len(tokens)


def store_tensor(writer: gguf.GGUFWriter, name: str, w: np.ndarray, qtype: Q = Q.F32) -> None:
    """`w` as GGUF type `qtype` (F32, F16, or quantized by gguf-py)."""
    if qtype == Q.F32:
        writer.add_tensor(name, w.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, w.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), qtype), raw_dtype=qtype)


def _store(writer: gguf.GGUFWriter, name: str, w: np.ndarray, qtype: Q) -> None:
    if name not in _SKIP:
        store_tensor(writer, name, w, qtype)


def write_tiny_llama(path: Path, tied: bool = False, seed: int = 0, skip: str | None = None) -> dict[str, np.ndarray]:
    """Write the GGUF (without the tensor `skip`, for tests of a broken file); return the HF-layout
    fp32 weights it was made from (before quantization)."""
    _SKIP.clear()
    if skip:
        _SKIP.add(skip)
    rng = np.random.default_rng(seed)
    writer = decoder_writer(path, "llama", LAYERS, 512, HIDDEN, FFN, HEADS, KV_HEADS)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    vocab = add_tiny_tokenizer(writer)
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")

    hf: dict[str, np.ndarray] = {}
    emb = rng.standard_normal((vocab, HIDDEN)).astype(np.float32) * 0.1
    _store(writer, "token_embd.weight", emb, Q.Q8_0)
    hf["model.embed_tokens.weight"] = emb
    norm = 1 + 0.1 * rng.standard_normal(HIDDEN).astype(np.float32)
    _store(writer, "output_norm.weight", norm, Q.F32)
    hf["model.norm.weight"] = norm
    if not tied:
        out = rng.standard_normal((vocab, HIDDEN)).astype(np.float32) * 0.1
        _store(writer, "output.weight", out, Q.Q4_1)
        hf["lm_head.weight"] = out
    shapes = {
        "attn_q.weight": (HIDDEN, HIDDEN),
        "attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_output.weight": (HIDDEN, HIDDEN),
        "ffn_gate.weight": (FFN, HIDDEN),
        "ffn_up.weight": (FFN, HIDDEN),
        "ffn_down.weight": (HIDDEN, FFN),
    }
    hf_names = {
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    }
    for n in range(LAYERS):
        for norm_name, hf_norm in (
            ("attn_norm.weight", "input_layernorm.weight"),
            ("ffn_norm.weight", "post_attention_layernorm.weight"),
        ):
            w = 1 + 0.1 * rng.standard_normal(HIDDEN).astype(np.float32)
            _store(writer, f"blk.{n}.{norm_name}", w, Q.F32)
            hf[f"model.layers.{n}.{hf_norm}"] = w
        for name, shape in shapes.items():
            w = rng.standard_normal(shape).astype(np.float32) * 0.1
            hf[f"model.layers.{n}.{hf_names[name]}"] = w
            if name == "attn_q.weight":
                w = llama_permute(w, HEADS)
            elif name == "attn_k.weight":
                w = llama_permute(w, KV_HEADS)
            _store(writer, f"blk.{n}.{name}", w, LAYER_TYPES[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def slow_dequantize(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    """Block by block, as the GGUF format describes: Q8_0 w = d*q; Q4_0 w = d*(q-8);
    Q4_1 w = d*q + m; 32 values a block, low nibbles first."""
    if qtype in (Q.F32, Q.F16):
        return np.asarray(raw, dtype=np.float32).reshape(shape)
    if qtype == Q.BF16:
        return (np.asarray(raw).view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    data = np.asarray(raw, dtype=np.uint8).reshape(-1)
    nibbles = data.astype(np.int32)
    out = []
    pos = 0
    while pos < data.size:
        d = float(data[pos : pos + 2].view(np.float16)[0])
        if qtype == Q.Q8_0:
            out.extend(d * float(q) for q in data[pos + 2 : pos + 34].view(np.int8))
            pos += 34
            continue
        if qtype == Q.Q4_1:
            m = float(data[pos + 2 : pos + 4].view(np.float16)[0])
            qs, pos = nibbles[pos + 4 : pos + 20], pos + 20
            lo, hi = [d * (b & 15) + m for b in qs], [d * (b >> 4) + m for b in qs]
        else:  # Q4_0
            qs, pos = nibbles[pos + 2 : pos + 18], pos + 18
            lo, hi = [d * ((b & 15) - 8) for b in qs], [d * ((b >> 4) - 8) for b in qs]
        out.extend(lo + hi)
    return np.array(out, dtype=np.float32).reshape(shape)


def random_blocks(kind: str, n: int, k: int, seed: int, scale: float = 0.02) -> np.ndarray:
    """Random bytes for every block of an [n, k] tensor of GGUF type `kind`, with the fp16 fields set
    to sane scales (random bytes there would be NaNs and infinities, which no real file holds): the
    scales in [scale / 20, scale * 1.05), a Q4_1 / Q5_1 minimum in (-5 scale, 0]."""
    from cpuserve.quant.gguf_blocks import SCHEMES

    s = SCHEMES[kind]
    rng = np.random.default_rng(seed)
    blocks = n * k // s.block_weights
    raw = rng.integers(0, 256, size=(blocks, s.block_bytes), dtype=np.uint8)
    fp16_fields = {"Q6_K": [208]}.get(kind, [0, 2] if kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else [0])
    for at in fp16_fields:
        values = (rng.random(blocks) * scale + scale / 20).astype(np.float16)
        if kind in ("Q4_1", "Q5_1") and at == 2:
            values = (-rng.random(blocks) * 5 * scale).astype(np.float16)  # the minimum: a negative fp16
        raw[:, at : at + 2] = values.view(np.uint8).reshape(blocks, 2)
    return raw
