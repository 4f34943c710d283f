"""GGUF's quantized types on the native kernels: decoded exactly (against gguf-py's dequantizer),
run by every variant this CPU has (against the integer reference and the dequantized matmul), and
read from a real file (the bundled SmolLM2's Q4_1) without going through bf16."""

from __future__ import annotations

import itertools
import operator

import gguf
import numpy as np
import pytest
import torch

from cpuserve.errors import CheckpointError
from cpuserve.kernels import native, runnable_variants
from cpuserve.quant.gguf_blocks import SCHEMES, decode
from cpuserve.quant.linear import Linear
from cpuserve.quant.methods import IntWeightMethod, KernelChoice
from cpuserve.quant.reference import reference_forward
from cpuserve.quant.scale_codes import activation_block
from tests.gguf_fixtures import random_blocks

TYPES = sorted(SCHEMES)
# Kernel vs the integer reference of the same scheme: the float order of the group sums only.
REL_BUDGET = 2e-6
# Kernel vs x @ dequantized(W).T in float64: int8 per-token activation rounding, relative to the
# output's RMS: the outlier channel (x 20) sets each token's int8 step (measured up to 4.6% here).
ACT_BUDGET = 0.08
# (N, K): odd N, K whole super-blocks; N = 48 (whole panels): Q6_K and the Q5 types as int6 panels
SHAPES = [(7, 256), (40, 512), (130, 768), (48, 512)]


@pytest.mark.parametrize("kind", TYPES)
def test_decoded_blocks_equal_gguf_py_dequantize(kind):
    n, k = 9, 512
    raw = random_blocks(kind, n, k, seed=len(kind))
    d = decode(kind, raw, n, k, "test")
    want = gguf.quants.dequantize(raw.reshape(n, -1), gguf.GGMLQuantizationType[kind])
    got = d.dequantized()
    assert got.shape == want.shape == (n, k)
    # Offsets are fp16 sums folded in float32: one rounding of each term.
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    lo, hi = {4: (-8, 7), 8: (-128, 127)}[d.scheme.bits]
    assert d.values.min() >= lo and d.values.max() <= hi and d.values.dtype == np.int8


@pytest.mark.parametrize("kind", TYPES)
def test_decoding_in_slices_of_blocks_is_decoding_whole(kind, monkeypatch):
    """A table decoded a few blocks at a time (bounded temporaries) is the same as decoded at once,
    with slices that end inside a row."""
    from cpuserve.quant import gguf_blocks

    n, k = 9, 768
    raw = random_blocks(kind, n, k, seed=7)
    whole = decode(kind, raw, n, k, "test")
    monkeypatch.setattr(gguf_blocks, "DECODE_CHUNK_WEIGHTS", 5 * SCHEMES[kind].block_weights)
    sliced = decode(kind, raw, n, k, "test")
    assert np.array_equal(sliced.values, whole.values) and np.array_equal(sliced.scales, whole.scales)
    assert (sliced.offsets is None) == (whole.offsets is None)
    if whole.offsets is not None:
        assert np.array_equal(sliced.offsets, whole.offsets)


def test_a_wrong_byte_count_names_the_tensor():
    raw = random_blocks("Q4_0", 4, 64, seed=1)[:-1]
    with pytest.raises(CheckpointError, match=r"blk\.0\.attn_q\.weight.*bytes of Q4_0 data"):
        decode("Q4_0", raw, 4, 64, "x.gguf: tensor 'blk.0.attn_q.weight'")


