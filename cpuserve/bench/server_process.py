"""Start a real `cpuserve serve` process on 127.0.0.1 (for tests and benchmarks), and stop it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PROCESSES: dict[str, subprocess.Popen] = {}  # base URL -> the server process, while it runs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(
    args: list[str],
    env: dict[str, str] | None = None,
    log: Path | None = None,
    poll: float = 0.2,
    entry: list[str] | None = None,
) -> Iterator[str]:
    """Yield the base URL once /health answers 200; terminate the process afterwards.

    `entry` replaces `python -m cpuserve` (tests start a server with faults injected this way);
    PROCESSES[base URL] is the process while it runs."""
    port = free_port()
    entry = entry or [sys.executable, "-m", "cpuserve"]
    cmd = [*entry, "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    PROCESSES[base] = proc
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                text = log.read_text() if log else ""
                raise RuntimeError(f"server exited with {proc.returncode}:\n{text}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become healthy in 180 s")
            time.sleep(poll)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        PROCESSES.pop(base, None)
        if log:
            out.close()
