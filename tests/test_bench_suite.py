"""benchmarks/run's report: the table, ratios and plot come from the measurements, and regenerating
replaces the generated section of docs/benchmarks.md instead of appending another."""

from __future__ import annotations

import pytest

from cpuserve.bench import gguf_files, suite
from cpuserve.bench.speed import PairResult, SpeedResult, render_speed
from cpuserve.bench.suite import AVX2_BEGIN, AVX2_END, BEGIN, END, plot_svg, write_docs


def _result() -> SpeedResult:
    ours = {"load_s": 2.0, "pp128": 300.0, "pp512": 250.0, "tg": 90.0, "peak_rss_mb": 500.0}
    theirs = {"load_s": 0.1, "pp128": 600.0, "pp512": 500.0, "tg": 60.0, "peak_rss_mb": 250.0}
    pair = PairResult("A W4A8", "A Q4_0", {"A W4A8": ours, "A Q4_0": theirs}, {"A W4A8": 10**8, "A Q4_0": 2 * 10**8})
    return SpeedResult(threads=2, bandwidth_gbs=20.0, prompt=512, decode=128, repeats=3, pairs=[pair])


def test_table_and_ratios_come_from_the_medians():
    text = render_speed(_result())
    assert "| A W4A8 | 300.0 | 250.0 | 427 | 90.00 | 9.0 (45%) | 2.0 | 500 |" in text
    assert "| A Q4_0 | 600.0 | 500.0 | 213 | 60.00 | 12.0 (60%) | 0.1 | 250 |" in text
    assert "prefill pp512 **0.50x**, pp128 0.50x, decode **1.50x**" in text


def test_plot_has_one_bar_per_ratio():
    svg = plot_svg(_result())
    assert svg.startswith("<svg") and svg.count("<rect") == 3 + 3  # 3 bars + 3 legend swatches
    assert ">1.50<" in svg and ">0.50<" in svg


def test_regenerating_replaces_the_section(tmp_path):
    (tmp_path / "benchmarks.md").write_text("# Benchmarks\n\nhand-written text\n")
    write_docs(_result(), "benchmarks/run", docs=tmp_path)
    write_docs(_result(), "benchmarks/run --repeats 5", docs=tmp_path)
    text = (tmp_path / "benchmarks.md").read_text()
    assert text.startswith("# Benchmarks\n\nhand-written text\n")
    assert text.count(BEGIN) == 1 and text.count(END) == 1 and "--repeats 5" in text
    assert (tmp_path / "speed.svg").read_text().startswith("<svg")


def test_the_long_prompt_gets_its_own_table_ratios_and_bars():
    result = _result()
    result.long = 4096
    result.pairs[0].medians["A W4A8"].update({"pp4096": 200.0, "tg4096": 80.0})
    result.pairs[0].medians["A Q4_0"].update({"pp4096": 100.0, "tg4096": 100.0})
    text = render_speed(result)
    assert "| A W4A8 | 200.0 | 80.00 |" in text and "| A Q4_0 | 100.0 | 100.00 |" in text
    assert "decode **1.50x**; pp4096 **2.00x**, decode at 4096 **0.80x**" in text
    svg = plot_svg(result)
    assert svg.count("<rect") == 5 + 5 and ">2.00<" in svg and ">0.80<" in svg


def test_the_legend_fits_the_plot_with_few_pairs():
    import re

    result = _result()
    result.long = 4096
    for label in ("A W4A8", "A Q4_0"):
        result.pairs[0].medians[label].update({"pp4096": 100.0, "tg4096": 10.0})
    svg = plot_svg(result)
    width = int(re.search(r'<svg[^>]* width="(\d+)"', svg).group(1))
    last_legend_x = max(int(x) for x in re.findall(r'<text x="(\d+)" y="354">', svg))
    assert last_legend_x + len("decode at 4096") * 7 <= width


