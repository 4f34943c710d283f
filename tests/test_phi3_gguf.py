"""A phi3 GGUF (llama.cpp's layout: fused `attn_qkv`, `ffn_up` holding gate then up, longrope
factors as tensors) written here from a tiny transformers Phi-3: served as it is and converted, it
is that model (float), and its quantized fused tensors run on the kernels split into their parts."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from cpuserve.model.loader import load_model
from cpuserve.model.resolve import resolve_model
from cpuserve.offline.gguf_convert import convert_gguf
from cpuserve.quant.linear import Linear
from tests.gguf_fixtures import add_tiny_tokenizer, hf_decoder_writer, store_tensor, tiny_vocab

transformers = pytest.importorskip("transformers")

Q = gguf.GGMLQuantizationType
ORIGINAL, WINDOW = 16, 8
SHORT = [1.0, 1.1, 1.3, 1.7, 2.2, 3.0, 4.1, 5.5]
LONG = [1.0, 1.9, 3.6, 6.8, 12.5, 21.0, 33.0, 47.0]


def _reference(vocab: int) -> torch.nn.Module:
    cfg = transformers.Phi3Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=vocab,
        max_position_embeddings=256,
        original_max_position_embeddings=ORIGINAL,
        rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
        sliding_window=WINDOW,
        rms_norm_eps=1e-5,
        pad_token_id=None,
        eos_token_id=2,
        bos_token_id=1,
    )
    model = transformers.Phi3ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(
                (1.0 if "norm" in name else 0.0)
                + (0.2 if "norm" in name else 0.08) * torch.randn(p.shape, generator=gen)
            )
    return model


_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _write_phi3_gguf(model: torch.nn.Module, path: Path, types: dict[str, Q]) -> None:
    """As llama.cpp's converter writes a Phi-3 (rows as HF has them); `types`: GGUF type by layer
    tensor name (F32 where not given)."""
    cfg = model.config
    writer = hf_decoder_writer(path, "phi3", cfg)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_scaling_orig_ctx_len(ORIGINAL)
    scale = cfg.max_position_embeddings / ORIGINAL
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(ORIGINAL)))
    writer.add_sliding_window(WINDOW)
    add_tiny_tokenizer(writer)

    def store(name: str, w: np.ndarray, qtype: Q = Q.F32) -> None:
        store_tensor(writer, name, w, qtype)

    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    store("token_embd.weight", state["model.embed_tokens.weight"])
    store("output_norm.weight", state["model.norm.weight"])
    store("output.weight", state["lm_head.weight"], types.get("output.weight", Q.F32))
    store("rope_factors_long.weight", np.array(LONG, dtype=np.float32))
    store("rope_factors_short.weight", np.array(SHORT, dtype=np.float32))
    for n in range(cfg.num_hidden_layers):
        for hf, name in _LAYER.items():
            store(f"blk.{n}.{name}", state[f"model.layers.{n}.{hf}"], types.get(name, Q.F32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _ids(vocab: int, length: int) -> torch.Tensor:
    return torch.randint(3, vocab, (2, length), generator=torch.Generator().manual_seed(2))


def test_a_float_phi3_gguf_served_and_converted_is_the_transformers_model(tmp_path):
    vocab = len(tiny_vocab()[0])
    ref = _reference(vocab)
    path = tmp_path / "phi3.gguf"
    _write_phi3_gguf(ref, path, {})
    served = load_model(resolve_model(str(path), str(tmp_path / "cache")), dtype="float32")
    spec = served.spec
    assert spec.architecture == "Phi3ForCausalLM" and spec.layer_window(1) == WINDOW
    assert spec.rope.type == "longrope" and spec.rope.long_factor == tuple(LONG)
    assert spec.rope.original_max_position_embeddings == ORIGINAL
    converted = transformers.AutoModelForCausalLM.from_pretrained(
        convert_gguf(path, tmp_path / "hf", progress=False, dtype="float32"), dtype=torch.float32
    ).eval()
    ids = _ids(vocab, ORIGINAL)  # longer: transformers' one pass switches every position to the long factors
    with torch.inference_mode():
        expected = ref(ids).logits
        for got in (served(ids), converted(ids).logits):
            err = (got - expected).abs().max().item()
            assert err < 1e-4, f"max |logit diff| {err:.2e}"


def test_quantized_fused_phi3_tensors_run_on_the_kernels_split_into_their_parts(tmp_path):
    vocab = len(tiny_vocab()[0])
    ref = _reference(vocab)
    path = tmp_path / "phi3-q.gguf"
    types = {"attn_qkv.weight": Q.Q8_0, "ffn_up.weight": Q.Q4_1, "ffn_down.weight": Q.Q4_0, "output.weight": Q.Q8_0}
    _write_phi3_gguf(ref, path, types)
    served = load_model(resolve_model(str(path), str(tmp_path / "cache")), dtype="float32")
    layer = served.model.layers[0]
    assert layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None  # fused again at build
    schemes = {name: m.quant.name for name, m in served.named_modules() if isinstance(m, Linear) and m.quant}
    assert schemes["model.layers.0.self_attn.qkv_proj"] == "W8A8-G32 (A8 per group)"
    assert schemes["model.layers.1.mlp.gate_up_proj"] == "W4A8-G32+offsets (A8 per group)"
    converted = load_model(convert_gguf(path, tmp_path / "float", progress=False), dtype="float32")
    ids = _ids(vocab, 24)
    with torch.inference_mode():
        p = torch.log_softmax(converted(ids).double(), -1)
        q = torch.log_softmax(served(ids).double(), -1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    # The conversion rounds to bf16 and the kernels' activations to int8 per 32.
    assert kl < 1e-3, kl
