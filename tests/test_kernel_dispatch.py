"""The chosen variant reaches every native op: with CPUSERVE_ISA=X, the kernels' per-variant dispatch
counters (one relaxed atomic increment per op call) show only X's table row, for the linears, the
activation quantizer, the float ops, decode and prefill attention and a whole native decode step. A variant this
CPU lacks is skipped with its name, never run on another path."""

from __future__ import annotations

import pytest
import torch

from cpuserve.kernels import native, runnable_variants, selected_variant
from cpuserve.model import native_decode, ops
from cpuserve.quant.config import WeightQuant
from cpuserve.quant.rtn import quantize_weight

X86 = ["avx512_vnni", "avx_vnni", "avx2", "generic"]
ARM = ["neon_i8mm", "neon_dotprod", "neon", "generic"]
FLOAT_OPS = {"rms_norm", "add_rms_norm", "rope", "silu_mul", "decode_attention", "prefill_attention"}
LINEAR_OPS = {"w8a8_linear", "w4a8_linear", "quantize_rows", "float_linear"}


@pytest.fixture
def kernels():
    module = native()
    assert module is not None, "native kernels are not built: ./run setup builds them"
    return module


@pytest.fixture
def isa(request, kernels, monkeypatch):
    """Selects the parametrized variant through CPUSERVE_ISA, as a start-up would; counters zeroed."""
    name = request.param
    if name not in kernels.variants():
        pytest.skip(f"{name} is not compiled for this architecture")
    if name not in runnable_variants():
        pytest.skip(f"this CPU lacks {name}")
    monkeypatch.setenv("CPUSERVE_ISA", name)
    monkeypatch.delenv("CPUSERVE_NATIVE_OPS", raising=False)
    selected_variant.cache_clear()
    kernels.reset_dispatch_counts()
    yield name
    selected_variant.cache_clear()


def _run_every_op(kernels) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=gen)
    w = torch.rand(256, generator=gen) + 0.5
    ops.rms_norm(x, w, 1e-6)
    ops.add_rms_norm(x, x, 0.5, w, 1e-6)
    q, k = torch.randn(3, 4, 64, generator=gen), torch.randn(3, 2, 64, generator=gen)
    ops.rope(q, k, torch.randn(3, 64, generator=gen), torch.randn(3, 64, generator=gen))
    ops.silu_mul(x[:, :128], x[:, 128:])
    cache = torch.randn(2, 2, 40, 64, generator=gen)
    ops.decode_attention_contiguous(torch.randn(2, 4, 64, generator=gen), cache, cache)
    slots = torch.arange(40).view(2, 20)
    paged = torch.randn(40, 2, 64, generator=gen)
    ops.decode_attention_paged(torch.randn(2, 4, 64, generator=gen), paged, paged, slots, torch.tensor([20, 7]))
    ops.prefill_attention_contiguous(
        torch.randn(2, 5, 4, 64, generator=gen), cache[:, :, :9].transpose(1, 2), cache[:, :, :9].transpose(1, 2)
    )
    ops.prefill_attention_paged(torch.randn(6, 4, 64, generator=gen), paged, paged, slots[0, :9], window=4)
    variant = selected_variant()
    q8, s8 = quantize_weight(torch.randn(48, 256, generator=gen), WeightQuant(8, None, False))
    kernels.w8a8_linear(x, kernels.pack_int8(q8, variant), s8.float().view(-1), None, variant)
    q4, s4 = quantize_weight(torch.randn(48, 256, generator=gen), WeightQuant(4, 64, False))
    kernels.w4a8_linear(x, kernels.pack_int4(q4, variant), kernels.pack_scales(s4.float(), variant), None, variant)
    kernels.float_linear(x, kernels.pack_float(torch.randn(48, 256, generator=gen)), 48, None, variant)


@pytest.mark.parametrize("isa", X86 + ARM[:-1], indirect=True)
def test_every_op_runs_as_the_selected_variant(kernels, isa):
    _run_every_op(kernels)
    counts = kernels.dispatch_counts()
    assert set(counts) == {isa}, counts
    assert set(counts[isa]) == FLOAT_OPS | LINEAR_OPS, counts
    assert counts[isa]["decode_attention"] == 2 and counts[isa]["quantize_rows"] == 2
    assert counts[isa]["prefill_attention"] == 2


@pytest.fixture(scope="module")
def w4a8_model(smol_dir, tmp_path_factory):
    from cpuserve.offline.quantize import quantize_checkpoint

    return quantize_checkpoint(smol_dir, tmp_path_factory.mktemp("dispatch") / "w4a8", "w4a8", 64, progress=False)


@pytest.mark.parametrize("isa", X86 + ARM[:-1], indirect=True)
def test_a_native_decode_step_runs_as_the_selected_variant(kernels, isa, w4a8_model, monkeypatch):
    from cpuserve.model.loader import load_model

    monkeypatch.delenv("CPUSERVE_NATIVE_DECODE", raising=False)
    model = load_model(w4a8_model, "float32")
    assert model.native_decode_plan() is not None
    steps = [0]
    decode = native_decode.decode

    def counted(*args, **kwargs):
        steps[0] += 1
        return decode(*args, **kwargs)

    monkeypatch.setattr(native_decode, "decode", counted)
    cache = model.new_cache(1, 32)
    logits = model(torch.arange(100, 108).view(1, 8), cache)[:, -1]  # the prompt: Python layers
    kernels.reset_dispatch_counts()
    model(logits.argmax(-1, keepdim=True), cache)  # one decode step: decode_layers
    assert steps[0] == 1
    counts = kernels.dispatch_counts()
    assert set(counts) == {isa}, counts
    assert {"w4a8_linear", "quantize_rows", "decode_attention", "rms_norm", "add_rms_norm", "rope", "silu_mul"} <= set(
        counts[isa]
    ), counts


@pytest.mark.parametrize("isa", X86 + ARM[:-1], indirect=True)
def test_a_float_models_decode_step_runs_its_linears_as_the_selected_variant(kernels, isa, smol_dir, monkeypatch):
    """Unquantized (bf16 checkpoint, fp32 compute): every linear of the step and the head on float
    panels of the selected variant, stored as bf16 (exact: the checkpoint's values)."""
    from cpuserve.model.loader import load_model

    monkeypatch.delenv("CPUSERVE_NATIVE_DECODE", raising=False)
    model = load_model(smol_dir, "float32")
    assert model.lm_head.packed.dtype == torch.bfloat16 and model.lm_head.weight.is_meta
    cache = model.new_cache(1, 32)
    logits = model(torch.arange(100, 108).view(1, 8), cache)[:, -1]
    kernels.reset_dispatch_counts()
    model(logits.argmax(-1, keepdim=True), cache)
    counts = kernels.dispatch_counts()
    assert set(counts) == {isa}, counts
    layers = model.spec.num_layers
    assert counts[isa]["float_linear"] == 4 * layers + 1, counts  # qkv, o, gate_up, down per layer; the head
