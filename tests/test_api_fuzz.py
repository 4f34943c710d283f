"""Property-based requests generated from the server's own OpenAPI schema (schemathesis): no input
may produce a 5xx, and the server still answers a normal request afterwards."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx

from cpuserve.bench.server_process import running_server

KEY = "fuzz-key"
MAX_EXAMPLES = 30  # per operation and phase; about a minute here (200 ran 1551 cases clean)


def test_schemathesis_finds_no_server_error(smol_dir, cache_dir, tmp_path):
    args = [str(smol_dir), "--max-model-len", "128", "--max-num-seqs", "8", "--api-key", KEY]
    st = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert st, "schemathesis is a dev dependency (pyproject.toml)"
    env = {"CPUSERVE_CACHE_DIR": str(cache_dir), "VLLM_CPU_KVCACHE_SPACE": "1"}
    with running_server(args, env, tmp_path / "server.log") as base:
        result = subprocess.run(
            [
                st,
                "run",
                f"{base}/openapi.json",
                "--header",
                f"Authorization: Bearer {KEY}",
                "--checks",
                "not_a_server_error",
                "--max-examples",
                str(MAX_EXAMPLES),
                "--request-timeout",
                "60",
                "--seed",
                "20261129",
                "--workers",
                "2",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,  # its crash cache stays out of the checkout
        )
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
        assert "passed" in result.stdout
        ok = httpx.post(
            base + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=60,
        )
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
    assert "Traceback" not in (tmp_path / "server.log").read_text()
