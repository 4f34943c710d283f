"""q/k/v and gate/up fused after loading compute what the separate projections computed."""

from __future__ import annotations

import pytest
import torch

from cpuserve.model.loader import load_model
from cpuserve.offline.quantize import quantize_checkpoint
from cpuserve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def ids(smol_dir):
    return torch.tensor([Tokenizer(smol_dir).encode("The quick brown fox jumps over the lazy dog. " * 8)])


def _fused_count(model) -> int:
    layers = model.model.layers
    return sum(layer.self_attn.qkv_proj is not None for layer in layers) + sum(
        layer.mlp.gate_up_proj is not None for layer in layers
    )


def test_fused_float_model_equals_unfused(smol_dir, ids):
    fused, plain = load_model(smol_dir, "float32"), load_model(smol_dir, "float32", fuse=False)
    assert _fused_count(fused) == 2 * len(fused.model.layers) and _fused_count(plain) == 0
    assert not hasattr(fused.model.layers[0].self_attn, "q_proj")
    a, b = fused(ids)[0], plain(ids)[0]
    assert (a - b).abs().max() <= 1e-4 * b.abs().max()  # matmul blocking may differ with N
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("scheme,group", [("w4a8", 64), ("w8a8", None)])
def test_fused_quantized_model_is_bit_identical(smol_dir, ids, tmp_path, scheme, group):
    """The native kernels' per-column arithmetic does not depend on N: fusing changes no bit."""
    path = quantize_checkpoint(smol_dir, tmp_path / scheme, scheme, group, progress=False)
    fused, plain = load_model(path, "float32"), load_model(path, "float32", fuse=False)
    assert _fused_count(fused) == 2 * len(fused.model.layers)
    assert fused.model.layers[0].mlp.gate_up_proj.kernel is not None  # still on the native kernels
    assert torch.equal(fused(ids), plain(ids))


def test_gguf_parts_of_one_int8_scheme_fuse_whether_or_not_their_values_fit_int6(tmp_path, monkeypatch):
    """Q5_0 (values within [-32, 31]: int6 panels where the kernel has them) and Q8_0 are the same
    int8 scheme: q/k in Q5_0 and v in Q8_0 fuse, held as int8; gate/up both in Q5_0 fuse and stay
    int6-able. The fused model computes what the unfused one does, bit for bit."""
    from cpuserve.model.resolve import resolve_model
    from tests import gguf_fixtures

    Q = gguf_fixtures.Q
    types = {**gguf_fixtures.LAYER_TYPES, "attn_q.weight": Q.Q5_0, "attn_k.weight": Q.Q5_0, "attn_v.weight": Q.Q8_0}
    types.update({"ffn_gate.weight": Q.Q5_0, "ffn_up.weight": Q.Q5_0})
    monkeypatch.setattr(gguf_fixtures, "LAYER_TYPES", types)
    gguf_fixtures.write_tiny_llama(tmp_path / "mixed.gguf")
    path = resolve_model(str(tmp_path / "mixed.gguf"), str(tmp_path / "cache"))
    fused, plain = load_model(path, "float32"), load_model(path, "float32", fuse=False)
    assert _fused_count(fused) == 2 * len(fused.model.layers)
    attn, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    assert not attn.qkv_proj.quant.int6 and mlp.gate_up_proj.quant.int6
    ids = torch.tensor([[3, 17, 99, 4, 250, 8, 8, 31]])
    assert torch.equal(fused(ids), plain(ids))
