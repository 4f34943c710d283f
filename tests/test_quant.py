"""Quantized checkpoints: bit layouts, the integer reference forward, our quantizer on the real
SmolLM2, checkpoints written by llmcompressor, and broken checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cpuserve.errors import CheckpointError, ConfigError
from cpuserve.model.loader import load_model
from cpuserve.offline.quantize import quantize_checkpoint, quantize_weight, quantize_weight_in_chunks
from cpuserve.quant.config import WeightQuant
from cpuserve.quant.linear import Linear
from cpuserve.quant.packing import pack_int, unpack_int
from cpuserve.quant.reference import reference_forward

FIXTURES = Path(__file__).parent / "fixtures" / "llmcompressor"


def test_pack_layout_follows_the_convention():
    # int4: value + 8, element i of a row at bits 4i..4i+3 of its word, word j holds k = 8j..8j+7.
    row = torch.tensor([[-8, -7, 0, 7, 1, 2, 3, 4, 5]], dtype=torch.int8)
    packed = pack_int(row, 4)
    assert packed.shape == (1, 2) and packed.dtype == torch.int32
    nibbles = [v + 8 for v in row[0].tolist()]
    word0 = sum(n << (4 * i) for i, n in enumerate(nibbles[:8]))
    assert packed[0, 0].item() == (word0 - 2**32 if word0 >= 2**31 else word0)
    assert packed[0, 1].item() == nibbles[8]
    for bits in (4, 8):
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        q = torch.randint(lo, hi + 1, (7, 131), dtype=torch.int8)
        assert torch.equal(unpack_int(pack_int(q, bits), bits, 131), q)


def slow_forward(x, q, scales, bias):
    """The contract in float64: per-token int8 activations (amax/127), dequantized weights."""
    xd = x.double()
    sa = xd.abs().amax(-1, keepdim=True) / 127
    qa = torch.clamp(torch.round(xd / sa), -127, 127)
    n, k = q.shape
    g = k // scales.shape[1]
    w = (q.double().view(n, -1, g) * scales.double().unsqueeze(-1)).view(n, k)
    y = (qa * sa) @ w.T
    return y + bias.double() if bias is not None else y


@pytest.mark.parametrize(
    "bits,group,k",
    [(4, 32, 576), (4, 64, 576), (4, 128, 1536), (4, None, 576), (8, None, 576), (8, None, 1536), (8, None, 6144)],
)
def test_reference_forward_is_the_integer_contract(bits, group, k):
    gen = torch.Generator().manual_seed(bits * 1000 + k)
    n = 48
    w = torch.randn(n, k, generator=gen) * 0.05
    q, scale = quantize_weight(w, WeightQuant(bits, group, False))
    x = torch.randn(5, k, generator=gen) * 3
    bias = torch.randn(n, generator=gen)
    got = reference_forward(x, q, scale.float(), bias)
    want = slow_forward(x, q, scale.float(), bias)
    assert (got.double() - want).abs().max().item() < 1e-4 * want.abs().max().item()


def test_quantizer_is_round_to_nearest_with_the_compressed_tensors_scale():
    w = torch.tensor([[0.3, -0.9375, 0.1, 0.0]], dtype=torch.bfloat16)
    q, scale = quantize_weight(w, WeightQuant(4, None, False), "minmax")
    assert scale.dtype == torch.bfloat16 and scale.item() == 0.9375 / 7.5  # amax / ((2^4 - 1) / 2), exact here
    expected = torch.clamp(torch.round(w.float() / scale.float()), -8, 7).to(torch.int8)
    assert torch.equal(q, expected) and q[0, 1].item() == -8


def test_mse_scales_never_reconstruct_worse_than_minmax():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=gen) * 0.02
    w[0, 5] = 0.3  # an outlier with a positive sign: minmax wastes half a step on it
    for quant in (WeightQuant(4, 32, False), WeightQuant(4, 128, False), WeightQuant(8, None, False)):
        errs = {}
        for method in ("minmax", "mse"):
            q, s = quantize_weight(w, quant, method)
            g = quant.group_size or 256
            recon = (q.float().view(64, -1, g) * s.float().unsqueeze(-1)).view(64, 256)
            errs[method] = ((recon - w) ** 2).view(64, -1, g).sum(-1)
        assert (errs["mse"] <= errs["minmax"] + 1e-12).all(), quant
        assert errs["mse"].sum() < errs["minmax"].sum(), quant


@pytest.mark.parametrize("quant", [WeightQuant(8, None, False), WeightQuant(4, 32, False)], ids=lambda q: q.name)
def test_quantizing_in_row_blocks_changes_nothing(quant):
    w = torch.randn(101, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    q, s = quantize_weight(w, quant)
    q7, s7 = quantize_weight_in_chunks(w, quant, rows=7)
    assert torch.equal(q, q7) and torch.equal(s, s7)


@pytest.fixture(scope="module")
def quantized(smol_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    return {
        "w4a8": quantize_checkpoint(smol_dir, root / "w4a8", "w4a8", 64, progress=False),
        "w4a8-packed": quantize_checkpoint(smol_dir, root / "w4a8p", "w4a8", 64, pack=True, progress=False),
        "w8a8": quantize_checkpoint(smol_dir, root / "w8a8", "w8a8", progress=False),
        "w8a8-packed": quantize_checkpoint(smol_dir, root / "w8a8p", "w8a8", pack=True, progress=False),
    }


def test_round_trip_each_layer_against_its_reference(smol_dir, quantized):
    base = load_model(smol_dir, "float32", fuse=False, pack_float=False)  # its weights read below
    linears = {n: m for n, m in base.named_modules() if isinstance(m, Linear) and n != "lm_head"}
    x = torch.randn(6, 1536, generator=torch.Generator().manual_seed(0))
    budgets = {
        "w4a8": 0.25,
        "w4a8-packed": 0.25,
        "w8a8": 0.03,
        "w8a8-packed": 0.03,
    }  # relative error vs the unquantized layer
    loaded = {kind: load_model(path, "float32", fuse=False) for kind, path in quantized.items()}
    for name, ref_linear in linears.items():
        xi = x[:, : ref_linear.in_features]
        exact = ref_linear(xi)
        for kind, model in loaded.items():
            q = model.get_submodule(name)
            assert isinstance(q, Linear) and q.quant is not None, (kind, name)
            bits, group = (4, 64) if kind.startswith("w4a8") else (8, None)
            want_q, want_scale = quantize_weight(ref_linear.weight.to(torch.bfloat16), WeightQuant(bits, group, False))
            assert torch.equal(q.int_weight(), want_q) and torch.equal(q.weight_scales(), want_scale.float()), (
                kind,
                name,
            )
            out = q(xi)
            assert torch.allclose(out, reference_forward(xi, want_q, want_scale.float(), None), atol=1e-5, rtol=1e-5)
            rel = ((out - exact).norm() / exact.norm()).item()
            assert rel < budgets[kind], (kind, name, rel)
    assert loaded["w8a8"].lm_head.quant is None  # lm_head is ignored by default


def test_quantized_models_stay_close_to_bf16_and_spellings_agree(quantized, smol_dir):
    """Teacher-forced on 400 tokens of the Apache license: next-token agreement with the unquantized
    model and KL(unquantized || quantized) per token. Measured: W8A8 0.90 / 0.045, W4A8-G64 0.62 / 0.57
    (perplexity in docs/benchmarks.md says what that costs)."""
    from cpuserve.tokenizer import Tokenizer

    text = Path("/usr/share/common-licenses/Apache-2.0").read_text()[:3000]
    ids = torch.tensor([Tokenizer(smol_dir).encode(text)[:400]])
    base = load_model(smol_dir, "float32")(ids)[0]
    logits = {kind: load_model(path, "float32")(ids)[0] for kind, path in quantized.items()}
    assert torch.equal(logits["w4a8"], logits["w4a8-packed"])  # the two spellings are one model
    assert torch.equal(logits["w8a8"], logits["w8a8-packed"])
    for kind, (min_agree, max_kl) in {"w8a8": (0.85, 0.1), "w4a8": (0.5, 1.0)}.items():
        agree = (logits[kind].argmax(-1) == base.argmax(-1)).float().mean().item()
        kl = torch.nn.functional.kl_div(
            torch.log_softmax(logits[kind], -1), torch.log_softmax(base, -1), log_target=True, reduction="batchmean"
        ).item()
        assert agree >= min_agree and kl <= max_kl, (kind, agree, kl)


def test_both_w4a8_spellings_hold_the_same_bytes_natively(quantized):
    """int-quantized stores a byte per int4 value, pack-quantized half a byte: on disk they differ,
    in the native kernels (nibbles) they do not; the benchmarks' GB/s counts the latter."""
    from cpuserve.model.footprint import model_facts

    plain, packed = (model_facts(quantized[k], "float32")[2] for k in ("w4a8", "w4a8-packed"))
    assert plain["weights_bytes"] > packed["weights_bytes"]
    assert plain["weights_bytes_native"] == packed["weights_bytes_native"] == packed["weights_bytes"]
    assert plain["parameters"] == packed["parameters"]


