"""Native kernels: every variant this CPU runs against the scalar twin of its own layout (bit-identical,
W4A8 included), against the generic row twin and against the scheme's pure-torch reference. The
integer sums are exact everywhere; W8A8 shares its float epilogue (so all variants are bit-identical),
W4A8's panel layout sums groups in its own float order (within REL_BUDGET of the row twin)."""

from __future__ import annotations

import pytest
import torch

from cpuserve.kernels import native, runnable_variants
from cpuserve.offline.quantize import quantize_weight
from cpuserve.quant.config import WeightQuant
from cpuserve.quant.linear import Linear
from cpuserve.quant.packing import unpack_int8, unpack_nibbles
from cpuserve.quant.reference import reference_forward

REL_BUDGET = 2e-6  # vs the reference: float epilogue order only (the integer sums are exact)
MS = [1, 2, 3, 4, 5, 7, 8, 11, 16, 17, 64, 65, 100, 130, 200]  # 200: past a pass of 192 rows (panels)
SHAPES = [(1, 128), (7, 576), (96, 1536), (130, 4096)]  # (N, K)


@pytest.fixture(scope="module")
def kernels():
    module = native()
    assert module is not None, "native kernels are not built: ./run setup builds them"
    return module


def _runnable(kernels):
    """The variants this CPU runs, as the table rows the kernels take (each equal to its name)."""
    return [kernels.variant(name) for name in runnable_variants()]


def test_this_machine_runs_at_least_one_simd_variant(kernels):
    variants = runnable_variants()
    assert variants[0] == "generic" and len(variants) >= 2, variants  # every x86-64 here has AVX2
    print("variants run here:", variants)


