"""A bounded load test on loopback: 64 concurrent streaming clients against the bundled model.
Every response must be complete and well formed (checked event by event), with zero errors, and
the server's memory must stay within its KV cache plus a stated margin."""

from __future__ import annotations

from cpuserve.bench.load_test import check_stream, run_load

KV_GIB = 0.25
MARGIN_MIB = 512  # activations and workspace for 64 sequences, malloc arenas (measured: ~400 MiB)


def test_check_stream_rejects_malformed_streams():
    role = {"id": "a", "choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]}
    end = {"id": "a", "choices": [{"delta": {"content": "x"}, "finish_reason": "length"}]}
    usage = {"id": "a", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}
    assert check_stream([role, end, usage, "[DONE]"], 4) is None
    assert check_stream([role, end, usage], 4) == "stream did not end with [DONE]"
    assert "completion tokens" in check_stream([role, end, usage, "[DONE]"], 5)
    assert "finish reasons" in check_stream([role, usage, "[DONE]"], 4)
    assert "ids" in check_stream([role, {**end, "id": "b"}, usage, "[DONE]"], 4)
    assert "error event" in check_stream([role, {"error": {"message": "boom"}}, "[DONE]"], 4)


def test_64_streaming_clients_all_complete_without_errors(smol_dir, cache_dir):
    env = {"CPUSERVE_CACHE_DIR": str(cache_dir), "VLLM_CPU_KVCACHE_SPACE": str(KV_GIB)}
    result = run_load([str(smol_dir), "--max-num-seqs", "64"], env, clients=64, seconds=15, seed=1)
    assert result.errors == []
    assert result.completed >= 64  # every client finished at least one request
    start, peak = result.rss_mib[0][1], max(m for _, m in result.rss_mib)
    assert peak <= start + KV_GIB * 1024 + MARGIN_MIB, result.rss_mib