def test_written_config_is_what_compressed_tensors_writes(quantized):
    ours = json.loads((quantized["w4a8-packed"] / "config.json").read_text())["quantization_config"]
    theirs = json.loads((FIXTURES / "w4a8" / "config.json").read_text())["quantization_config"]
    assert ours["format"] == "pack-quantized" and theirs["format"] == "int-quantized"
    for key in ("quant_method", "ignore", "kv_cache_scheme", "quantization_status"):
        assert ours[key] == theirs[key], key
    o, t = ours["config_groups"]["group_0"], theirs["config_groups"]["group_0"]
    assert o["targets"] == t["targets"]
    for side in ("weights", "input_activations"):
        for key in ("num_bits", "type", "symmetric", "strategy", "dynamic", "actorder"):
            assert o[side][key] == t[side][key], (side, key)
    assert o["weights"]["group_size"] == 64 and t["weights"]["group_size"] == 128


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
def test_llmcompressor_checkpoints_load_and_match_its_fake_quantized_model(scheme):
    """llmcompressor's logits come from its own bf16 fake-quantized forward (activation scale
    amax/127.5, bf16 arithmetic); ours are exact integer math in fp32, hence the budget."""
    expected = load_file(str(FIXTURES / f"{scheme}-expected.safetensors"))
    model = load_model(FIXTURES / scheme, "float32", fuse=False)
    quantized = [m for m in model.modules() if isinstance(m, Linear) and m.quant is not None]
    assert len(quantized) == 14  # 7 per layer, lm_head ignored
    got = model(expected["input_ids"])
    ref = expected["logits"]
    assert (got - ref).abs().max().item() < 0.08 * ref.abs().max().item()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9


