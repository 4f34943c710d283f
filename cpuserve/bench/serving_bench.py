"""`cpuserve bench serving`: cpuserve's server against llama-server under concurrent streams.

Both servers get the same weights, the same threads and the same requests: random token-id
prompts (seeded, identical for both), `ignore_eos` so every request generates exactly its
max_tokens, streamed with `include_usage`. Output tok/s counts `usage.completion_tokens` (a
streamed chunk can carry several tokens) over the wall time from the first request sent to the
last one finished; TTFT is measured per request to its first streamed text. Each concurrency is
a closed loop: N clients, each sending its requests one after another.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from cpuserve.bench.server_process import free_port, running_server, server_process


@dataclass(frozen=True)
class Workload:
    name: str
    prompt_tokens: int
    output_tokens: int


WORKLOADS = {
    "prompt-heavy": Workload("prompt-heavy", 256, 64),
    "decode-heavy": Workload("decode-heavy", 32, 128),
}
STREAMS = (1, 4, 8, 16)


def requests_per_stream(streams: int) -> int:
    """Enough requests that the run is not one request's luck, few enough to finish in minutes."""
    return {1: 3, 4: 2}.get(streams, 1)


@dataclass
class Point:
    """One engine, one workload, one concurrency."""

    streams: int
    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    resent: int = 0  # requests sent again after the server closed their connection unanswered

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def ttft_pct(self, q: float) -> float:
        values = sorted(self.ttft)
        if not values:
            return float("nan")
        return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def prompt_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    """Token ids clear of the specials both vocabularies keep at their ends."""
    return [rng.randrange(256, vocab - 512) for _ in range(n)]


async def _one(client, workload: Workload, ids: list[int], point: Point) -> None:  # type: ignore[no-untyped-def]
    """One streamed request. A connection the server closed before any response (a kept-alive one it
    had dropped: llama-server did, five times in one suite run) is sent once more and counted in
    `point.resent`; TTFT still counts from the first send."""
    import httpx

    body = {
        "prompt": ids,
        "max_tokens": workload.output_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.monotonic()
    first = None
    usage = None
    for attempt in range(2):
        answered = False
        try:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                answered = True
                if r.status_code != 200:
                    point.errors.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if first is None and any(c.get("text") for c in event.get("choices") or []):
                        first = time.monotonic()
                    usage = event.get("usage") or usage
            break
        except httpx.RemoteProtocolError as exc:
            if not answered and attempt == 0:
                point.resent += 1
                continue
            point.errors.append(f"{type(exc).__name__}: {exc}")
            return
        except Exception as exc:  # a transport failure is a result to report, not a crash
            point.errors.append(f"{type(exc).__name__}: {exc}")
            return
    if not usage or usage.get("completion_tokens") != workload.output_tokens:
        point.errors.append(f"usage {usage} for max_tokens {workload.output_tokens}")
        return
    point.requests += 1
    point.tokens += usage["completion_tokens"]
    point.ttft.append((first or time.monotonic()) - start)


async def measure(base: str, workload: Workload, streams: int, vocab: int, seed: int) -> Point:
    """N closed-loop clients; prompts drawn from `seed` so both engines see the same ones."""
    import logging

    import httpx  # a dev dependency (./run setup installs it)

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    point = Point(streams)
    per = requests_per_stream(streams)
    rng = random.Random(seed)
    prompts = [[prompt_ids(rng, workload.prompt_tokens, vocab) for _ in range(per)] for _ in range(streams)]
    async with httpx.AsyncClient(base_url=base, timeout=900, limits=httpx.Limits(max_connections=64)) as client:
        await _one(client, workload, prompt_ids(random.Random(seed - 1), workload.prompt_tokens, vocab), Point(1))

        async def stream(mine: list[list[int]]) -> None:
            for ids in mine:
                await _one(client, workload, ids, point)

        start = time.monotonic()
        await asyncio.gather(*(stream(p) for p in prompts))
        point.seconds = time.monotonic() - start
    return point


@contextmanager
def llama_server(binary: Path, gguf: Path, threads: int, slots: int, log: Path) -> Iterator[str]:
    """llama-server with `slots` parallel sequences of 1024 tokens each, on `threads` threads."""
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads)]
    cmd += ["-tb", str(threads), "-np", str(slots), "-c", str(1024 * slots), "--no-webui"]
    with server_process(cmd, port, log=log, timeout=300) as (base, _):
        yield base


def run_engine(base: str, workloads: list[Workload], vocab: int, seed: int) -> dict[str, list[Point]]:
    # A seed per workload and concurrency: no prompt is another's prefix (no prefix-cache hits).
    return {
        w.name: [asyncio.run(measure(base, w, s, vocab, seed + 1000 * s + 7 * w.prompt_tokens)) for s in STREAMS]
        for w in workloads
    }