class _Tensors:
    """A checkpoint of one linear's decoded tensors (the loader's protocol)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def get(self, name):
        return self.tensors[name]

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def file_of(self, name):
        return "test.gguf"


def _checkpoint_parts(method: IntWeightMethod, d, n: int, k: int) -> dict[str, torch.Tensor]:
    """The tensors method asks a checkpoint for (GGUFCheckpoint's: codes as the file codes them)."""
    arrays = {"weight": d.values, "weight_scale": d.scales, "weight_offset": d.offsets}
    tensors = {}
    for name in method.checkpoint_tensors("l", n, k):
        part = name.removeprefix("l.")
        array = arrays[part] if part in arrays else d.codes.part(part)
        tensors[part] = torch.from_numpy(array.copy())
    return tensors


def _linear(kind: str, n: int, k: int, seed: int, kernel: KernelChoice | None):
    from cpuserve.model.gguf_source import linear_scheme

    d = decode(kind, random_blocks(kind, n, k, seed), n, k, "test")
    method = IntWeightMethod(linear_scheme(kind), torch.float32)
    with torch.device("meta"):
        layer = Linear(k, [n], False, method)
    method.load_shard(layer, 0, "l", _Tensors({f"l.{p}": t for p, t in _checkpoint_parts(method, d, n, k).items()}))
    method.process_weights_after_loading(layer, kernel)
    return layer, d


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("kind", TYPES)
def test_every_variant_runs_every_type(kind, n, k):
    kernels = native()
    assert kernels is not None, "native kernels are not built: ./run setup builds them"
    reference_layer, d = _linear(kind, n, k, seed=n + k, kernel=None)
    dequantized = torch.from_numpy(d.dequantized()).double()
    gen = torch.Generator().manual_seed(3)
    for m in (1, 3, 9, 16, 17, 70):  # 9-16: decode batches in 4-panel runs (panel_runs.h kStreamRows)
        x = torch.randn(m, k, generator=gen) * 2
        x[:, 5] *= 20  # an outlier channel, as real activations have
        ref = reference_layer(x)
        exact = (x.double() @ dequantized.T).float()
        rms = exact.pow(2).mean().sqrt().item()
        assert (ref - exact).pow(2).mean().sqrt().item() <= ACT_BUDGET * rms, (kind, m)
        for name in runnable_variants():
            variant = kernels.variant(name)
            layer, _ = _linear(kind, n, k, seed=n + k, kernel=KernelChoice(kernels, variant))
            int6 = SCHEMES[kind].int6 and variant.int6 and n % 16 == 0
            assert (layer.packed_layout == "int6_panel") == int6, (kind, name)
            if int6:  # 6 bits a weight
                assert layer.packed.dtype == torch.uint8 and layer.packed.numel() == n * k * 3 // 4
            got = layer(x)
            assert (got - ref).abs().max().item() <= REL_BUDGET * ref.abs().max().item() + 1e-5, (kind, name, m)
            if reference_layer.offsets is not None:  # one copy in memory: the driver's, read back exactly
                assert layer.offsets is None and layer.kernel_offsets.numel() == reference_layer.offsets.numel()
                assert torch.equal(layer.weight_offsets(), reference_layer.offsets), (kind, name)
            # one copy of the scales in memory, the kernel's: read back exactly in the checkpoint's order
            assert layer.scales is None and torch.equal(layer.weight_scales(), reference_layer.scales), (kind, name)
            native_twin = reference_forward(
                x,
                layer.int_weight(),
                layer.weight_scales(),
                None,
                layer.weight_offsets(),
                True,
                activation_block(layer.method.coding, SCHEMES[kind].group),
            )
            assert torch.equal(native_twin, ref)
            if variant.twin != variant:  # the SIMD kernel is bit-identical to its layout's scalar twin
                twin_layer, _ = _linear(kind, n, k, seed=n + k, kernel=KernelChoice(kernels, variant.twin))
                assert torch.equal(got, twin_layer(x)), (kind, name, m)


@pytest.mark.parametrize("kind", TYPES)
def test_coded_scales_give_what_fp32_scales_give_bit_for_bit(kind):
    """Scales and offsets held as the file codes them (a byte a code instead of 4), expanded by the
    driver a few panels at a time on each thread: every variant's output is bit-identical to the
    same weight with the expanded fp32 scales and offsets, for decode (1 row) and prefill blocks.
    K = 2048 and N = 600 (38 panels, a narrow last one) on one thread and on two: chunks of 16 or 8
    panels, so each thread's range runs as several chunks. The K-quants (activations per super-block,
    folded in int32 by the panel kernels, read in place at any M) have no fp32 twin of that kind:
    each variant's output is instead bit-identical to its layout's scalar twin's, on any thread count."""
    from cpuserve.quant import offsets_layout
    from cpuserve.quant.methods import native_int_linear

    kernels = native()
    n, k = 600, 2048
    x_all = torch.randn(200, k, generator=torch.Generator().manual_seed(2))
    for name in runnable_variants():
        kernel = KernelChoice(kernels, kernels.variant(name))
        layer, _ = _linear(kind, n, k, seed=5, kernel=kernel)
        coding = layer.method.coding
        assert layer.kernel_scales.dtype == coding.code_dtype
        assert layer.kernel_scales.numel() == n * k // SCHEMES[kind].group
        weight, _ = layer.method.kernel_operands(layer)
        scales = kernels.pack_scales(layer.weight_scales(), kernel.variant)
        offsets = layer.weight_offsets()
        offsets = None if offsets is None else offsets_layout.to_chunks(offsets)
        assert scales.dtype == torch.float32 and (offsets is None or offsets.dtype == torch.float32)
        folded = activation_block(coding, SCHEMES[kind].group) > 1
        if folded:
            twin, _ = _linear(kind, n, k, seed=5, kernel=KernelChoice(kernels, kernel.variant.twin))
        threads = torch.get_num_threads()
        for m, t in ((1, 1), (1, threads), (5, threads), (16, threads), (200, 1), (200, threads)):
            x = x_all[:m]
            torch.set_num_threads(t)
            try:
                if folded:
                    want = twin(x)
                else:
                    want = native_int_linear(kernel, layer.method.quant.bits, x, weight, scales, None, offsets, True, n)
                assert torch.equal(layer(x), want), (kind, name, m, t)
            finally:
                torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def bundled_gguf_dir(tmp_path_factory):
    from cpuserve.model.resolve import resolve_model

    return resolve_model(None, str(tmp_path_factory.mktemp("cache")))


def test_the_bundled_gguf_is_read_as_it_is(bundled_gguf_dir):
    from cpuserve.model.resolve import bundled_gguf
    from cpuserve.model.source import ModelSource
    from cpuserve.offline.gguf_convert import unpermute_rope

    src = ModelSource.open(bundled_gguf_dir)
    schemes = {g.weight.name for g in src.quant_config.groups}
    # every linear of the Q4_1 file, and the output head from its tied Q8_0 embedding, exactly
    assert schemes == {"W4A8-G32+offsets (A8 per group)", "W8A8-G32 (A8 per group)"}, schemes
    assert src.checkpoint.stored_dtype("model.layers.0.self_attn.q_proj.weight") == "I8"
    reader = gguf.GGUFReader(str(bundled_gguf()))
    t = next(t for t in reader.tensors if t.name == "blk.3.attn_q.weight")
    want = unpermute_rope(gguf.quants.dequantize(t.data, t.tensor_type), src.spec.num_heads)
    with src.checkpoint as ckpt:
        q = ckpt.get("model.layers.3.self_attn.q_proj.weight").float()
        # Q4_1: scale d and minimum m as the file's fp16, w = d (q - 8) + (8 d + m)
        d = ckpt.get("model.layers.3.self_attn.q_proj.weight_scale_code")
        m = ckpt.get("model.layers.3.self_attn.q_proj.weight_offset_code")
    assert d.dtype == m.dtype == torch.float16
    d, m = d.float(), m.float()
    got = (q.view(q.shape[0], -1, 32) * d[..., None] + (8 * d + m)[..., None]).view(q.shape)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-6 * np.abs(want).max())


