"""`cpuserve bench engine`: aggregate decode throughput at several concurrencies, and the cost of
logprobs=20, measured in one run (medians of repeats, interleaved so drift hits both sides), for one
or several KV cache dtypes side by side (one model, an engine and cache per dtype, runs interleaved)."""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

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


def run_engine_benches(
    engines: dict[str, LLMEngine], concurrencies: list[int], new_tokens: int, prompt_words: int, repeats: int
) -> dict[str, dict]:
    """Each engine's decode tok/s per concurrency and logprobs=20 cost. Every timed run is interleaved
    with the others of its comparison (engines A B, then B A, ...; plain and logprobs=20 likewise) so
    that the host's drift falls on each side alike."""
    names = list(engines)
    for engine in engines.values():
        decode_run(engine, 1, 4, prompt_words, None)  # warm-up

    def interleaved(concurrency: int, modes: list[int | None]) -> dict[tuple[str, int | None], list[float]]:
        runs: dict[tuple[str, int | None], list[float]] = {(n, m): [] for n in names for m in modes}
        for r in range(repeats):
            for name in names if r % 2 == 0 else names[::-1]:
                for mode in modes if r % 2 == 0 else modes[::-1]:
                    run = decode_run(engines[name], concurrency, new_tokens, prompt_words, mode)
                    runs[name, mode].append(run.tok_s)
        return runs

    results: dict[str, dict] = {name: {"decode_tok_s": {}} for name in names}
    for c in concurrencies:
        for (name, _), runs in interleaved(c, [None]).items():
            results[name]["decode_tok_s"][c] = statistics.median(runs)
    c = max(1, min(8, max(concurrencies)))
    pairs = interleaved(c, [None, 20])
    for name in names:
        plain_m, lp_m = statistics.median(pairs[name, None]), statistics.median(pairs[name, 20])
        results[name]["logprobs"] = {
            "concurrency": c,
            "none_tok_s": plain_m,
            "logprobs20_tok_s": lp_m,
            "cost_pct": 100.0 * (plain_m - lp_m) / plain_m if plain_m else 0.0,
        }
    return results


def run_per_kv_cache_dtype(
    model_dir: Path,
    dtype: str,
    kv_cache_dtypes: list[str],
    max_model_len: int,
    concurrencies: list[int],
    new_tokens: int,
    prompt_words: int,
    repeats: int,
) -> tuple[dict[str, dict], str]:
    """One engine per KV cache dtype over one loaded model (each with its own cache, committed only as
    it fills), measured interleaved; the caller checks every name first (cli/bench.py) so a typo in
    the last one costs no minutes."""
    from cpuserve.engine import EngineConfig
    from cpuserve.platform.machine import detect_machine

    machine = detect_machine()  # before the model is loaded: every engine's plan sees the same memory
    engines: dict[str, LLMEngine] = {}
    model = None
    for kv in kv_cache_dtypes:
        config = EngineConfig(max_model_len=max_model_len, max_num_seqs=max(concurrencies), kv_cache_dtype=kv)
        engines[kv] = LLMEngine.from_model_dir(model_dir, config, dtype, machine=machine, model=model)
        model = engines[kv].model
    gc.collect()  # as `serve` does after loading (server/serve.py)
    gc.freeze()
    try:
        results = run_engine_benches(engines, concurrencies, new_tokens, prompt_words, repeats)
    finally:
        gc.unfreeze()  # the engines' cycles collectable again, whatever happened
    model_dtype = str(next(iter(engines.values())).model.dtype).removeprefix("torch.")
    engines.clear()
    gc.collect()
    return results, model_dtype


def render(model: str, dtype: str, threads: int, results: dict[str, dict]) -> str:
    """One column per KV cache dtype (results: dtype -> run_engine_benches' result), the first the baseline."""
    kvs = list(results)
    first = results[kvs[0]]["decode_tok_s"]
    head = " | ".join(f"KV {kv} tok/s" for kv in kvs) + "".join(f" | {kv} / {kvs[0]}" for kv in kvs[1:])
    lines = [
        f"model {model}, {dtype}, {threads} threads",
        "",
        f"| concurrency | {head} |",
        "|---|" + "---|" * (2 * len(kvs) - 1),
    ]
    for c in first:
        cells = [f"{results[kv]['decode_tok_s'][c]:.1f}" for kv in kvs]
        cells += [f"{results[kv]['decode_tok_s'][c] / first[c]:.2f}x" for kv in kvs[1:]]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines.append("")
    for kv in kvs:
        lp = results[kv]["logprobs"]
        lines.append(
            f"KV {kv}: logprobs=20 at concurrency {lp['concurrency']}: {lp['logprobs20_tok_s']:.1f} tok/s vs "
            f"{lp['none_tok_s']:.1f} without, cost {lp['cost_pct']:.1f}%"
        )
    return "\n".join(lines)
