"""`cpuserve bench peak`'s arithmetic and report: a layer's linears as the loader fuses them, the
layer's rate as all its multiply-adds over the sum of its linears' times, percentages of the measured
peak; the linears it times are the real native ones (their output checked against the reference)."""

from __future__ import annotations

import pytest
import torch

from cpuserve.bench.make_model import SHAPES
from cpuserve.bench.peak import (
    Efficiency,
    layer_gmacs,
    linear_call,
    model_linears,
    random_scheme_weight,
    render_efficiency,
)
from cpuserve.bench.suite import write_docs
from cpuserve.cli import main
from cpuserve.kernels import native, selected_variant


def test_a_layer_is_its_fused_linears():
    assert model_linears(SHAPES["smollm2-135m"]) == [
        ("qkv_proj", (9 + 2 * 3) * 64, 576),
        ("o_proj", 576, 576),
        ("gate_up_proj", 2 * 1536, 576),
        ("down_proj", 576, 1536),
    ]


def test_the_layer_rate_weighs_each_linear_by_its_work():
    # 1 GMAC at 100 GMAC/s (10 ms) and 3 GMAC at 300 GMAC/s (10 ms): 4 GMAC in 20 ms = 200 GMAC/s
    rows = [("a", 1000, 1000, 100.0), ("b", 3000, 1000, 300.0)]
    assert layer_gmacs(rows, 1000) == pytest.approx(200.0)


def test_the_report_gives_percent_of_the_peak():
    e = Efficiency("avx2", 2, 200.0, "s", {("W8A8", 16): [("a", 1000, 1000, 100.0), ("b", 3000, 1000, 300.0)]})
    text = render_efficiency(e)
    assert text.startswith("int8 peak: 200 GMAC/s (avx2's dot-peak loop on 2 threads)")
    assert "| scheme | M | a 1000x1000 | b 3000x1000 | layer |" in text
    assert "| W8A8 | 16 | 100 (50%) | 300 (150%) | **200 (100%)** |" in text


@pytest.mark.parametrize("bits,group", [(4, 64), (8, None)])
def test_the_timed_linear_is_the_native_one_on_the_schemes_weights(bits, group):
    kernels = native()
    if kernels is None:
        pytest.skip("native kernels not built")
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
    y = linear_call(kernels, selected_variant(), bits, group, x, 48)()
    q, scales = random_scheme_weight(bits, group, 48, 128)
    w = (q.float().view(48, scales.shape[1], -1) * scales.unsqueeze(-1)).view(48, 128)
    reference = x @ w.t()
    assert y.shape == (5, 48)
    # int8 activations per token: about 1% of the output's scale
    assert (y - reference).abs().max() <= 0.02 * reference.abs().max()


def test_generated_section_carries_the_efficiency_tables(tmp_path):
    from tests.test_bench_suite import _result

    (tmp_path / "benchmarks.md").write_text("# Benchmarks\n")
    write_docs(_result(), "benchmarks/run", docs=tmp_path, efficiency=["int8 peak: table one", "int8 peak: two"])
    text = (tmp_path / "benchmarks.md").read_text()
    assert "int8 peak: table one\n\nint8 peak: two\n<!-- bench-suite:end -->" in text


def test_a_group_that_does_not_divide_a_linear_is_refused(capsys):
    assert main(["bench", "peak", "--shape", "smollm2-135m", "--group", "128"]) == 1
    assert "qkv_proj has K = 576, not a multiple of it" in capsys.readouterr().err
