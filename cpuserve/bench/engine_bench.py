"""`cpuserve bench engine`: aggregate decode throughput at several concurrencies, and the cost of
logprobs=20, measured in one run (medians of repeats, interleaved so drift hits both sides)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from cpuserve.engine.llm_engine import LLMEngine
from cpuserve.engine.sampling_params import SamplingParams

WORDS = "the of and to in is was for on that with as by at from his her an which or be are".split()


@dataclass
class DecodeRun:
    concurrency: int
    decode_tokens: int
    decode_seconds: float
    prefill_seconds: float

    @property
    def tok_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


def _prompt(i: int, length: int) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(length))


def decode_run(
    engine: LLMEngine, concurrency: int, new_tokens: int, prompt_words: int, logprobs: int | None
) -> DecodeRun:
    """Prefill `concurrency` prompts, then time the steps in which every sequence decodes."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=logprobs)
    for i in range(concurrency):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", _prompt(i, prompt_words), params)
    tokens, decode_s, prefill_s = 0, 0.0, 0.0
    while engine.has_unfinished():
        decoding = all(s.num_tokens - s.num_computed == 1 for s in engine.scheduler.running) and not (
            engine.scheduler.waiting
        )
        start = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - start
        if decoding and len(engine.scheduler.running) + sum(o.finished for o in outs) == concurrency:
            tokens += len(outs)
            decode_s += elapsed
        else:
            prefill_s += elapsed
    return DecodeRun(concurrency, tokens, decode_s, prefill_s)


def run_engine_bench(
    engine: LLMEngine, concurrencies: list[int], new_tokens: int, prompt_words: int, repeats: int
) -> dict:
    decode_run(engine, 1, 4, prompt_words, None)  # warm-up
    results = {}
    for c in concurrencies:
        runs = [decode_run(engine, c, new_tokens, prompt_words, None) for _ in range(repeats)]
        results[c] = statistics.median(r.tok_s for r in runs)
    c = max(1, min(8, max(concurrencies)))
    plain, with_lp = [], []
    for _ in range(repeats):
        plain.append(decode_run(engine, c, new_tokens, prompt_words, None).tok_s)
        with_lp.append(decode_run(engine, c, new_tokens, prompt_words, 20).tok_s)
    plain_m, lp_m = statistics.median(plain), statistics.median(with_lp)
    return {
        "decode_tok_s": results,
        "logprobs": {
            "concurrency": c,
            "none_tok_s": plain_m,
            "logprobs20_tok_s": lp_m,
            "cost_pct": 100.0 * (plain_m - lp_m) / plain_m if plain_m else 0.0,
        },
    }


def render(model: str, dtype: str, threads: int, result: dict) -> str:
    lines = [f"model {model}, {dtype}, {threads} threads", "", "| concurrency | aggregate decode tok/s |", "|---|---|"]
    for c, v in result["decode_tok_s"].items():
        lines.append(f"| {c} | {v:.1f} |")
    lp = result["logprobs"]
    lines += [
        "",
        f"logprobs=20 at concurrency {lp['concurrency']}: {lp['logprobs20_tok_s']:.1f} tok/s vs "
        f"{lp['none_tok_s']:.1f} without, cost {lp['cost_pct']:.1f}%",
    ]
    return "\n".join(lines)
