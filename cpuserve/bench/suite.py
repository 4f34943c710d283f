"""The whole speed comparison in one run (`benchmarks/run`): prepares the same weights for both
engines (once; kept in the work directory), measures cpuserve W4A8 against llama.cpp Q4_0 and
cpuserve W8A8 against Q8_0 on SmolLM2-135M and on the MiniCPM5-2B shape, and writes the table and a
plot into docs/.

python -m cpuserve.bench.suite --work DIR --llamacpp-python PY [--repeats 3] [--only smol|2b|gguf]
    [--llama-server BIN [--as-avx2]] [--no-serving]

Family `gguf` (bench/gguf_files.py): the same GGUF files (the 2B shape at Q4_0 and Q4_K_M, Gemma 3
270M Q4_K_M) served by cpuserve as they are and by llama.cpp, against issue 18's bars.

With --llama-server, the serving comparison too (bench/serving_bench.py): the bundled SmolLM2 GGUF
for both servers, and the 2B shape's W4A8 against its Q4_0 GGUF.

--as-avx2 (an AVX-512 host standing in for an AVX2 one) runs all of it with cpuserve held to AVX2
(its kernels and torch's, AS_AVX2) against llama.cpp and llama-server built for AVX2 only (the
caller passes those builds); its sections of docs/benchmarks.md are its own.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from cpuserve.bench.speed import SpeedResult, decode_bytes, measure_speed, ratios, render_speed

DOCS = Path(__file__).resolve().parents[2] / "docs"
BEGIN, END = "<!-- bench-suite:begin -->", "<!-- bench-suite:end -->"
AVX2_BEGIN, AVX2_END = "<!-- bench-suite-avx2:begin -->", "<!-- bench-suite-avx2:end -->"
LM_HEAD = "int8"  # llama.cpp's exports keep the output head at 8 bits (Q8_0): the same for cpuserve

# (key, cpuserve label, cpuserve dir, scheme, group, llama.cpp label, gguf, gguf type); dirs in --work.
PAIRS = {
    "smol": [
        ("SmolLM2 W4A8-G64", "smol/smol-w4a8-g64", "w4a8", 64, "SmolLM2 Q4_0", "smol/smol-q4_0.gguf", "q4_0"),
        ("SmolLM2 W8A8", "smol/smol-w8a8", "w8a8", None, "SmolLM2 Q8_0", "smol/smol-q8_0.gguf", "q8_0"),
    ],
    "2b": [
        ("2B W4A8-G128", "minicpm5-2b-w4a8", "w4a8", 128, "2B Q4_0", "minicpm5-2b-q4_0.gguf", "q4_0"),
        ("2B W8A8", "minicpm5-2b-w8a8", "w8a8", None, "2B Q8_0", "minicpm5-2b-q8_0.gguf", "q8_0"),
    ],
}


def _say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def prepare(work: Path, model: str) -> None:
    """Create whatever is missing: the bf16 source, the cpuserve checkpoints, the GGUFs."""
    from cpuserve.bench.gguf_export import export_gguf
    from cpuserve.bench.make_model import make_model
    from cpuserve.model.resolve import bundled_gguf, resolve_hf_model
    from cpuserve.offline.quantize import quantize_checkpoint

    bundled = resolve_hf_model(None)
    if model == "smol":
        source = bundled
    else:
        source = work / "minicpm5-2b-bf16"
        if not source.exists():
            _say(f"making the MiniCPM5-2B-shaped bf16 model (random weights) in {source}")
            make_model("minicpm5-2b", source, bundled)
    for _, ours, scheme, group, _, gguf, qtype in PAIRS[model]:
        if not (work / ours).exists():
            _say(f"quantizing {source.name} -> {ours} ({scheme}, data-free)")
            quantize_checkpoint(source, work / ours, scheme, group, pack=scheme == "w4a8")
        if not (work / gguf).exists():
            _say(f"exporting {source.name} -> {gguf}")
            (work / gguf).parent.mkdir(parents=True, exist_ok=True)
            export_gguf(source, work / gguf, qtype, bundled_gguf())


def plot_svg(result: SpeedResult) -> str:
    """Grouped bars: cpuserve / llama.cpp per pair for prefill 128, prefill N, decode (and the long
    prompt's prefill and decode when measured); a line at 1.0."""
    metrics = [("pp128", "prefill 128"), (f"pp{result.prompt}", f"prefill {result.prompt}"), ("tg", "decode")]
    if result.long:
        metrics += [(f"pp{result.long}", f"prefill {result.long}"), (f"tg{result.long}", f"decode at {result.long}")]
    colors = ["#4c78a8", "#72b7b2", "#f58518", "#54a24b", "#b279a2"]
    values = [[ratios(pair, result.prompt, result.long)[key] for key, _ in metrics] for pair in result.pairs]
    top = max(2.0, max(max(v) for v in values) * 1.15)
    group = 40 * len(metrics) + 40
    left = 60
    # room for every pair's bars and for the legend (130 px an entry)
    width, height, bottom, plot_h = max(group * len(values), 130 * len(metrics) + 90) + 120, 360, 300, 260
    scale = plot_h / top
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="12">',
        f'<text x="{left}" y="18" font-size="14">cpuserve / llama.cpp on the same weights (higher is better), '
        f"{result.threads} threads</text>",
    ]
    for tick in range(int(top) + 1):
        y = bottom - tick * scale
        out.append(f'<line x1="{left}" x2="{width - 20}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 8}" y="{y + 4:.1f}" text-anchor="end">{tick}x</text>')
    y1 = bottom - scale
    out.append(f'<line x1="{left}" x2="{width - 20}" y1="{y1:.1f}" y2="{y1:.1f}" stroke="#333" stroke-dasharray="4"/>')
    for i, (pair, vals) in enumerate(zip(result.pairs, values, strict=True)):
        x0 = left + 20 + group * i
        for j, v in enumerate(vals):
            x, h = x0 + 40 * j, v * scale
            out.append(f'<rect x="{x}" y="{bottom - h:.1f}" width="34" height="{h:.1f}" fill="{colors[j]}"/>')
            out.append(f'<text x="{x + 17}" y="{bottom - h - 4:.1f}" text-anchor="middle">{v:.2f}</text>')
        mid = x0 + 20 * len(metrics) - 3
        out.append(f'<text x="{mid}" y="{bottom + 18}" text-anchor="middle">{pair.ours}</text>')
        out.append(f'<text x="{mid}" y="{bottom + 32}" text-anchor="middle" fill="#666">vs {pair.theirs}</text>')
    for j, (_, name) in enumerate(metrics):
        x = left + 20 + 130 * j
        out.append(f'<rect x="{x}" y="{height - 16}" width="12" height="12" fill="{colors[j]}"/>')
        out.append(f'<text x="{x + 16}" y="{height - 6}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out)


# Each family's layer shape and schemes for the linears-against-peak table (bench/peak.py).
EFFICIENCY = {
    "smol": ("smollm2-135m", (("W4A8-G64", 4, 64), ("W8A8", 8, None))),
    "2b": ("minicpm5-2b", (("W4A8-G128", 4, 128), ("W8A8", 8, None))),
}


def efficiency_tables(families: list[str], threads: int, variant: str | None = None) -> list[str]:
    """The batched linears of each family's shape against the measured int8 peak, rendered
    (variant: a kernel variant by name; else the one cpuserve selects here)."""
    import torch

    from cpuserve.bench.peak import measure_efficiency, render_efficiency

    torch.set_num_threads(threads)
    tables = []
    for family in families:
        shape, schemes = EFFICIENCY[family]
        _say(f"linears against the int8 peak: {shape}")
        tables.append(render_efficiency(measure_efficiency(shape, variant_name=variant, schemes=schemes)))
    return tables


# What --as-avx2 sets for cpuserve: its kernels and torch's (the slow-bf16 path of an AVX2 host).
AS_AVX2 = {"CPUSERVE_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def _command(args: argparse.Namespace) -> str:
    """The command a docs section names (the AVX2 case's says so)."""
    return "benchmarks/run --as-avx2" if args.as_avx2 else "benchmarks/run"


def _variant(args: argparse.Namespace) -> str | None:
    """The kernel variant the linears-against-peak tables measure: the AVX2 case's, else cpuserve's choice."""
    return AS_AVX2["CPUSERVE_ISA"] if args.as_avx2 else None


def _replace_section(begin: str, end: str, section: str, docs: Path) -> None:
    path = docs / "benchmarks.md"
    text = path.read_text()
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.write_text(text)


def run_serving(work: Path, families: list[str], llama_server: str, threads: int, as_avx2: bool) -> str:
    """The serving comparison for each family (its models prepared if missing), one server at a time;
    the rendered tables."""
    from cpuserve.bench.serving_bench import WORKLOADS, render_table, run
    from cpuserve.model.resolve import bundled_gguf, resolve_model

    for family in families:
        prepare(work, family)
    env = AS_AVX2 if as_avx2 else {}
    results = []
    for family in families:
        if family == "smol":
            model, label, gguf = str(resolve_model(None)), "SmolLM2-135M Q4_1 (bundled, both)", str(bundled_gguf())
        else:
            model, label = str(work / "minicpm5-2b-w4a8"), "2B W4A8-G128 vs Q4_0"
            gguf = str(work / "minicpm5-2b-q4_0.gguf")
        _say(f"serving: {label}")
        result = run(model, label, gguf, llama_server, [], threads, list(WORKLOADS.values()), env, work / "serving")
        results.append(result)
    return f"host: {case_isa(as_avx2, 'llama-server')}\n\n" + render_table(results)


def case_isa(as_avx2: bool, peer: str) -> str:
    """What a report says about the ISA it measured (peer: llama.cpp's program in that report)."""
    from cpuserve.bench.serving_bench import host_isa

    if not as_avx2:
        return host_isa()
    return (
        "cpuserve kernels avx2 (CPUSERVE_ISA), torch AVX2 (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2) "
        f"on a host whose own choice is {host_isa()}; {peer} built for AVX2"
    )


def write_serving_docs(report: str, command: str, as_avx2: bool, threads: int, docs: Path = DOCS) -> None:
    tag = "bench-serving-avx2" if as_avx2 else "bench-serving"
    title = "the AVX2 case on this host" if as_avx2 else "this host"
    section = "\n".join(
        [
            f"<!-- {tag}:begin -->",
            f"## Serving: cpuserve against llama-server, {title} (generated by `benchmarks/run`)",
            "",
            f"`{command}`; llama-server `-np 16 -c 16384`, both on {threads} threads; random-token prompts, "
            "`ignore_eos`, output tok/s from `usage.completion_tokens` over each concurrency's wall time.",
            "",
            report,
            f"<!-- {tag}:end -->",
        ]
    )
    _replace_section(f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->", section, docs)


def write_docs(
    result: SpeedResult,
    command: str,
    docs: Path = DOCS,
    efficiency: Sequence[str] = (),
    as_avx2: bool = False,
    isa: str = "",
) -> None:
    """Replace the generated section of docs/benchmarks.md (appended the first time) and the plot.
    efficiency: the linears-against-peak tables (bench/peak.py), one per model shape. as_avx2: the
    AVX2 case's own section and plot. isa: the host line (case_isa)."""
    begin, end = (AVX2_BEGIN, AVX2_END) if as_avx2 else (BEGIN, END)
    plot = "speed-avx2.svg" if as_avx2 else "speed.svg"
    (docs / plot).write_text(plot_svg(result) + "\n")
    title = "the AVX2 case on this host" if as_avx2 else "one run"
    section = "\n".join(
        [
            begin,
            f"## cpuserve against llama.cpp, {title} (generated by `benchmarks/run`)",
            "",
            *([f"host: {isa}", ""] if isa else []),
            f"`{command}`; cpuserve's output head `--quantize-lm-head {LM_HEAD}` (llama.cpp's exports keep the "
            "head at Q8_0); data-free quantization for both engines; random weights at the MiniCPM5-2B shape.",
            "",
            render_speed(result),
            "",
            f"![cpuserve / llama.cpp]({plot})",
            *(line for table in efficiency for line in ("", table)),
            end,
        ]
    )
    _replace_section(begin, end, section, docs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, type=Path, help="where the models are kept between runs")
    parser.add_argument("--llamacpp-python", required=True, help="a python with llama-cpp-python installed")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument("--long", type=int, default=4096, help="a long prompt's tokens, prefill and decode (0: skip)")
    parser.add_argument("--only", choices=[*sorted(PAIRS), "gguf"], action="append", help="one family (repeatable)")
    parser.add_argument("--no-docs", action="store_true", help="print only; leave docs/ alone")
    parser.add_argument("--llama-server", default=None, help="a llama-server binary: the serving comparison too")
    parser.add_argument("--no-serving", action="store_true", help="skip the serving comparison")
    parser.add_argument("--serving-only", action="store_true", help="only the serving comparison")
    parser.add_argument(
        "--as-avx2", action="store_true", help="cpuserve held to AVX2 (pass llama.cpp builds for AVX2 only)"
    )
    args = parser.parse_args(argv)
    families = [f for f in args.only or [*PAIRS, "gguf"] if f in PAIRS]
    gguf_family = "gguf" in (args.only or ["gguf"])
    only = "".join(f" --only {f}" for f in args.only or [])
    serving = args.llama_server is not None and not args.no_serving
    if args.serving_only and not (serving and families):
        parser.error("--serving-only runs the serving comparison: --llama-server, smol or 2b, no --no-serving")
    if families and not args.serving_only:
        run_speed(args, families, only)
    if gguf_family and not args.serving_only:
        run_gguf_files(args, only)
    if serving and families:
        report = run_serving(args.work, families, args.llama_server, args.threads, args.as_avx2)
        if args.as_avx2 and args.serving_only:  # the AVX2 case's linears table (run_speed's when it runs)
            report = "\n\n".join([report, *efficiency_tables(families, args.threads, _variant(args))])
        print(report)
        if not args.no_docs:
            flag = " --serving-only" if args.serving_only else ""
            write_serving_docs(report, f"{_command(args)}{flag}{only}", args.as_avx2, args.threads)
    return 0


def run_gguf_files(args: argparse.Namespace, only: str) -> None:
    """The same GGUF files, cpuserve and llama.cpp (needs the 2B source: prepared here if missing)."""
    from cpuserve.bench import gguf_files

    prepare(args.work, "2b")
    files = gguf_files.gguf_files(args.work, args.llamacpp_python, args.threads)
    env = AS_AVX2 if args.as_avx2 else {}
    result = gguf_files.measure_files(files, args.llamacpp_python, args.threads, args.repeats, args.decode, env)
    report = gguf_files.render_report(result, files, case_isa(args.as_avx2, "llama.cpp"))
    print(report)
    if not args.no_docs:
        command = f"{_command(args)} --repeats {args.repeats} --decode {args.decode}{only}"
        begin, end = gguf_files.markers(args.as_avx2)
        _replace_section(begin, end, gguf_files.docs_section(report, command, args.as_avx2), DOCS)


def run_speed(args: argparse.Namespace, families: list[str], only: str) -> None:
    """Our own checkpoints against llama.cpp's exports of the same weights, and the docs section."""
    pairs, sizes = [], {}
    for family in families:
        prepare(args.work, family)
        for ours, ours_dir, _, _, theirs, gguf, _ in PAIRS[family]:
            sizes.update(decode_bytes(ours, args.work / ours_dir, theirs, args.work / gguf, lm_head=LM_HEAD))
            pairs.append((ours, args.work / ours_dir, theirs, args.work / gguf))
    result = measure_speed(
        pairs,
        args.llamacpp_python,
        args.threads,
        512,
        args.decode,
        args.repeats,
        sizes,
        env={"CPUSERVE_QUANTIZE_LM_HEAD": LM_HEAD, **(AS_AVX2 if args.as_avx2 else {})},
        long=args.long,
    )
    isa = case_isa(args.as_avx2, "llama.cpp")
    print(f"host: {isa}\n\n{render_speed(result)}")
    name = "speed-avx2" if args.as_avx2 else "speed"
    (args.work / f"{name}.json").write_text(json.dumps(asdict(result), indent=1))
    efficiency = efficiency_tables(families, args.threads, _variant(args))
    print("\n\n".join(efficiency))
    if not args.no_docs:
        command = f"{_command(args)} --repeats {args.repeats} --decode {args.decode} --long {args.long}{only}"
        write_docs(result, command, efficiency=efficiency, as_avx2=args.as_avx2, isa=isa)
        _say(f"wrote docs/benchmarks.md and docs/{name}.svg")


if __name__ == "__main__":
    sys.exit(main())
