"""`cpuserve bench cluster`: the same cores as one server or as replicas behind the Ray ingress.

One run, one machine, one after another (never two at once): `cpuserve serve` with T threads and
with 1; `cpuserve cluster` with one replica of 1 thread and with T replicas of 1 thread each (a
one-machine Ray). Same closed-loop streams and prompts as `cpuserve bench serving`. What it shows:
whether replicas beat one wider engine on the same cores, and what the ingress adds to time to
first token (the 1-replica cluster against the 1-thread server at one stream).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cpuserve.bench.server_process import free_port, running_server
from cpuserve.bench.serving_bench import STREAMS, Point, Workload, _vocab, run_engine


@contextmanager
def cluster_process(
    args: list[str], replicas: int, env: dict[str, str], log: Path, timeout: float = 300, key: str | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:
    """`cpuserve cluster ARGS` on 127.0.0.1: (base URL, process) once /health lists `replicas`
    replicas (`key`: the cluster's API key, which /health's details need); stopped afterwards."""
    import httpx  # a dev dependency (./run setup installs it)

    port = free_port()
    cmd = [sys.executable, "-m", "cpuserve", "cluster", *args, "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"cpuserve cluster exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                r = httpx.get(base + "/health", headers=headers, timeout=70)
                view = r.json()["replicas"] if r.status_code == 200 else []
                if len(view) == replicas and all("pid" in v for v in view):
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {replicas} healthy replica(s) in {timeout:.0f} s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run(model: str, threads: int, workloads: list[Workload], work: Path, seed: int = 0) -> dict[str, dict]:
    """Four set-ups on the same cores, in turn: label -> workload -> points (one per stream count)."""
    vocab = _vocab(model)
    work.mkdir(parents=True, exist_ok=True)
    flags = [model, "--max-num-seqs", "16"]
    results: dict[str, dict] = {}
    for n in (threads, 1):
        label = f"cpuserve serve, {n} thread(s)"
        with running_server(flags, {"CPUSERVE_NUM_THREADS": str(n)}, log=work / f"serve-{n}.log") as base:
            results[label] = run_engine(base, workloads, vocab, seed)
    for n in (1, threads):
        label = f"cpuserve cluster, {n} replica(s) x 1 thread"
        args = [*flags, "--replicas", str(n), "--threads-per-replica", "1"]
        with cluster_process(args, n, {}, work / f"cluster-{n}.log") as (base, _):
            results[label] = run_engine(base, workloads, vocab, seed)
    return results


def render(results: dict[str, dict], command: str, isa: str, threads: int) -> str:
    lines = [
        f"command: `{command}`; host ISA: {isa}; {threads} cores in every set-up",
        "",
        "| set-up | workload | " + " | ".join(f"{s} stream(s) tok/s" for s in STREAMS) + " | TTFT p50 at 1 stream |",
        "|---|---|" + "---|" * len(STREAMS) + "---|",
    ]
    errors: list[str] = []
    for label, by_workload in results.items():
        for name, points in by_workload.items():
            cells = " | ".join(f"{p.tok_s:.1f}" for p in points)
            lines.append(f"| {label} | {name} | {cells} | {points[0].ttft_pct(0.5) * 1000:.0f} ms |")
            errors += [e for p in points for e in p.errors]
    serve1 = next((v for k, v in results.items() if k.startswith("cpuserve serve, 1 ")), None)
    cluster1 = next((v for k, v in results.items() if k.startswith("cpuserve cluster, 1 ")), None)
    if serve1 and cluster1:
        lines.append("")
        for name in serve1:
            a: Point = serve1[name][0]
            b: Point = cluster1[name][0]
            lines.append(
                f"ingress's added TTFT ({name}, 1 stream, p50): {(b.ttft_pct(0.5) - a.ttft_pct(0.5)) * 1000:+.0f} ms"
            )
    lines += [f"error: {e}" for e in errors[:10]]
    return "\n".join(lines)
