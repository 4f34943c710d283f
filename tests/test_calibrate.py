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


def _correlated_problem(seed: int, k: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """w [64, k] and inputs x [2048, k] with correlated channels of very different sizes (as a
    layer's inputs are: a few channels carry most of the energy)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(64, k, generator=gen, dtype=torch.float64)
    mix = torch.randn(64, k, generator=gen, dtype=torch.float64)
    x = torch.randn(2048, 64, generator=gen, dtype=torch.float64) @ mix
    x += 0.1 * torch.randn(2048, k, generator=gen, dtype=torch.float64)
    x *= torch.rand(k, generator=gen, dtype=torch.float64) ** 3 * 4 + 0.05
    return w, x


@pytest.mark.parametrize("quant", QUANTS[:2], ids=lambda q: q.name)
def test_act_order_keeps_groups_contiguous_under_a_group_permutation(quant):
    """Act-order visits columns by the Hessian's diagonal, but groups stay the format's contiguous
    columns: reordering whole groups of the problem (and the columns inside each) reorders the
    answer in the same way, bit for bit: bookkeeping that mixed up a column's group and its
    position in the visiting order would not commute so."""
    w, x = _correlated_problem(3, k=512)
    k, g = w.shape[1], quant.group_size
    groups = torch.randperm(k // g, generator=torch.Generator().manual_seed(4))
    assert not torch.equal(groups, torch.arange(k // g))  # whole groups really move
    inner = torch.randperm(g, generator=torch.Generator().manual_seed(5))
    perm = (groups.unsqueeze(1) * g + inner.unsqueeze(0)).reshape(-1)
    h = x.T @ x
    q, scale = gptq_quantize(w, h, quant, quantize_weight, CalibrationOptions())
    q_p, scale_p = gptq_quantize(w[:, perm], h[perm][:, perm], quant, quantize_weight, CalibrationOptions())
    assert torch.equal(q_p, q[:, perm]) and torch.equal(scale_p, scale[:, groups])
    # and it is not left to right: the visiting order changed the answer
    q_ltr, _ = gptq_quantize(w, h, quant, quantize_weight, CalibrationOptions(act_order=False))
    assert not torch.equal(q_ltr, q)


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.name)
def test_act_order_does_not_depend_on_the_block_size(quant):
    """Lazy block updates are an order of computation, not of results: a group's scale chosen with
    the block's pending updates folded in equals the one chosen with every update applied (one block
    for all columns). A scale chosen on stale weights, or on the wrong copy of the block, differs."""
    w, x = _correlated_problem(7)
    h = x.T @ x
    q_small, s_small = gptq_quantize(w, h, quant, quantize_weight, CalibrationOptions(block=32))
    q_one, s_one = gptq_quantize(w, h, quant, quantize_weight, CalibrationOptions(block=w.shape[1]))
    assert torch.equal(q_small, q_one) and torch.equal(s_small, s_one)


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.name)
def test_act_order_lowers_the_output_error_on_uneven_channels(quant):
    w, x = _correlated_problem(6)
    h = x.T @ x

    def error(opts: CalibrationOptions) -> float:
        return float((x @ (w - dequant(*gptq_quantize(w, h, quant, quantize_weight, opts), quant)).T).norm())

    ordered, ltr = error(CalibrationOptions()), error(CalibrationOptions(act_order=False))
    assert ordered < 0.95 * ltr, (ordered, ltr)


def test_smoothing_keeps_the_function_and_flattens_the_activations(smol_dir):
    model = load_model(smol_dir, "float32", fuse=False, pack_float=False)  # smoothing edits its weights
    text = (LICENSES / "Apache-2.0").read_text()[:2000]
    ids = torch.tensor([Tokenizer(smol_dir).encode(text)[:256]])
    before = model(ids)[0]
    layer = model.model.layers[0]
    cos, sin = model.rope_tables(torch.arange(ids.shape[1]))[0]  # float32 model: float32 tables
    h = model.model.embed_tokens(ids)
    backend = ContiguousAttention(None, 0)
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
    """Calibrated with no text at all, on the model's own samples (the default of `cpuserve
    quantize`), judged on the GPL-3: KL(float || quantized) per token. A user's texts differ only in
    where the windows come from (next test); their end-to-end gain is measured in docs/benchmarks.md."""
    common = {"progress": False}
    rtn = quantize_checkpoint(smol_dir, tmp_path / "rtn", "w8a8", **common)
    own = quantize_checkpoint(
        smol_dir,
        tmp_path / "self",
        "w8a8",
        calibration="self",
        calibration_tokens=512,
        calibration_window=128,
        **common,
    )
    ids = torch.tensor([Tokenizer(smol_dir).encode((LICENSES / "GPL-3").read_text()[:4000])[:400]])
    base = torch.log_softmax(load_model(smol_dir, "float32")(ids)[0], -1)

    def kl(path: Path) -> float:
        logp = torch.log_softmax(load_model(path, "float32")(ids)[0], -1)
        return torch.nn.functional.kl_div(logp, base, log_target=True, reduction="batchmean").item()

    k_rtn, k_self = kl(rtn), kl(own)
    print(f"KL per token on the GPL-3: RTN {k_rtn:.4f}, self-calibrated {k_self:.4f}")
    assert k_self < 0.7 * k_rtn, (k_rtn, k_self)


def test_user_texts_give_windows_of_their_own_tokens(smol_dir, tmp_path):
    from cpuserve.errors import ConfigError
    from cpuserve.offline.quantize import calibration_windows

    tok = Tokenizer(smol_dir)
    texts = [LICENSES / "Apache-2.0", LICENSES / "MPL-2.0"]
    ids = [i for t in texts for i in tok.encode(t.read_text(errors="replace"), add_special_tokens=False)]
    windows = calibration_windows(tok, texts, 1000, 256)
    assert windows.shape == (3, 256) and windows.flatten().tolist() == ids[:768]
    with pytest.raises(ConfigError, match="no such file"):
        calibration_windows(tok, [tmp_path / "missing.txt"], 1000, 256)


def test_self_calibration_text_is_the_models_own_and_seeded(smol_dir):
    """Windows of the requested shape, the same for a seed, another for another seed; plain and chat
    starts in turn (SmolLM2 has a chat template)."""
    from cpuserve.offline.self_calibration import self_calibration_windows

    first = self_calibration_windows(smol_dir, 96, 32, seed=1, progress=False)
    assert first.shape == (3, 32)
    assert torch.equal(first, self_calibration_windows(smol_dir, 96, 32, seed=1, progress=False))
    assert not torch.equal(first, self_calibration_windows(smol_dir, 96, 32, seed=2, progress=False))
    text = Tokenizer(smol_dir).decode(first.flatten().tolist(), skip_special_tokens=False)
    assert text.startswith("The"), text[:80]  # SmolLM2's tokenizer adds no BOS
    assert "<|im_start|>user\nTell me a story.<|im_end|>" in text, text[:400]
