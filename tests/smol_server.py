"""The float32 server (float head) of the bundled model that the API tests start: greedy answers
comparable across routes and with transformers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from cpuserve.bench.server_process import running_server

MODEL = "smol"


@contextlib.contextmanager
def smol_server(
    smol_dir: Path, cache_dir: Path, log: Path, *flags: str, key: str | None = None, max_num_seqs: int = 8
) -> Iterator[str]:
    """The server's base URL while it runs (`key`: its API key; `flags`: more serve flags)."""
    args = [str(smol_dir), "--dtype", "float32", "--served-model-name", MODEL, "--max-model-len", "2048"]
    args += ["--quantize-lm-head", "none"]  # greedy answers compared with transformers' float head
    args += ["--max-num-seqs", str(max_num_seqs), *(["--api-key", key] if key else []), *flags]
    with running_server(args, {"CPUSERVE_CACHE_DIR": str(cache_dir), "VLLM_CPU_KVCACHE_SPACE": "1"}, log) as base:
        yield base