# ---- bad checkpoints ---------------------------------------------------------------------------


def _copy(src: Path, tmp_path: Path) -> Path:
    out = tmp_path / src.name
    shutil.copytree(src, out)
    return out


def _edit_tensor(d: Path, name: str, value: torch.Tensor | None) -> None:
    sd = load_file(str(d / "model.safetensors"))
    if value is None:
        del sd[name]
    else:
        sd[name] = value
    save_file(sd, str(d / "model.safetensors"))


def _edit_quant(d: Path, change) -> None:  # type: ignore[no-untyped-def]
    cfg = json.loads((d / "config.json").read_text())
    change(cfg["quantization_config"])
    (d / "config.json").write_text(json.dumps(cfg))


def test_scales_that_do_not_match_the_weights(tmp_path):
    d = _copy(FIXTURES / "w4a8", tmp_path)
    _edit_tensor(d, "model.layers.1.mlp.up_proj.weight_scale", torch.ones(512, 4, dtype=torch.bfloat16))
    with pytest.raises(
        CheckpointError,
        match=r"'model\.layers\.1\.mlp\.up_proj\.weight_scale' has shape \[512, 4\], "
        r"expected \[512, 2\]",
    ):
        load_model(d)


def test_wrong_weight_shape_in_a_packed_checkpoint(quantized, tmp_path):
    d = _copy(quantized["w4a8-packed"], tmp_path)
    _edit_tensor(d, "model.layers.0.self_attn.k_proj.weight_shape", torch.tensor([192, 512]))
    with pytest.raises(
        CheckpointError,
        match=r"'model\.layers\.0\.self_attn\.k_proj\.weight_shape' says "
        r"\[192, 512\], expected \[192, 576\]",
    ):
        load_model(d)


