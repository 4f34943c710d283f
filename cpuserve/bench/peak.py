"""The batched linears against the CPU's measured int8 peak (`cpuserve bench peak`, and a table of
benchmarks/run): the variant's dot-peak loop (csrc/dot_peak.h) on every thread gives the peak
multiply-adds per second this CPU reaches with the instructions the kernels use; each linear of a
model's shape then runs on the native kernels at M rows (16: a batch of decoding sequences, 512: a
prefill chunk), its activation quantization included, and is reported as GMAC/s and % of that peak.
Single-stream decode's share of the measured read bandwidth is in the speed table (bench/speed.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# (label, bits, group): the 2B shape's schemes in benchmarks/run (against llama.cpp's Q4_0 and Q8_0).
SCHEMES = (("W4A8-G128", 4, 128), ("W8A8", 8, None))


def _best_rate(run: Callable[[], Any], work: float, seconds: float = 0.15, repeats: int = 5) -> float:
    """`work` units per second of `run`, the best of `repeats` timings of enough calls to last `seconds`."""
    run()
    start = time.perf_counter()
    run()
    calls = max(1, int(seconds / max(time.perf_counter() - start, 1e-6)))
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        best = max(best, work * calls / (time.perf_counter() - start))
    return best


def int8_peak_gmacs(kernels: Any, variant: Any) -> float:
    """The variant's dot-peak loop on every thread of torch's pool: GMAC/s. A call is long (a million
    rounds, milliseconds), so the pool's fork and join do not count; the work is what the lanes say."""
    rounds = 1_000_000
    done = kernels.dot_peak(variant, rounds)
    return _best_rate(lambda: kernels.dot_peak(variant, rounds), done, seconds=0.3) / 1e9


def model_linears(config: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(name, N, K) of one Llama-shaped layer's linears as the loader fuses them."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    return [
        ("qkv_proj", (heads + 2 * kv_heads) * head_dim, hidden),
        ("o_proj", hidden, heads * head_dim),
        ("gate_up_proj", 2 * inter, hidden),
        ("down_proj", hidden, inter),
    ]


def random_scheme_weight(bits: int, group: int | None, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int values [N, K] in the scheme's range and fp32 scales [N, K / group] ([N, 1] per channel)."""
    gen = torch.Generator().manual_seed(n * 31 + k)
    low = -8 if bits == 4 else -127
    q = torch.randint(low, -low, (n, k), dtype=torch.int8, generator=gen)
    return q, torch.rand(n, k // (group or k), generator=gen) * 0.01 + 0.001


def linear_call(kernels: Any, variant: Any, bits: int, group: int | None, x: torch.Tensor, n: int) -> Callable:
    """One native linear of the scheme on random_scheme_weight's weights for activations x: a callable."""
    q, scales = random_scheme_weight(bits, group, n, x.shape[1])
    if bits == 4:
        packed, packed_scales = kernels.pack_int4(q, variant), kernels.pack_scales(scales, variant)
        return lambda: kernels.w4a8_linear(x, packed, packed_scales, None, variant)
    weight = q if kernels.int8_layout(variant) == "signed" else kernels.pack_int8(q, variant)
    channel_scales = scales.view(-1).contiguous()
    return lambda: kernels.w8a8_linear(x, weight, channel_scales, None, variant)


@dataclass
class Efficiency:
    """One measurement: the peak, and each (scheme, M)'s linears with their GMAC/s."""

    variant: str
    threads: int
    peak_gmacs: float
    shape: str
    # (scheme, M) -> [(linear, N, K, GMAC/s)]
    rows: dict[tuple[str, int], list[tuple[str, int, int, float]]]


def measure_efficiency(
    shape: str,
    ms: tuple[int, ...] = (16, 512),
    variant_name: str | None = None,
    schemes: tuple[tuple[str, int, int | None], ...] = SCHEMES,
) -> Efficiency:
    """Every linear of one layer of `shape` (bench/make_model.py's SHAPES) at each M, each scheme."""
    from cpuserve.bench.make_model import SHAPES
    from cpuserve.kernels import native, selected_variant

    kernels = native()
    if kernels is None:
        raise RuntimeError("the native kernels are not built: ./run setup")
    variant = kernels.variant(variant_name) if variant_name else selected_variant()
    peak = int8_peak_gmacs(kernels, variant)
    rows: dict[tuple[str, int], list[tuple[str, int, int, float]]] = {}
    for label, bits, group in schemes:
        for m in ms:
            rows[(label, m)] = [
                (
                    name,
                    n,
                    k,
                    _best_rate(linear_call(kernels, variant, bits, group, torch.randn(m, k), n), m * n * k) / 1e9,
                )
                for name, n, k in model_linears(SHAPES[shape])
            ]
    return Efficiency(str(variant), torch.get_num_threads(), peak, shape, rows)


def layer_gmacs(linears: list[tuple[str, int, int, float]], m: int) -> float:
    """A whole layer's rate: all its multiply-adds over the sum of its linears' times."""
    macs = [m * n * k for _, n, k, _ in linears]
    return sum(macs) / sum(w / (r * 1e9) for w, (*_, r) in zip(macs, linears, strict=True)) / 1e9


def render_efficiency(e: Efficiency) -> str:
    """A markdown table: one row per (scheme, M), a column per linear and the whole layer."""
    linears = next(iter(e.rows.values()))
    lines = [
        f"int8 peak: {e.peak_gmacs:.0f} GMAC/s ({e.variant}'s dot-peak loop on {e.threads} threads); linears of "
        f"one {e.shape} layer on the native kernels, activation quantization included, GMAC/s (% of peak)",
        "",
        "| scheme | M | " + " | ".join(f"{name} {n}x{k}" for name, n, k, _ in linears) + " | layer |",
        "|---|---|" + "---|" * (len(linears) + 1),
    ]
    for (label, m), row in e.rows.items():
        cells = [f"{r:.0f} ({100 * r / e.peak_gmacs:.0f}%)" for *_, r in row]
        layer = layer_gmacs(row, m)
        lines.append(
            f"| {label} | {m} | " + " | ".join(cells) + f" | **{layer:.0f} ({100 * layer / e.peak_gmacs:.0f}%)** |"
        )
    return "\n".join(lines)