def _vocab(model: str) -> int:
    from cpuserve.model.source import ModelSource

    return ModelSource.open(Path(model)).spec.vocab_size


@dataclass
class ServingResult:
    label: str
    ours: dict[str, list[Point]]
    peer: dict[str, list[Point]] | None


def run(
    model: str,
    label: str,
    gguf: str | None,
    llama_server_bin: str | None,
    serve_args: list[str],
    threads: int,
    workloads: list[Workload],
    env: dict[str, str],
    work: Path,
    seed: int = 0,
) -> ServingResult:
    """cpuserve first, then llama-server on `gguf` (when given), never both at once."""
    model_path = model
    vocab = _vocab(model_path)
    work.mkdir(parents=True, exist_ok=True)
    args = [model_path, "--max-num-seqs", "16", *serve_args]
    ours_env = {**env, "CPUSERVE_NUM_THREADS": str(threads)}
    with running_server(args, ours_env, log=work / "cpuserve-serving.log") as base:
        ours = run_engine(base, workloads, vocab, seed)
    peer = None
    if gguf and llama_server_bin:
        with llama_server(Path(llama_server_bin), Path(gguf), threads, 16, work / "llama-server.log") as base:
            peer = run_engine(base, workloads, vocab, seed)
    return ServingResult(label, ours, peer)


def render_table(results: list[ServingResult]) -> str:
    """One markdown table for several models, then any errors."""
    lines = [
        "| model | workload | streams | cpuserve tok/s | llama-server tok/s | ratio "
        "| cpuserve TTFT p50 / p90 | llama-server TTFT p50 / p90 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    errors, resent = [], []
    for result in results:
        for name, points in result.ours.items():
            for i, p in enumerate(points):
                q = result.peer[name][i] if result.peer else None
                ratio = f"{p.tok_s / q.tok_s:.2f}x" if q and q.tok_s else "-"
                peer = f"{q.tok_s:.1f}" if q else "-"
                peer_ttft = f"{q.ttft_pct(0.5):.2f} / {q.ttft_pct(0.9):.2f} s" if q else "-"
                lines.append(
                    f"| {result.label} | {name} | {p.streams} | {p.tok_s:.1f} | {peer} | {ratio} "
                    f"| {p.ttft_pct(0.5):.2f} / {p.ttft_pct(0.9):.2f} s | {peer_ttft} |"
                )
        errors += [
            f"{engine}, {result.label}, {name}, {p.streams} streams: {e}"
            for engine, pts in (("cpuserve", result.ours), ("llama-server", result.peer or {}))
            for name, ps in pts.items()
            for p in ps
            for e in p.errors
        ]
        resent += [
            f"resent: {engine}, {result.label}, {name}, {p.streams} streams: {p.resent} request(s) sent again "
            "after the server closed the connection without a response"
            for engine, pts in (("cpuserve", result.ours), ("llama-server", result.peer or {}))
            for name, ps in pts.items()
            for p in ps
            if p.resent
        ]
    scaling = [line for result in results for line in _scaling(result)]
    lines += (["", *scaling] if scaling else []) + [f"error: {e}" for e in errors[:10]] + resent
    return "\n".join(lines)


def _scaling(result: ServingResult, many: int = 8) -> list[str]:
    """How far batching carries each server: output tok/s at `many` streams over one stream's."""

    def ratio(points: list[Point]) -> str:
        by = {p.streams: p.tok_s for p in points}
        return f"{by[many] / by[1]:.2f}x" if by.get(1) and by.get(many) else "-"

    return [
        f"- {result.label}, {name}: {many} streams / 1 stream = cpuserve **{ratio(points)}**"
        + (f", llama-server {ratio(result.peer[name])}" if result.peer and name in result.peer else "")
        for name, points in result.ours.items()
        if any(p.streams == many for p in points)
    ]


def render(result: ServingResult, command: str, isa: str) -> str:
    return f"command: `{command}`; host ISA: {isa}\n\n" + render_table([result])


def host_isa() -> str:
    """The kernel variant cpuserve picks here (CPUSERVE_ISA when set) and torch's CPU capability."""
    import torch

    from cpuserve.kernels import selected_variant

    forced = " (CPUSERVE_ISA)" if os.environ.get("CPUSERVE_ISA") else ""
    aten = os.environ.get("ATEN_CPU_CAPABILITY")
    torch_isa = f"{torch.backends.cpu.get_cpu_capability()}" + (" (ATEN_CPU_CAPABILITY)" if aten else "")
    return f"cpuserve kernels {selected_variant()}{forced}, torch {torch_isa}"
