"""`cpuserve bench speed`: cpuserve against llama.cpp on the same weights, same threads, one run.

Each measurement runs in a fresh process (peak RSS is that engine's own); engines alternate and
each is measured `repeats` times; medians are reported with ratios, and decode is also expressed
as GB/s of weights read per token against this machine's measured read bandwidth. With `long`, each
run also prefills a prompt of that many tokens and decodes behind it (llama.cpp with flash attention).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

LLAMACPP_SCRIPT = Path(__file__).with_name("llamacpp_speed.py")


def read_bandwidth_gbs(threads: int, size_gib: float = 2.0, repeats: int = 5) -> float:
    """Streaming read bandwidth: summing a large float32 array with `threads` threads."""
    torch.set_num_threads(threads)
    data = torch.ones(int(size_gib * 1024**3 / 4))
    data.sum()
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        data.sum()
        best = max(best, data.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return best


def _run(cmd: list[str], env: dict[str, str] | None = None) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if out.returncode != 0:  # say why (a worker refuses to measure the wrong engine, for one)
        raise RuntimeError(f"{' '.join(cmd[:3])} failed ({out.returncode}): {out.stderr.strip()[-800:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def decode_bytes(
    ours_label: str, ours_dir: Path, theirs_label: str, gguf: Path, lm_head: str | None = None
) -> dict[str, int]:
    """Bytes of weights one decode step reads, per engine (a token reads one embedding row, not the
    table, unless the table is also the output head). lm_head: cpuserve's --quantize-lm-head."""
    from cpuserve.model.footprint import model_facts
    from cpuserve.model.loader import lm_head_quant
    from cpuserve.offline.gguf_convert import open_gguf

    spec, _, facts = model_facts(ours_dir, "auto")
    table = spec.vocab_size * spec.hidden_size * 2  # bf16 embedding; an untied head is the same size
    body = facts["weights_bytes_native"] - table * (1 if spec.tie_word_embeddings else 2)
    if lm_head:  # values at the scheme's bits plus fp32 scales, per output and group
        quant = lm_head_quant(lm_head, spec.hidden_size)
        groups = spec.hidden_size // (quant.group_size or spec.hidden_size)
        head = table // 2 * quant.bits // 8 + spec.vocab_size * groups * 4
    else:
        head = table
    ours = body + head
    tensors = {t.name: int(t.n_bytes) for t in open_gguf(gguf).tensors}
    theirs = sum(tensors.values()) - (tensors.get("token_embd.weight", 0) if "output.weight" in tensors else 0)
    return {ours_label: ours, theirs_label: theirs}


@dataclass
class PairResult:
    """Medians of one cpuserve / llama.cpp pair (keys: load_s, pp128, pp<prompt>, tg, peak_rss_mb)."""

    ours: str
    theirs: str
    medians: dict[str, dict[str, float]]
    weight_bytes: dict[str, int]  # bytes a decode step reads, per engine


@dataclass
class SpeedResult:
    threads: int
    bandwidth_gbs: float
    prompt: int
    decode: int
    repeats: int
    pairs: list[PairResult]
    long: int = 0  # the long prompt's tokens (pp<long>, tg<long>); 0: not measured


def measure_speed(
    pairs: list[tuple[str, Path, str, Path]],
    llamacpp_python: str,
    threads: int,
    prompt: int,
    decode: int,
    repeats: int,
    weight_bytes: dict[str, int],
    env: dict[str, str] | None = None,
    long: int = 0,
) -> SpeedResult:
    """pairs: (cpuserve label, cpuserve dir, llama.cpp label, gguf). env: extra variables for cpuserve.
    long: also a prompt of that many tokens and decode behind it (0: not)."""
    bandwidth = read_bandwidth_gbs(threads)
    results = []
    for ours_label, ours_dir, theirs_label, gguf in pairs:
        runs: dict[str, list[dict]] = {ours_label: [], theirs_label: []}
        for i in range(repeats):
            print(f"[bench] {ours_label} vs {theirs_label}: run {i + 1}/{repeats}", file=sys.stderr, flush=True)
            runs[ours_label].append(
                _run(
                    [
                        sys.executable,
                        "-m",
                        "cpuserve.bench.speed_worker",
                        str(ours_dir),
                        str(prompt),
                        str(decode),
                        str(long),
                    ],
                    env,
                )
            )
            runs[theirs_label].append(
                _run(
                    [
                        llamacpp_python,
                        str(LLAMACPP_SCRIPT),
                        str(gguf),
                        str(prompt),
                        str(decode),
                        str(threads),
                        str(long),
                    ]
                )
            )
        med = {label: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for label, rs in runs.items()}
        sizes = {label: weight_bytes[label] for label in runs}
        results.append(PairResult(ours_label, theirs_label, med, sizes))
    return SpeedResult(threads, bandwidth, prompt, decode, repeats, results, long)


def ratios(pair: PairResult, prompt: int, long: int = 0) -> dict[str, float]:
    o, t = pair.medians[pair.ours], pair.medians[pair.theirs]
    keys = ("pp128", f"pp{prompt}", "tg") + ((f"pp{long}", f"tg{long}") if long else ())
    return {key: o[key] / t[key] for key in keys}


def render_speed(result: SpeedResult) -> str:
    p = result.prompt
    lines = [
        f"threads {result.threads}; read bandwidth {result.bandwidth_gbs:.1f} GB/s; prompt {p}, decode "
        f"{result.decode}; medians of {result.repeats}; TTFT = prefill of 128 tokens and the first token's "
        "logits (model only, no HTTP)",
        "",
        f"| engine | pp128 tok/s | pp{p} tok/s | TTFT 128 ms | decode tok/s | decode GB/s (% of bw) | load s |"
        " peak RSS MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for pair in result.pairs:
        for label in (pair.ours, pair.theirs):
            m = pair.medians[label]
            gbs = m["tg"] * pair.weight_bytes[label] / 1e9
            lines.append(
                f"| {label} | {m['pp128']:.1f} | {m[f'pp{p}']:.1f} | {1000 * 128 / m['pp128']:.0f} | {m['tg']:.2f} "
                f"| {gbs:.1f} ({100 * gbs / result.bandwidth_gbs:.0f}%) | {m['load_s']:.1f} | {m['peak_rss_mb']:.0f} |"
            )
    n = result.long
    if n:
        lines += [
            "",
            f"Long context: a {n}-token prompt, then {result.decode} tokens decoded behind it (llama.cpp with "
            "flash attention on).",
            "",
            f"| engine | pp{n} tok/s | decode at {n} tok/s |",
            "|---|---|---|",
        ]
        for pair in result.pairs:
            for label in (pair.ours, pair.theirs):
                m = pair.medians[label]
                lines.append(f"| {label} | {m[f'pp{n}']:.1f} | {m[f'tg{n}']:.2f} |")
    lines.append("")
    for pair in result.pairs:
        r = ratios(pair, p, n)
        long_part = f"; pp{n} **{r[f'pp{n}']:.2f}x**, decode at {n} **{r[f'tg{n}']:.2f}x**" if n else ""
        lines.append(
            f"- {pair.ours} / {pair.theirs}: prefill pp{p} **{r[f'pp{p}']:.2f}x**, pp128 {r['pp128']:.2f}x, "
            f"decode **{r['tg']:.2f}x**{long_part}"
        )
    return "\n".join(lines)
