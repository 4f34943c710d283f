"""qwen2 and qwen3 GGUFs (llama.cpp's layout: llama's tensor names, q/k/v biases for Qwen2, q/k
RMSNorm for Qwen3, rows as HF has them since llama.cpp runs both with rotate-half rope), written here
from tiny transformers models. transformers' own GGUF reader takes each file back to its model (so
the file is laid out as llama.cpp lays it out); served from the file and converted, it is that
model; its quantized tensors run on the kernels within the schemes' noise of the float model."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from cpuserve.model.loader import load_model
from cpuserve.model.resolve import resolve_model
from cpuserve.offline.gguf_convert import convert_gguf
from cpuserve.quant.linear import Linear
from tests.gguf_fixtures import add_tiny_tokenizer, hf_decoder_writer, random_blocks, store_tensor, tiny_vocab

transformers = pytest.importorskip("transformers")

Q = gguf.GGMLQuantizationType
FLOAT_BUDGET = 1e-4  # fp32 on models 64 wide: rounding only
THETA = 1_000_000.0  # Qwen's rope base

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # qwen2
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    # qwen3
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}


def _reference(arch: str, vocab: int, head_dim: int | None = None) -> torch.nn.Module:
    shape = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,  # a whole K-quant super-block for ffn_down's rows
        vocab_size=vocab,
        max_position_embeddings=256,
        rope_theta=THETA,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=head_dim or 128, **shape))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = "norm" in name
            p.copy_(
                (1.0 if norm else 0.0) + (0.2 if norm or "bias" in name else 0.08) * torch.randn(p.shape, generator=gen)
            )
    return model.eval()


def _write(model: torch.nn.Module, arch: str, path: Path, types: dict[str, Q]) -> None:
    """As llama.cpp's converter writes the model; `types`: GGUF type by layer tensor name (F32 else).
    gguf-py cannot quantize to the K-quants: a tensor of a K-quant type holds random blocks instead
    (of the same shape; its test compares with the same file dequantized)."""

    def store(name: str, w: np.ndarray, qtype: Q = Q.F32) -> None:
        if qtype.name in ("Q4_K", "Q5_K", "Q6_K"):
            writer.add_tensor(name, random_blocks(qtype.name, *w.shape, seed=len(name), scale=0.002), raw_dtype=qtype)
        else:
            store_tensor(writer, name, w, qtype)

    cfg = model.config
    writer = hf_decoder_writer(path, arch, cfg)
    writer.add_rope_freq_base(THETA)
    writer.add_layer_norm_rms_eps(1e-6)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    add_tiny_tokenizer(writer)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    store("token_embd.weight", state["model.embed_tokens.weight"])
    store("output_norm.weight", state["model.norm.weight"])
    store("output.weight", state["lm_head.weight"], types.get("output.weight", Q.F32))
    for n in range(cfg.num_hidden_layers):
        for hf, name in _LAYER.items():
            if f"model.layers.{n}.{hf}" in state:
                store(f"blk.{n}.{name}", state[f"model.layers.{n}.{hf}"], types.get(name, Q.F32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize(("arch", "head_dim"), [("qwen2", None), ("qwen3", 128)])
def test_a_float_qwen_gguf_read_by_transformers_served_and_converted_is_the_model(arch, head_dim, tmp_path):
    """Qwen3 with its own head size, 128, not hidden / heads (16 here; 1024 / 16 = 64 in Qwen3-0.6B):
    transformers' GGUF reader assumes 128 for every qwen3 file, where llama.cpp reads key_length."""
    vocab = len(tiny_vocab()[0])
    ref = _reference(arch, vocab, head_dim)
    path = tmp_path / f"{arch}.gguf"
    _write(ref, arch, path, {})
    served = load_model(resolve_model(str(path), str(tmp_path / "cache")), dtype="float32")
    assert served.spec.architecture == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    assert served.spec.qkv_bias == (arch == "qwen2") and served.spec.qk_norm == (arch == "qwen3")
    converted = load_model(convert_gguf(path, tmp_path / "hf", progress=False, dtype="float32"), dtype="float32")
    ids = _ids(vocab)
    with torch.inference_mode():
        expected = ref(ids).logits
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path), gguf_file=path.name, dtype=torch.float32
        )
        got = {
            "transformers' GGUF reader": theirs.eval()(ids).logits,
            "served": served(ids),
            "converted": converted(ids),
        }
        for what, logits in got.items():
            err = (logits - expected).abs().max().item()
            assert err < FLOAT_BUDGET, f"{what}: max |logit diff| {err:.2e}"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_quantized_qwen_tensors_run_on_the_kernels(arch, tmp_path):
    vocab = len(tiny_vocab()[0])
    ref = _reference(arch, vocab)
    path = tmp_path / f"{arch}-q.gguf"
    types = {
        "attn_q.weight": Q.Q8_0,
        "attn_k.weight": Q.Q8_0,
        "attn_v.weight": Q.Q8_0,
        "attn_output.weight": Q.Q4_0,
        "ffn_gate.weight": Q.Q4_1,
        "ffn_up.weight": Q.Q4_1,
        "ffn_down.weight": Q.Q6_K if arch == "qwen3" else Q.Q4_K,  # K-quants: inputs of 256 (hidden is 64)
        "output.weight": Q.Q8_0,
    }
    _write(ref, arch, path, types)
    served = load_model(resolve_model(str(path), str(tmp_path / "cache")), dtype="float32")
    schemes = {name: m.quant.name for name, m in served.named_modules() if isinstance(m, Linear) and m.quant}
    assert schemes["model.layers.0.self_attn.qkv_proj"].startswith("W8A8-G32")  # q/k/v fused again at build
    assert schemes["model.layers.1.mlp.gate_up_proj"].startswith("W4A8-G32+offsets")
    assert served.model.layers[0].self_attn.qkv_proj.bias is not None or arch == "qwen3"
    dequantized = load_model(convert_gguf(path, tmp_path / "float", progress=False, dtype="float32"), dtype="float32")
    ids = _ids(vocab)
    with torch.inference_mode():
        p = torch.log_softmax(dequantized(ids).double(), -1)
        q = torch.log_softmax(served(ids).double(), -1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    assert kl < 1e-3, kl  # the same weights; the kernels' activations int8 per 32
