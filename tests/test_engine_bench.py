"""`cpuserve bench engine` with several KV cache dtypes: one model loaded, an engine (and cache) per
dtype, their runs interleaved so drift falls on each alike."""

from __future__ import annotations

from cpuserve.bench import engine_bench
from cpuserve.bench.engine_bench import DecodeRun, run_engine_benches, run_per_kv_cache_dtype


def test_runs_alternate_their_order_and_report_medians(monkeypatch):
    calls = []
    speeds = {"a": iter([10.0, 30.0, 20.0] * 3), "b": iter([5.0, 7.0, 6.0] * 3)}

    def fake_run(engine, concurrency, new_tokens, prompt_words, logprobs):
        calls.append((engine, concurrency, logprobs))
        if new_tokens == 4:  # the warm-up
            return DecodeRun(concurrency, 0, 0.0, 0.0)
        return DecodeRun(concurrency, int(next(speeds[engine])), 1.0, 0.0)

    monkeypatch.setattr(engine_bench, "decode_run", fake_run)
    results = run_engine_benches({"a": "a", "b": "b"}, [8], 16, 10, 3)  # type: ignore[dict-item]
    timed = [(e, lp) for e, c, lp in calls[2:]]
    assert calls[:2] == [("a", 1, None), ("b", 1, None)]
    # decode at 8, then logprobs none, then logprobs 20: each a b / b a / a b
    order = ["a", "b", "b", "a", "a", "b"]
    assert timed == [(e, None) for e in order] + [(e, None) for e in order] + [(e, 20) for e in order]
    assert results["a"]["decode_tok_s"] == {8: 20.0} and results["b"]["decode_tok_s"] == {8: 6.0}
    assert results["a"]["logprobs"]["cost_pct"] == 0.0


def test_one_model_serves_every_cache_dtype(smol_dir, monkeypatch):
    from cpuserve.model import loader

    loads = []
    real = loader.load_model
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: loads.append(a) or real(*a, **k))
    results, dtype = run_per_kv_cache_dtype(smol_dir, "float32", ["auto", "bfloat16", "int8"], 512, [1, 2], 6, 8, 1)
    assert len(loads) == 1 and dtype == "float32"
    assert list(results) == ["auto", "bfloat16", "int8"]
    assert all(results[kv]["decode_tok_s"][c] > 0 for kv in results for c in (1, 2))