def _weights(bits, group, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    q, s = quantize_weight(w, WeightQuant(bits, group, False))
    return q, s.float()


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("group", [32, 64, 128, None])
def test_w4a8_variants_equal_the_twin_and_the_reference(kernels, n, k, group):
    if group and k % group:
        pytest.skip("group does not divide K")
    q, s = _weights(4, group, n, k, n + k)
    packed = {}  # each variant's own int4 layout (x86: all offset nibbles; Arm NEON: two's complement)
    for variant in _runnable(kernels):
        packed[variant] = kernels.pack_int4(q, variant)
        assert torch.equal(unpack_nibbles(packed[variant], k, kernels.int4_layout(variant)), q)
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(n, generator=gen)
    for m in MS:
        x = torch.randn(m, k, generator=gen) * 2
        twin = kernels.w4a8_linear(x, packed["generic"], s, bias, kernels.variant("generic"))
        ref = reference_forward(x, q, s, bias)
        assert (twin - ref).abs().max().item() <= REL_BUDGET * ref.abs().max().item() + 1e-6, (m, n, k, group)
        for variant in _runnable(kernels)[1:]:
            scales = kernels.pack_scales(s, variant)
            got = kernels.w4a8_linear(x, packed[variant], scales, bias, variant)
            own = kernels.w4a8_linear(x, packed[variant], scales, bias, variant.twin)  # same bytes, scalar
            assert torch.equal(got, own), (variant, variant.twin, m, n)
            assert (got - twin).abs().max().item() <= REL_BUDGET * twin.abs().max().item() + 1e-6, (variant, m, n)


# K not a multiple of 64 (masked tails) or of 4 (the panel layout pads whole quads)
@pytest.mark.parametrize("n,k", [*SHAPES, (9, 96), (33, 2080), (17, 70)])
def test_w8a8_variants_equal_the_twin_and_the_reference(kernels, n, k):
    q, s = _weights(8, None, n, k, n * k)
    q[0, :4] = torch.tensor([-128, 127, -127, 0], dtype=torch.int8)  # the extremes of both layouts
    weights = {}  # each variant's own layout (AVX-512 VNNI: uint8 w + 128 panels; AVX2: int8 panels; rows)
    for variant in _runnable(kernels):
        weights[variant] = kernels.pack_int8(q, variant)
        assert torch.equal(unpack_int8(weights[variant], k, kernels.int8_layout(variant)), q), variant
    gen = torch.Generator().manual_seed(2)
    for m in MS:
        x = torch.randn(m, k, generator=gen) * 2
        twin = kernels.w8a8_linear(x, weights["generic"], s.view(-1), None, kernels.variant("generic"))
        ref = reference_forward(x, q, s, None)
        assert (twin - ref).abs().max().item() <= REL_BUDGET * ref.abs().max().item() + 1e-6, (m, n, k)
        for variant in _runnable(kernels)[1:]:
            got = kernels.w8a8_linear(x, weights[variant], s.view(-1), None, variant)
            assert torch.equal(got, twin), (variant, m, n, k)  # exact integer sums, the same epilogue
            own = kernels.w8a8_linear(x, weights[variant], s.view(-1), None, variant.twin)
            assert torch.equal(own, twin), (variant.twin, m, n, k)


def test_w8a8_refuses_a_weight_in_another_variants_layout(kernels):
    _, s = _weights(8, None, 8, 128, 3)
    for variant in _runnable(kernels):
        signed = kernels.int8_layout(variant) in ("signed", "signed_panel")
        other = torch.empty(8, 128, dtype=torch.uint8 if signed else torch.int8)
        with pytest.raises(RuntimeError, match="as pack_int8 gives it"):
            kernels.w8a8_linear(torch.randn(2, 128), other, s.view(-1), None, variant)


def test_bf16_activations_in_and_out(kernels):
    q, s = _weights(4, 64, 64, 576, 5)
    x = torch.randn(3, 576).to(torch.bfloat16)
    variant = _runnable(kernels)[-1]
    out = kernels.w4a8_linear(x, kernels.pack_int4(q, variant), kernels.pack_scales(s, variant), None, variant)
    assert out.dtype == torch.bfloat16
    ref = reference_forward(x.float(), q, s, None)
    assert torch.allclose(out.float(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("scheme,group", [("w8a8", None), ("w4a8", 64)])
def test_model_greedy_tokens_native_equal_reference(smol_dir, tmp_path, monkeypatch, scheme, group):
    """32 greedy tokens of the bundled model: native linear kernels against the pure-torch reference
    scheme, the float ops around them in torch for both (the native float ops reorder sums, which the
    dynamic activation quantization amplifies: tests/test_layer_ops.py bounds that separately)."""
    monkeypatch.setenv("CPUSERVE_NATIVE_OPS", "0")
    from cpuserve.generate import SimpleSampling, generate_ids
    from cpuserve.kernels import selected_variant
    from cpuserve.model.loader import load_model
    from cpuserve.offline.quantize import quantize_checkpoint
    from cpuserve.tokenizer import Tokenizer

    path = quantize_checkpoint(smol_dir, tmp_path / scheme, scheme, group, progress=False)
    ids = Tokenizer(smol_dir).encode("The history of the printing press begins")
    outputs = {}
    for isa in ("reference", runnable_variants()[-1]):
        monkeypatch.setenv("CPUSERVE_ISA", isa)
        selected_variant.cache_clear()
        model = load_model(path, "float32")
        kinds = {str(m.variant) for m in model.modules() if isinstance(m, Linear) and m.quant is not None}
        assert kinds == {isa}, kinds
        outputs[isa] = list(generate_ids(model, ids, SimpleSampling(max_tokens=32)))
    selected_variant.cache_clear()
    assert outputs["reference"] == outputs[runnable_variants()[-1]]


def test_pack_quantized_words_go_straight_to_the_kernel_layout(kernels):
    from cpuserve.quant.packing import pack_int

    q = torch.randint(-8, 8, (37, 576), dtype=torch.int8, generator=torch.Generator().manual_seed(4))
    for variant in _runnable(kernels):
        nibbles = kernels.words_to_nibbles(pack_int(q, 4), 576, variant)
        layout = kernels.int4_layout(variant)
        assert torch.equal(nibbles, kernels.pack_int4(q, variant))
        assert torch.equal(unpack_nibbles(nibbles, 576, layout), q)


def test_unpack_reads_both_int4_layouts():
    """The two's-complement layout (Arm) is checked here on x86 too, from bytes built by hand."""
    q = torch.randint(-8, 8, (5, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(5))
    blocks = q.view(5, 2, 32).to(torch.int16)
    offset = ((blocks[..., :16] + 8) | ((blocks[..., 16:] + 8) << 4)).to(torch.uint8).view(5, 32)
    twos = ((blocks[..., :16] & 0xF) | ((blocks[..., 16:] & 0xF) << 4)).to(torch.uint8).view(5, 32)
    assert torch.equal(unpack_nibbles(offset, 64, "offset"), q)
    assert torch.equal(unpack_nibbles(twos, 64, "twos_complement"), q)


def test_unpack_reads_the_panel_layouts():
    """Panel bytes built by hand, value by value, from the layout's definition (kernels/csrc/panel_layout.h)."""
    gen = torch.Generator().manual_seed(6)
    n, k = 21, 64  # a full panel of 16 columns and a last one of 5
    q4 = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen)
    q8 = torch.randint(-128, 128, (n, k - 2), dtype=torch.int8, generator=gen)  # K 62: padded to 64
    b4, b8 = torch.zeros(n * k // 2, dtype=torch.uint8), torch.zeros(n * k, dtype=torch.uint8)
    signed = torch.zeros(n * k, dtype=torch.int8)  # w itself, padding 0
    for c in range(n):
        c0, w = c // 16 * 16, min(16, n - c // 16 * 16)
        for j in range(k // 8):
            for i in range(4):
                lo, hi = int(q4[c, 8 * j + i]) + 8, int(q4[c, 8 * j + 4 + i]) + 8
                b4[c0 * k // 2 + j * 4 * w + (c - c0) * 4 + i] = lo | (hi << 4)
        for j in range(k // 4):
            for i in range(4):
                value = int(q8[c, 4 * j + i]) if 4 * j + i < k - 2 else None
                b8[c0 * k + j * 4 * w + (c - c0) * 4 + i] = 0 if value is None else value + 128
                signed[c0 * k + j * 4 * w + (c - c0) * 4 + i] = 0 if value is None else value
    assert torch.equal(unpack_nibbles(b4.view(n, k // 2), k, "offset_panel"), q4)
    assert torch.equal(unpack_int8(b8.view(n, k), k - 2, "offset_panel"), q8)
    assert torch.equal(unpack_int8(signed.view(n, k), k - 2, "signed_panel"), q8)
    kernels = native()
    for variant in _runnable(kernels):
        if kernels.int4_layout(variant) == "offset_panel":
            assert torch.equal(kernels.pack_int4(q4, variant).view(-1), b4), variant
        want8 = {"offset_panel": b8, "signed_panel": signed}.get(kernels.int8_layout(variant))
        if want8 is not None:
            assert torch.equal(kernels.pack_int8(q8, variant).view(-1), want8), variant


def test_one_openmp_runtime_in_the_process(kernels):
    """The kernels link libgomp.so.1, the soname torch already loaded: no second OpenMP pool."""
    torch.ones(1000, 1000).sum()  # torch's pool is up
    q, s = _weights(8, None, 64, 256, 9)
    variant = _runnable(kernels)[-1]
    kernels.w8a8_linear(torch.randn(4, 256), kernels.pack_int8(q, variant), s.view(-1), None, variant)
    with open("/proc/self/maps") as maps:
        gomp = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomp) == 1, gomp


def test_the_kernel_and_the_platform_layer_choose_the_same_variant(kernels, monkeypatch):
    """Two views of one CPU: the kernel's own (cpuid / HWCAP) and the platform layer's (/proc/cpuinfo)."""
    from cpuserve.kernels import selected_variant

    monkeypatch.delenv("CPUSERVE_ISA", raising=False)
    monkeypatch.delenv("CPUSERVE_KERNEL_VARIANT", raising=False)
    selected_variant.cache_clear()
    try:
        assert kernels.best_variant() == selected_variant()
    finally:
        selected_variant.cache_clear()


def test_the_kernel_and_the_platform_layer_agree_on_every_variant(kernels):
    """Variant by variant: the kernel's detector says it runs here exactly when the platform does."""
    platform = set(runnable_variants())
    for name in kernels.variants():
        assert kernels.variant(name).runs_here == (name in platform), name


def test_a_variant_is_one_table_row_equal_to_its_name(kernels):
    v = kernels.variant("generic")
    assert v is kernels.variant("generic") and v == "generic" and str(v) == "generic" and v != "avx2"
    assert {v} == {"generic"} and v.twin == v and v != None  # noqa: E711
    with pytest.raises(RuntimeError, match="no variant 'sve2_i8mm'"):
        kernels.variant("sve2_i8mm")


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_float_linear_equals_a_double_matmul_within_the_rounding_bound(kernels, wdtype, xdtype):
    """Unquantized linears on float panels (weights widened in registers, fp32 sums), every variant
    run here, M across the register blocks (6 / 8 rows) and the 48-row blocks, N off the 16-column
    panels: within (K + 2) fp32 unit roundoffs of sum |x w| of a float64 matmul of the same values
    (the worst case of any summation order), plus the bias add's and the output's rounding."""
    gen = torch.Generator().manual_seed(7)
    for n, k in [(1, 3), (37, 576), (130, 1536)]:
        w = (torch.randn(n, k, generator=gen) * 0.05).to(wdtype)
        bias = torch.randn(n, generator=gen).to(xdtype)
        packed = kernels.pack_float(w)
        assert packed.dtype == wdtype and tuple(packed.shape) == ((n + 15) // 16, k, 16)
        for m in [1, 2, 5, 6, 7, 13, 49, 100]:
            x = torch.randn(m, k, generator=gen).to(xdtype)
            exact = x.double() @ w.double().T + bias.double()
            sums = x.double().abs() @ w.double().abs().T
            budget = (k + 2) * 2.0**-24 * sums + 2.0**-23 * (exact.abs() + sums)  # + the bias add's rounding
            if xdtype != torch.float32:
                budget = budget + exact.abs() * 2.0**-8  # the result rounded to bf16
            for variant in _runnable(kernels):
                out = kernels.float_linear(x, packed, n, bias, variant)
                assert out.dtype == xdtype and out.shape == (m, n)
                err = (out.double() - exact).abs()
                assert (err <= budget).all(), (variant, n, k, m, (err - budget).max().item())


def test_float_linear_refuses_a_weight_packed_for_another_shape(kernels):
    packed = kernels.pack_float(torch.randn(40, 64))
    variant = _runnable(kernels)[-1]
    with pytest.raises(RuntimeError, match="as pack_float gives it"):
        kernels.float_linear(torch.randn(2, 64), packed, 50, None, variant)
    with pytest.raises(RuntimeError, match="as pack_float gives it"):
        kernels.float_linear(torch.randn(2, 65), packed, 40, None, variant)


def test_a_float_checkpoint_loaded_in_float32_keeps_its_bf16_bytes(smol_dir):
    """--dtype auto on a CPU without native bf16 computes in fp32; the bf16 checkpoint's linears are
    packed as bf16 (every value exact), and the logits equal torch's fp32 forward within fp32 rounding."""
    from cpuserve.model.loader import load_model

    native_model = load_model(smol_dir, "float32")
    torch_model = load_model(smol_dir, "float32", pack_float=False)
    layer = native_model.model.layers[0].mlp.gate_up_proj
    assert layer.packed.dtype == torch.bfloat16 and layer.weight.is_meta
    assert torch_model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float32
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 216, 1345, 30]])
    a = native_model(ids, native_model.new_cache(1, 16))[0]
    b = torch_model(ids, torch_model.new_cache(1, 16))[0]
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert (a - b).abs().max() < 2e-3 * b.abs().max(), (a - b).abs().max()
