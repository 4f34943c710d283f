"""`cpuserve bench gguf-types`: each GGUF type cpuserve serves on its kernels, the same file evaluated
by cpuserve (served as it is, never dequantized to a float model) and by llama.cpp, on the same token
windows. The files are what users download: the bundled SmolLM2's weights written at F16, then
quantized by llama.cpp itself to each type (llama_model_quantize, as llama-quantize); any other GGUF
(the Gemma 3 file) is taken as it is. A row names the tensor types its file holds: llama.cpp falls
back to other types for rows whose length is not a multiple of 256 in its K-quant files.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

# llama.cpp's file types (LLAMA_FTYPE_MOSTLY_*): the common downloads, each a row.
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
QUANTIZE_SCRIPT = Path(__file__).with_name("llamacpp_quantize.py")


def _say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def type_files(work: Path, llamacpp_python: str, types: list[str], threads: int) -> dict[str, Path]:
    """SmolLM2 at F16 (from the bundled weights), then one llama.cpp quantization per type; made once."""
    from cpuserve.model.resolve import bundled_gguf, resolve_hf_model

    work.mkdir(parents=True, exist_ok=True)
    f16 = f16_file(resolve_hf_model(None), work / "smol-f16.gguf", bundled_gguf())
    files = {}
    for kind in types:
        out = work / f"smol-{kind.lower()}.gguf"
        if not out.exists():
            quantize_with_llamacpp(f16, out, kind, llamacpp_python, threads)
        files[f"SmolLM2-135M {kind}"] = out
    return files


def f16_file(source: Path, f16: Path, tokenizer_gguf: Path) -> Path:
    """`source` (an HF directory) written at F16 once; beside, then renamed: an interrupted export is
    never reused."""
    from cpuserve.bench.gguf_export import export_gguf

    if not f16.exists():
        _say(f"exporting {source.name} at F16 -> {f16}")
        export_gguf(source, f16.with_suffix(".tmp"), "f16", tokenizer_gguf)
        f16.with_suffix(".tmp").rename(f16)
    return f16


def quantize_with_llamacpp(f16: Path, out: Path, kind: str, llamacpp_python: str, threads: int) -> None:
    """llama.cpp's own quantization of an F16 GGUF to `kind` (FTYPES), written beside then renamed."""
    _say(f"llama.cpp quantizing {f16.name} -> {out.name}")
    partial = out.with_suffix(".tmp")
    cmd = [llamacpp_python, str(QUANTIZE_SCRIPT), str(f16), str(partial), str(FTYPES[kind]), str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp could not quantize to {kind}: {done.stderr.strip()[-800:]}")
    partial.rename(out)


def tensor_types(path: Path) -> str:
    """The file's matrix tensors by type, most first: 'Q4_K 120, Q5_0 90'."""
    from cpuserve.model.gguf_header import read_header

    counts = Counter(t.kind for t in read_header(path).tensors if len(t.shape) == 2)
    return ", ".join(f"{kind} {n}" for kind, n in counts.most_common())


def compare(files: dict[str, Path], llamacpp_python: str, text: Path, ctx: int, threads: int) -> str:
    """One row per file: cpuserve's and llama.cpp's perplexity on the same windows, and their ratio."""
    from cpuserve.bench.perplexity import cpuserve_nll, llamacpp_nll, token_windows
    from cpuserve.model.resolve import resolve_model
    from cpuserve.tokenizer import Tokenizer

    lines = [
        f"text {text}, windows of {ctx} tokens (each file's own tokenizer), cpuserve in float32 on its kernels; "
        f"{threads} threads",
        "",
        "| file | matrix tensors by type | cpuserve | llama.cpp | cpuserve / llama.cpp |",
        "|---|---|---|---|---|",
    ]
    for label, path in files.items():
        served = resolve_model(str(path))  # the file as it is: its serving directory
        windows = token_windows(Tokenizer(served), text.read_text(), ctx)
        _say(f"perplexity: {label} ({sum(len(w) for w in windows)} tokens)")
        ours_nll, n = cpuserve_nll(served, windows, "float32")
        theirs_nll, m = llamacpp_nll(llamacpp_python, path, windows, threads)
        if n != m:
            raise RuntimeError(f"{label}: cpuserve scored {n} tokens, llama.cpp {m}")
        ours, theirs = math.exp(ours_nll / n), math.exp(theirs_nll / n)
        lines.append(
            f"| {label} | {tensor_types(path)} | {ours:.3f} | {theirs:.3f} | **{100 * (ours / theirs - 1):+.2f}%** |"
        )
    return "\n".join(lines)
