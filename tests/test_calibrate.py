"""Calibrated quantization (SmoothQuant folding + GPTQ): the algebra, then the real SmolLM2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cpuserve.model.decoder import ContiguousAttention
from cpuserve.model.loader import load_model
from cpuserve.offline.calibrate import CalibrationOptions, _record_inputs, _smooth, gptq_quantize
from cpuserve.offline.quantize import quantize_checkpoint, quantize_weight
from cpuserve.quant.config import WeightQuant
from cpuserve.tokenizer import Tokenizer

LICENSES = Path("/usr/share/common-licenses")
QUANTS = [WeightQuant(4, 64, False), WeightQuant(4, 128, False), WeightQuant(8, None, False)]


def dequant(q: torch.Tensor, scale: torch.Tensor, quant: WeightQuant) -> torch.Tensor:
    n, k = q.shape
    g = quant.group_size or k
    return (q.double().view(n, -1, g) * scale.double().unsqueeze(-1)).view(n, k)


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.name)
def test_gptq_with_uncorrelated_inputs_is_round_to_nearest(quant):
    """With H = c*I the inverse Hessian has no off-diagonal terms: no error is fed forward, so GPTQ
    must give exactly the round-to-nearest values and scales."""
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(1))
    q, scale = gptq_quantize(w, torch.eye(256, dtype=torch.float64) * 3.0, quant, quantize_weight, CalibrationOptions())
    want_q, want_scale = quantize_weight(w, quant)
    assert torch.equal(q, want_q) and torch.equal(scale, want_scale)


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.name)
def test_gptq_lowers_the_output_error_on_correlated_inputs(quant):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(64, 256, generator=gen, dtype=torch.float64)
    x = torch.randn(2048, 64, generator=gen, dtype=torch.float64) @ torch.randn(
        64, 256, generator=gen, dtype=torch.float64
    )
    x += 0.1 * torch.randn(2048, 256, generator=gen, dtype=torch.float64)
    q, scale = gptq_quantize(w, x.T @ x, quant, quantize_weight, CalibrationOptions())
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16
    lo, hi = -(1 << (quant.bits - 1)), (1 << (quant.bits - 1)) - 1
    assert int(q.min()) >= lo and int(q.max()) <= hi
    rtn = quantize_weight(w.float(), quant)
    err_gptq = (x @ (w - dequant(q, scale, quant)).T).norm()
    err_rtn = (x @ (w - dequant(*rtn, quant)).T).norm()
    assert err_gptq < 0.8 * err_rtn, (err_gptq, err_rtn)


def test_smoothing_keeps_the_function_and_flattens_the_activations(smol_dir):
    model = load_model(smol_dir, "float32", fuse=False)
    text = (LICENSES / "Apache-2.0").read_text()[:2000]
    ids = torch.tensor([Tokenizer(smol_dir).encode(text)[:256]])
    before = model(ids)[0]
    layer = model.model.layers[0]
    cos, sin = model.rope_tables(torch.arange(ids.shape[1]))[0]  # float32 model: float32 tables
    h = model.model.embed_tokens(ids)
    backend = ContiguousAttention(None, 0, gqa=True)
    stats = _record_inputs(layer, lambda: layer(h, cos, sin, 0, backend))
    peak = stats["self_attn.q_proj"].absmax
    qkv = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
    s = _smooth(layer.input_layernorm.weight, qkv, peak, 0.5, False, torch.float32)
    _smooth(layer.mlp.up_proj.weight, [layer.mlp.down_proj], stats["mlp.down_proj"].absmax, 0.5, True, torch.float32)
    after = model(ids)[0]
    assert (after - before).abs().max() < 1e-3 * before.abs().max()
    smoothed = _record_inputs(layer, lambda: layer(h, cos, sin, 0, backend))["self_attn.q_proj"].absmax
    assert torch.allclose(smoothed, peak / s, rtol=1e-4)
    ratio = lambda v: (v.max() / v.median()).item()  # noqa: E731
    assert ratio(smoothed) < 0.5 * ratio(peak), (ratio(peak), ratio(smoothed))


def test_calibrated_w8a8_is_closer_to_the_float_model_than_rtn_on_unseen_text(smol_dir, tmp_path):
    """Calibrated on the Apache license, judged on the GPL-3: KL(float || quantized) per token."""
    common = {"progress": False}
    rtn = quantize_checkpoint(smol_dir, tmp_path / "rtn", "w8a8", **common)
    cal = quantize_checkpoint(
        smol_dir,
        tmp_path / "cal",
        "w8a8",
        calibration=[LICENSES / "Apache-2.0"],
        calibration_tokens=1024,
        calibration_window=256,
        **common,
    )
    ids = torch.tensor([Tokenizer(smol_dir).encode((LICENSES / "GPL-3").read_text()[:4000])[:400]])
    base = torch.log_softmax(load_model(smol_dir, "float32")(ids)[0], -1)

    def kl(path: Path) -> float:
        logp = torch.log_softmax(load_model(path, "float32")(ids)[0], -1)
        return torch.nn.functional.kl_div(logp, base, log_target=True, reduction="batchmean").item()

    k_rtn, k_cal = kl(rtn), kl(cal)
    assert k_cal < 0.7 * k_rtn, (k_rtn, k_cal)