@pytest.mark.slow
def test_the_bundled_gguf_serves_on_the_kernels_close_to_its_float_weights(bundled_gguf_dir, smol_dir):
    """Same weights (the GGUF's, exact) through the kernels and through the float path: they differ
    only by the int8 activations (per group of 32, as llama.cpp's)."""
    from cpuserve.model.loader import load_model

    ours = load_model(bundled_gguf_dir, dtype="float32")
    ref = load_model(smol_dir, dtype="float32")  # the same file converted: bf16 weights
    assert all(m.variant != "reference" for m in ours.modules() if isinstance(m, Linear) and m.quant)
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 2, 28, 253, 1789, 30, 216]])
    with torch.inference_mode():
        a, b = torch.log_softmax(ours(ids).float(), -1), torch.log_softmax(ref(ids).float(), -1)
    kl = (b.exp() * (b - a)).sum(-1).mean().item()
    # measured 0.008 with activations per group of 32 (0.157 with one int8 scale per token: SmolLM2's
    # outlier channels)
    assert kl < 0.03, kl


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_embedding_gives_the_float_tables_rows_exactly(kind, dtype):
    """The table kept as in the file: each looked-up row bit-identical to the dequantized table's row in
    the compute dtype (what the float table held), with fp32 scales or with the file's codes; int4
    types two values a byte, the Q5 types and Q6_K 6 bits a value, the codes a byte or two a group."""
    from cpuserve.model.quantized_embedding import QuantizedEmbedding

    n, k = 70, 512
    d = decode(kind, random_blocks(kind, n, k, seed=11), n, k, "t")
    table = torch.from_numpy(d.dequantized()).to(dtype)
    ids = torch.tensor([[0, 69, 5, 5], [33, 1, 68, 0]])
    bits = SCHEMES[kind].bits if not SCHEMES[kind].int6 else 6
    for embedding in (
        QuantizedEmbedding(d.values, d.scales, d.offsets, dtype),
        QuantizedEmbedding(d.values, None, None, dtype, d.codes, SCHEMES[kind].coding),
    ):
        got = embedding(ids)
        assert got.dtype == dtype and got.shape == (2, 4, k)
        assert torch.equal(got, table[ids])
        assert embedding(torch.tensor([], dtype=torch.long)).shape == (0, k)  # as nn.Embedding: no ids, no rows
        held = sum(t.numel() * t.element_size() for t in embedding.buffers())
        values = n * k * bits // 8
        groups = n * k // SCHEMES[kind].group
        if embedding.coding is None:  # fp32 scales (and offsets)
            assert held == values + groups * 4 * (2 if d.offsets is not None else 1)
        else:  # a code a group (and an offset code), fp16 factors per super-block
            assert held == values + sum(a.nbytes for a in vars(d.codes).values() if a is not None)
            assert held < values + groups * 2 * (2 if d.offsets is not None else 1) + 1


