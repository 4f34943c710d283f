"""The int8 peak loop behind the benchmark's "% of peak" (csrc/dot_peak.h): every compiled variant
this CPU runs does exactly the multiply-adds it claims per round on every thread (all-ones operands:
the accumulator lanes sum to the count), and the twins' rows, which have no loop, are refused."""

from __future__ import annotations

import pytest
import torch

from cpuserve.kernels import native, runnable_variants

# Multiply-adds per round, from each loop's instructions: chains x lanes x products per lane.
MACS = {
    "generic": 64 * 4,
    "avx2": 8 * 8 * 8,
    "avx_vnni": 12 * 8 * 4,
    "avx512_vnni": 12 * 16 * 4,
    "neon": 12 * 4 * 4,
    "neon_dotprod": 12 * 4 * 4,
    "neon_i8mm": 12 * 4 * 8,
}


@pytest.mark.parametrize("name", sorted(MACS))
def test_the_lanes_count_every_multiply_add(name):
    kernels = native()
    if name not in kernels.variants():
        pytest.skip(f"{name} is not compiled for this architecture")
    if name not in runnable_variants():
        pytest.skip(f"this CPU lacks {name}")
    v = kernels.variant(name)
    assert v.dot_peak_macs == MACS[name]
    for rounds in (0, 1, 13, 20000):
        assert kernels.dot_peak(v, rounds) == rounds * MACS[name] * torch.get_num_threads()


def test_a_twin_row_has_no_peak_loop_and_rounds_are_bounded():
    kernels = native()
    twin = kernels.variant("generic_offset_panels")
    assert twin.dot_peak_macs == 0
    with pytest.raises(RuntimeError, match="no peak loop"):
        kernels.dot_peak(twin, 1)
    with pytest.raises(RuntimeError, match="rounds must be in"):  # int32 lanes would wrap
        kernels.dot_peak(kernels.variant("generic"), 2**31)
