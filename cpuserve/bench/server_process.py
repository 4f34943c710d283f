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


def wait_healthy(base: str, proc: subprocess.Popen, log: Path | None, timeout: float, poll: float = 0.2) -> None:
    """Return once base/health answers 200; raise, with the log's tail, if the process exits first."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            text = log.read_text() if log else ""
            raise RuntimeError(f"server exited with {proc.returncode}:\n{text}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"server did not become healthy in {timeout:.0f} s")
        time.sleep(poll)


@contextmanager
def server_process(
    cmd: list[str],
    port: int,
    env: dict[str, str] | None = None,
    log: Path | None = None,
    timeout: float = 180,
    poll: float = 0.2,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Any HTTP server command listening on 127.0.0.1:port: (base URL, process) once /health
    answers; terminated (killed after 20 s) afterwards."""
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log, timeout, poll)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        if log:
            out.close()


@contextmanager
def running_server(
    args: list[str],
    env: dict[str, str] | None = None,
    log: Path | None = None,
    poll: float = 0.2,
    entry: list[str] | None = None,
) -> Iterator[str]:
    """`cpuserve serve ARGS`: yield the base URL once /health answers 200; terminate it afterwards.

    `entry` replaces `python -m cpuserve` (tests start a server with faults injected this way);
    PROCESSES[base URL] is the process while it runs."""
    port = free_port()
    entry = entry or [sys.executable, "-m", "cpuserve"]
    cmd = [*entry, "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    with server_process(cmd, port, env, log, poll=poll) as (base, proc):
        PROCESSES[base] = proc
        try:
            yield base
        finally:
            PROCESSES.pop(base, None)