@pytest.mark.parametrize("kind", TYPES)
def test_a_tied_embedding_read_from_its_heads_packed_weights_is_the_tables_rows(kind):
    """A tied GGUF table kept once, as the output head's packed weights: every variant's layout
    (panels with a narrow last panel, rows, int4 and int8, offsets in column chunks) and the
    unpacked reference give each looked-up row bit-identical to the float table's, in fp32 and bf16."""
    from cpuserve.model.quantized_embedding import HeadRowsEmbedding

    kernels = native()
    # 70: four full panels and one of 6 columns; chunks of 16 and a tail of 6. 64: whole panels (int6)
    kernel_choices = [None] + [KernelChoice(kernels, kernels.variant(name)) for name in runnable_variants()]
    for kernel, n in itertools.product(kernel_choices, (70, 64)):
        k = 512
        ids = torch.tensor([[0, 69, 5, 5], [33, 1, 68, 64]] if n == 70 else [[0, 63, 5, 5], [33, 9, 62, 16]])
        layer, d = _linear(kind, n, k, seed=12, kernel=kernel)
        table = torch.from_numpy(d.dequantized())
        for dtype in (torch.float32, torch.bfloat16):
            got = HeadRowsEmbedding(layer, dtype)(ids)
            assert got.dtype == dtype and got.shape == (2, 4, k)
            assert torch.equal(got, table.to(dtype)[ids]), (kind, kernel and kernel.variant)
        assert HeadRowsEmbedding(layer, torch.float32)(torch.tensor([], dtype=torch.long)).shape == (0, k)


@pytest.mark.parametrize("kind", TYPES)
def test_a_head_packed_slice_by_slice_is_the_head_packed_whole(kind):
    """load_packed (the GGUF head decoded and packed a few rows at a time) leaves exactly the copies
    load_shard + process_weights_after_loading leave, on every variant: slices of 32 rows over 70
    (a last panel of 6 columns, a last offsets chunk cut short); a bad slice is refused, named."""
    from cpuserve.model.gguf_source import linear_scheme
    from cpuserve.quant.gguf_blocks import DecodedWeight

    kernels = native()
    k = 512
    for name, n in itertools.product(runnable_variants(), (70, 64)):  # 64: whole panels (int6)
        kernel = KernelChoice(kernels, kernels.variant(name))
        whole, d = _linear(kind, n, k, seed=13, kernel=kernel)
        method = IntWeightMethod(linear_scheme(kind), torch.float32)
        with torch.device("meta"):
            sliced = Linear(k, [n], False, method)

        def part(r0, r1, d=d):
            return r0, DecodedWeight(
                d.values[r0:r1],
                d.scales[r0:r1],
                None if d.offsets is None else d.offsets[r0:r1],
                d.scheme,
                d.codes.rows(operator.itemgetter(slice(r0, r1))),
            )

        ckpt = _Tensors({f"lm_head.{p}": t for p, t in _checkpoint_parts(method, d, n, k).items()})
        slices = (part(r, min(n, r + 32)) for r in range(0, n, 32))
        assert method.load_packed(sliced, "lm_head", ckpt, slices, kernel)
        attrs = ("packed", "qweight", "kernel_scales", "scales", "kernel_offsets", "offsets")
        for attr in (*attrs, "kernel_scale_super", "kernel_offset_super"):
            a, b = getattr(whole, attr), getattr(sliced, attr)
            assert (a is None and b is None) or torch.equal(a, b), (kind, name, attr)
        assert sliced.packed_layout == whole.packed_layout and sliced.kernel is kernel
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
        assert torch.equal(sliced(x), whole(x))
        with torch.device("meta"):
            bad = Linear(k, [n], False, method)
        with pytest.raises(CheckpointError, match=r"tensor 'lm_head\.weight': rows 8\.\.40"):
            method.load_packed(bad, "lm_head", ckpt, iter([part(8, 40)]), kernel)
        with pytest.raises(CheckpointError, match=rf"tensor 'lm_head\.weight' ends at row 32, expected {n}"):
            method.load_packed(bad, "lm_head", ckpt, iter([part(0, 32)]), kernel)
        short = _Tensors({**ckpt.tensors, "lm_head.weight": torch.zeros(n - 16, k)})
        with pytest.raises(
            CheckpointError, match=rf"tensor 'lm_head\.weight' has shape \[{n - 16}, 512\], expected \[{n}, 512\]"
        ):
            method.load_packed(bad, "lm_head", short, iter([]), kernel)