def test_gguf_file_bars_are_judged_from_the_medians():
    from cpuserve.bench.gguf_files import render_bars

    ours = {"load_s": 9.0, "pp128": 110.0, "pp512": 100.0, "tg": 16.0, "peak_rss_mb": 3300.0}
    theirs = {"load_s": 1.0, "pp128": 60.0, "pp512": 50.0, "tg": 20.0, "peak_rss_mb": 3000.0}
    labels = ("2B Q4_0: cpuserve", "2B Q4_0: llama.cpp")
    pair = PairResult(*labels, dict(zip(labels, (ours, theirs), strict=True)), dict.fromkeys(labels, 10**9))
    result = SpeedResult(threads=2, bandwidth_gbs=20.0, prompt=512, decode=128, repeats=3, pairs=[pair])
    row = render_bars(result).splitlines()[2]
    assert row == (
        "| 2B Q4_0 | 1.10x (at most 1.15x: met) | 0.80x (at least 1.0x: **not met**) | 2.00x (at least 1.5x: met) |"
    )


def test_the_avx2_case_has_its_own_section_and_plot(tmp_path):
    (tmp_path / "benchmarks.md").write_text("# Benchmarks\n")
    write_docs(_result(), "benchmarks/run", docs=tmp_path, isa="cpuserve kernels avx512_vnni")
    write_docs(_result(), "benchmarks/run --as-avx2", docs=tmp_path, as_avx2=True, isa="cpuserve kernels avx2")
    write_docs(_result(), "benchmarks/run --as-avx2 --repeats 5", docs=tmp_path, as_avx2=True, isa="avx2 again")
    text = (tmp_path / "benchmarks.md").read_text()
    native = text.split(BEGIN, 1)[1].split(END, 1)[0]
    avx2 = text.split(AVX2_BEGIN, 1)[1].split(AVX2_END, 1)[0]
    assert text.count(AVX2_BEGIN) == 1 and text.count(BEGIN) == 1
    assert "host: cpuserve kernels avx512_vnni" in native and "(speed.svg)" in native and "--as-avx2" not in native
    assert "host: avx2 again" in avx2 and "--repeats 5" in avx2 and "(speed-avx2.svg)" in avx2
    assert (tmp_path / "speed-avx2.svg").read_text().startswith("<svg")


def test_gguf_files_avx2_case_keeps_the_host_section():
    native = gguf_files.docs_section("report A", "benchmarks/run")
    avx2 = gguf_files.docs_section("report B", "x", as_avx2=True)
    assert native.startswith(gguf_files.BEGIN) and native.endswith(gguf_files.END)
    assert avx2.startswith(gguf_files.AVX2_BEGIN) and avx2.endswith(gguf_files.AVX2_END)
    assert "the AVX2 case on this host" in avx2 and "AVX2" not in native


@pytest.fixture
def calls(monkeypatch):
    """suite.main with every measurement replaced by a record of what it was asked to run."""
    seen: list[tuple] = []

    def record(*entry):
        seen.append(entry)
        return ""

    monkeypatch.setattr(suite, "run_speed", lambda args, families, only: record("speed", args.as_avx2))
    monkeypatch.setattr(suite, "run_gguf_files", lambda args, only: record("gguf", args.as_avx2))
    monkeypatch.setattr(suite, "run_serving", lambda work, fams, srv, threads, avx2: record("serving", avx2))
    monkeypatch.setattr(suite, "efficiency_tables", lambda fams, threads, variant=None: [record("peak", variant)])
    monkeypatch.setattr(suite, "write_serving_docs", lambda report, command, avx2, threads: record("docs", command))
    return seen


BASE = ["--work", "/nonexistent", "--llamacpp-python", "python3"]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--as-avx2", "--only", "2b"], [("speed", True)]),  # no llama-server: no serving
        (["--as-avx2", "--only", "gguf"], [("gguf", True)]),
        (
            ["--as-avx2", "--only", "smol", "--serving-only", "--llama-server", "srv"],
            [("serving", True), ("peak", "avx2"), ("docs", "benchmarks/run --as-avx2 --serving-only --only smol")],
        ),
        (
            ["--only", "2b", "--llama-server", "srv"],
            [("speed", False), ("serving", False), ("docs", "benchmarks/run --only 2b")],
        ),
        (["--only", "2b", "--llama-server", "srv", "--no-serving"], [("speed", False)]),
    ],
)
def test_the_suite_runs_what_its_flags_ask(calls, argv, expected):
    assert suite.main([*BASE, *argv]) == 0
    assert calls == expected


def test_serving_only_needs_a_server(calls):
    with pytest.raises(SystemExit):
        suite.main([*BASE, "--serving-only", "--only", "smol"])
    assert calls == []