def test_missing_tensor_and_a_config_claiming_tensors_it_does_not_have(quantized, tmp_path):
    d = _copy(quantized["w8a8"], tmp_path)
    _edit_tensor(d, "model.layers.3.mlp.down_proj.weight_scale", None)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.3\.mlp\.down_proj\.weight_scale' is missing"):
        load_model(d)
    d2 = _copy(FIXTURES / "w4a8", tmp_path / "claims")
    _edit_quant(
        d2,
        lambda qc: qc.update(
            format="pack-quantized",
            config_groups={k: {**v, "format": "pack-quantized"} for k, v in qc["config_groups"].items()},
        ),
    )
    with pytest.raises(CheckpointError, match=r"weight_packed' is missing .* pack-quantized"):
        load_model(d2)


def test_int4_values_out_of_range(tmp_path):
    d = _copy(FIXTURES / "w4a8", tmp_path)
    _edit_tensor(d, "model.layers.0.mlp.gate_proj.weight", torch.full((512, 256), 9, dtype=torch.int8))
    with pytest.raises(
        CheckpointError,
        match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' holds values outside "
        r"\[-8, 7\]",
    ):
        load_model(d)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda w, a: w.update(symmetric=False), "asymmetric weights"),
        (lambda w, a: w.update(actorder="group"), "actorder 'group'"),
        (lambda w, a: w.update(num_bits=3), "3-bit weights are not supported"),
        (lambda w, a: w.update(group_size=256), "group_size 256 is not supported"),
        (lambda w, a: a.update(dynamic=False), "input activations int8 token static are not supported"),
        (lambda w, a: a.update(strategy="tensor"), "input activations int8 tensor dynamic"),
        (lambda w, a: a.update(strategy="group", group_size=64), "input activations int8 group 64 dynamic"),
    ],
)
def test_unsupported_schemes_are_refused_naming_scheme_and_group(tmp_path, change, message):
    d = _copy(FIXTURES / "w4a8", tmp_path)

    def edit(qc):  # type: ignore[no-untyped-def]
        group = qc["config_groups"]["group_0"]
        change(group["weights"], group["input_activations"])

    _edit_quant(d, edit)
    with pytest.raises(ConfigError, match=f"group_0: .*{message}"):
        load_model(d)


def test_activations_per_group_of_the_weights_load_as_such(tmp_path):
    """input_activations strategy "group" with the weights' group size: one int8 scale per token and
    group (as GGUF's schemes run), through the kernels exactly as the integer reference computes it."""
    d = _copy(FIXTURES / "w4a8", tmp_path)
    _edit_quant(
        d, lambda qc: qc["config_groups"]["group_0"]["input_activations"].update(strategy="group", group_size=128)
    )
    per_group, per_token = load_model(d, "float32", fuse=False), load_model(FIXTURES / "w4a8", "float32", fuse=False)
    layer = per_group.model.layers[0].mlp.gate_proj
    assert layer.quant.act_groups and layer.quant.name.endswith("(A8 per group)")
    assert not per_token.model.layers[0].mlp.gate_proj.quant.act_groups
    x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(0))
    x[:, 3] *= 30  # an outlier channel: per group, the other groups keep their resolution
    want = reference_forward(x, layer.int_weight(), layer.weight_scales(), None, None, True)
    assert (layer(x) - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert not torch.allclose(layer(x), per_token.model.layers[0].mlp.gate_proj(x))
    expected = load_file(str(FIXTURES / "w4a8-expected.safetensors"))
    ref = expected["logits"]
    assert (per_group(expected["input_ids"]) - ref).abs().max().item() < 0.08 * ref.abs().max().item()


def test_quantize_writes_activations_per_group_when_asked(smol_dir, tmp_path):
    out = quantize_checkpoint(smol_dir, tmp_path / "g", "w4a8", 64, calibration=None, act_groups=True, progress=False)
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert group["input_activations"]["strategy"] == "group" and group["input_activations"]["group_size"] == 64
    with pytest.raises(ConfigError, match="--activations group: needs weights in groups"):
        quantize_checkpoint(smol_dir, tmp_path / "c", "w8a8", calibration=None, act_groups=True, progress=False)


def test_quantize_refuses_a_group_size_that_does_not_divide(smol_dir, tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"model\.layers\.0\.self_attn\.q_proj: input size 576 is not a multiple "
        r"of --group-size 128",
    ):
        quantize_checkpoint(smol_dir, tmp_path / "out", "w4a8", 128, progress=False)
    assert not (tmp_path / "out").exists()
