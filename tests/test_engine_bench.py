"""`cpuserve bench engine` with several KV cache dtypes: one model loaded, an engine (and cache) per
dtype, their runs interleaved so drift falls on each alike."""

from __future__ import annotations

import pytest

from cpuserve.bench import engine_bench
from cpuserve.bench.engine_bench import DecodeRun, run_engine_benches, run_per_kv_cache_dtype


def test_runs_alternate_their_order_and_report_medians(monkeypatch):
    calls = []

    def fake_run(engine, concurrency, new_tokens, prompt_words, logprobs):
        calls.append((engine, concurrency, logprobs))
        # a host that slows down run after run: only interleaving keeps it out of the comparisons
        speed = 100.0 - len(calls) - (10.0 if logprobs else 0.0) - (20.0 if engine == "b" else 0.0)
        return DecodeRun(concurrency, int(speed * 10), 10.0, 0.0)

    monkeypatch.setattr(engine_bench, "decode_run", fake_run)
    results = run_engine_benches({"a": "a", "b": "b"}, [8], 16, 10, 2)  # type: ignore[dict-item]
    assert calls[:2] == [("a", 1, None), ("b", 1, None)]  # warm-ups
    timed = [(e, lp) for e, c, lp in calls[2:]]
    assert timed[:4] == [("a", None), ("b", None), ("b", None), ("a", None)]  # decode at 8: a b, b a
    # logprobs cost: a (plain, 20) b (plain, 20), then b (20, plain) a (20, plain)
    assert timed[4:] == [("a", None), ("a", 20), ("b", None), ("b", 20), ("b", 20), ("b", None), ("a", 20), ("a", None)]
    assert results["a"]["decode_tok_s"] == {8: 95.5} and results["b"]["decode_tok_s"] == {8: 75.5}
    for name in "ab":  # drift cancels: the cost is the 10 tok/s logprobs=20 costs here
        lp = results[name]["logprobs"]
        assert lp["none_tok_s"] - lp["logprobs20_tok_s"] == pytest.approx(10.0)


def test_one_model_serves_every_cache_dtype(smol_dir, monkeypatch):
    from cpuserve.model import loader

    loads = []
    real = loader.load_model
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: loads.append(a) or real(*a, **k))
    results, dtype = run_per_kv_cache_dtype(smol_dir, "float32", ["auto", "bfloat16", "int8"], 512, [1, 2], 6, 8, 1)
    assert len(loads) == 1 and dtype == "float32"
    assert list(results) == ["auto", "bfloat16", "int8"]
    assert all(results[kv]["decode_tok_s"][c] > 0 for kv in results for c in (1, 2))
