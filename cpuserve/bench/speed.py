"""`cpuserve bench speed`: cpuserve against llama.cpp on the same weights, same threads, one run.

Each measurement runs in a fresh process (peak RSS is that engine's own); engines alternate and
each is measured `repeats` times; medians are reported with ratios, and decode is also expressed
as GB/s of weights read per token against this machine's measured read bandwidth.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
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


def _run(cmd: list[str]) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_speed(
    pairs: list[tuple[str, Path, str, Path]],
    llamacpp_python: str,
    threads: int,
    prompt: int,
    decode: int,
    repeats: int,
    weight_bytes: dict[str, int],
) -> str:
    """pairs: (cpuserve label, cpuserve dir, llama.cpp label, gguf)."""
    bandwidth = read_bandwidth_gbs(threads)
    lines = [
        f"threads {threads}; read bandwidth {bandwidth:.1f} GB/s; prompt {prompt}, decode {decode}; "
        f"medians of {repeats}",
        "",
        "| engine | pp128 tok/s | pp512 tok/s | decode tok/s | decode GB/s (% of bw) | load s | peak RSS MB |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for ours_label, ours_dir, theirs_label, gguf in pairs:
        runs: dict[str, list[dict]] = {ours_label: [], theirs_label: []}
        for _ in range(repeats):
            runs[ours_label].append(
                _run([sys.executable, "-m", "cpuserve.bench.speed_worker", str(ours_dir), str(prompt), str(decode)])
            )
            runs[theirs_label].append(
                _run([llamacpp_python, str(LLAMACPP_SCRIPT), str(gguf), str(prompt), str(decode), str(threads)])
            )
        med = {label: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for label, rs in runs.items()}
        for label in (ours_label, theirs_label):
            m = med[label]
            gbs = m["tg"] * weight_bytes[label] / 1e9
            lines.append(
                f"| {label} | {m['pp128']:.1f} | {m[f'pp{prompt}']:.1f} | {m['tg']:.2f} | {gbs:.1f} "
                f"({100 * gbs / bandwidth:.0f}%) | {m['load_s']:.1f} | {m['peak_rss_mb']:.0f} |"
            )
        o, t = med[ours_label], med[theirs_label]
        ratios.append(
            f"{ours_label} / {theirs_label}: prefill pp{prompt} {o[f'pp{prompt}'] / t[f'pp{prompt}']:.2f}x, "
            f"pp128 {o['pp128'] / t['pp128']:.2f}x, decode {o['tg'] / t['tg']:.2f}x"
        )
    return "\n".join([*lines, "", *ratios])
