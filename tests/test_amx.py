"""avx512_vnni's linears on AMX tiles (arch/x86/amx.cpp), where this CPU and its OS grant them: the same
outputs, bit for bit, as the VNNI blocks and the scalar twin of the layout, over row counts that fill
and cut the 32-row blocks, panel counts odd and even with a narrow last panel, every grouping the tiles
take, and activations scaled per token or per group; the cases the tiles leave to VNNI are left."""

from __future__ import annotations

import pytest
import torch

from cpuserve.kernels import native, runnable_variants
from cpuserve.offline.quantize import quantize_weight
from cpuserve.quant.config import WeightQuant
from cpuserve.quant.reference import reference_forward

REL_BUDGET = 2e-6  # against the pure-torch reference: float order only (the integer sums are exact)


@pytest.fixture(scope="module")
def tiles():
    module = native()
    if module is None or "avx512_vnni" not in runnable_variants() or not module.amx_usable():
        pytest.skip("no AMX tiles here (needs AVX-512 VNNI, AMX-INT8 and the OS's grant)")
    before, threads = module.set_amx(True), torch.get_num_threads()
    torch.set_num_threads(2)  # the shapes' panel shares below are 2 threads'
    yield module
    module.set_amx(before)
    torch.set_num_threads(threads)


def _weights(bits: int, group: int | None, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, s = quantize_weight(torch.randn(n, k, generator=gen) * 0.05, WeightQuant(bits, group, False))
    return q, s.float()


def _both(km, run):
    """The linear on the tiles, then on VNNI, with how many kernel calls ran on the tiles."""
    calls = km.amx_tile_calls()
    km.set_amx(True)
    tiles = run()
    used = km.amx_tile_calls() - calls
    km.set_amx(False)
    try:
        vnni = run()
    finally:
        km.set_amx(True)
    return tiles, vnni, used


# (N, K): 96 = 6 panels (3 a thread: a single last panel), 130 = 8 full panels and a narrow one,
# 2048 the 2B shape's width, 1536 in 24 groups of 64 (a batch of 16 groups, then 8 carried on)
SHAPES = [(96, 576), (130, 1024), (64, 2048), (32, 1536)]
ROWS = [16, 17, 31, 32, 33, 64, 100]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("act_groups", [False, True])
def test_w4a8_on_tiles_equals_vnni_and_the_twin(tiles, n, k, group, act_groups):
    if k % group:
        pytest.skip("group does not divide K")
    v = tiles.variant("avx512_vnni")
    q, s = _weights(4, group, n, k, n + k + group)
    packed, scales = tiles.pack_int4(q, v), tiles.pack_scales(s, v)
    gen = torch.Generator().manual_seed(3)
    for m in ROWS:
        x = torch.randn(m, k, generator=gen) * 2
        bias = torch.randn(n, generator=gen)

        def run(variant=v, x=x, bias=bias):
            return tiles.w4a8_linear(x, packed, scales, bias, variant, act_groups=act_groups)

        got, vnni, used = _both(tiles, run)
        assert used > 0, (m, n, k, group)  # the tiles ran
        assert torch.equal(got, vnni), (m, n, k, group)
        assert torch.equal(got, run(v.twin)), (m, n, k, group)
        if not act_groups:
            ref = reference_forward(x, q, s, bias)
            assert (got - ref).abs().max().item() <= REL_BUDGET * ref.abs().max().item() + 1e-6


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("group,act_groups", [(None, False), (64, False), (64, True)])
def test_w8a8_on_tiles_equals_vnni_and_the_twin(tiles, n, k, group, act_groups):
    v = tiles.variant("avx512_vnni")
    q, s = _weights(8, group, n, k, n * k)
    q[0, :4] = torch.tensor([-128, 127, -127, 0], dtype=torch.int8)  # the offset layout's extremes
    weight = tiles.pack_int8(q, v)
    scales = s.view(-1) if group is None else tiles.pack_scales(s, v)
    gen = torch.Generator().manual_seed(4)
    for m in ROWS:
        x = torch.randn(m, k, generator=gen) * 2

        def run(variant=v, x=x):
            return tiles.w8a8_linear(x, weight, scales, None, variant, act_groups=act_groups)

        got, vnni, used = _both(tiles, run)
        assert used > 0, (m, n, k, group)
        assert torch.equal(got, vnni), (m, n, k, group)
        assert torch.equal(got, run(v.twin)), (m, n, k, group)
        if act_groups:
            continue
        ref = reference_forward(x, q, s, None)
        assert (got - ref).abs().max().item() <= REL_BUDGET * ref.abs().max().item() + 1e-6


@pytest.mark.parametrize(
    "bits,group,m,k",
    [
        (4, 32, 64, 1024),  # groups of 32 (Q4_0): VNNI folds them cheaper
        (4, 96, 64, 1536),  # groups that are not whole 64-input chunks
        (8, None, 15, 1024),  # fewer rows than a tile
        (8, None, 64, 96),  # K not whole 64-input chunks
    ],
)
def test_the_tiles_leave_what_they_do_not_take_to_vnni(tiles, bits, group, m, k):
    v = tiles.variant("avx512_vnni")
    q, s = _weights(bits, group, 64, k, 5)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6))
    if bits == 4:
        packed, scales = tiles.pack_int4(q, v), tiles.pack_scales(s, v)

        def run(variant=v):
            return tiles.w4a8_linear(x, packed, scales, None, variant)

    else:
        weight = tiles.pack_int8(q, v)

        def run(variant=v):
            return tiles.w8a8_linear(x, weight, s.view(-1), None, variant)

    got, vnni, used = _both(tiles, run)
    assert used == 0 and torch.equal(got, vnni) and torch.equal(got, run(v.twin))


def test_the_start_up_note_says_whether_the_tiles_run(tiles):
    from cpuserve.kernels import amx_note

    assert tiles.amx_enabled() and tiles.amx_switched_on()
    assert amx_note().startswith(f"AMX tiles for avx512_vnni's linears of {tiles.amx_rows()}+ rows")
    tiles.set_amx(False)  # what CPUSERVE_AMX=0 does where the kernels load
    try:
        assert not tiles.amx_enabled() and tiles.amx_usable()
        assert amx_note() == "AMX tiles off (CPUSERVE_AMX=0): batched linears on VNNI"
    finally:
        tiles.set_amx(True)
