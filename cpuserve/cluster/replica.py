"""One cpuserve engine as a Ray Serve replica: `cpuserve serve`'s engine and app, in a Ray actor.

The replica claims its own cores (cluster/cores.py) before torch is imported, builds the server
with the serve flags it was given (server/serve.build_server: the same checks, load and app as
`cpuserve serve`), and answers forwarded requests through that app. Ray restarts it when its
process dies or `check_health` raises (a fatal engine error).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

from cpuserve.cluster.cores import claim_cores
from cpuserve.cluster.forwarding import ForwardedRequest, ResponseStart, run_asgi

log = logging.getLogger("cpuserve")


def serve_args(argv: list[str]) -> argparse.Namespace:
    """Parse serve flags exactly as `cpuserve serve` does."""
    from cpuserve.server.serve_flags import add_serve_args

    parser = argparse.ArgumentParser(prog="cpuserve serve")
    add_serve_args(parser)
    return parser.parse_args(argv)


def kv_share_gib(mem_available: int, cores: int, all_cores: int) -> float:
    """A replica's KV cache when the user set none: its cores' share of half the available memory.

    One engine alone sizes its cache from all available memory; replicas sharing a machine would
    each take that. Half leaves room for the replicas' weights and the rest of the machine.
    """
    return max(0.25, mem_available / 1024**3 * 0.5 * cores / max(1, all_cores))


def usable_cores_by_node(machine: Any) -> dict[int, list[int]]:
    """Physical cores this process may use, one per core (big cores where the CPU has little ones), by NUMA node."""
    allowed = list(machine.resources.allowed_cpus)
    big = [c for c in allowed if c not in machine.cpu.little] or allowed
    cores = set(machine.cpu.physical_cores(big))
    by_node: dict[int, list[int]] = {}
    for c in machine.cpu.cpus:
        if c.id in cores:
            by_node.setdefault(c.node, []).append(c.id)
    return by_node


def normal_priority() -> str:
    """Undo Ray's worker niceness (15 by default) for every thread of this process; what happened, in words.

    At nice 15 an engine replica gets a small share of a core that anything at nice 0 also wants
    (a client, Ray's own daemons). Seen here under 16 streams (`top`, docs/benchmarks.md "Past one
    machine"): at nice 15 the two replicas used 52% and 29% of their cores on an unsaturated machine;
    at nice 0 the busier one (a routing bug fixed since kept the other idle) used 71%. Not measured
    apart from that fix. Threads started later inherit their creator's value.
    """
    before = os.getpriority(os.PRIO_PROCESS, 0)
    if before <= 0:
        return f"nice {before}"
    try:
        for tid in os.listdir("/proc/self/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), 0)
    except (PermissionError, FileNotFoundError, ProcessLookupError) as exc:
        return (
            f"nice {before} (Ray's worker niceness; could not lower it: {exc}): start Ray with "
            "RAY_worker_niceness=0 so the engine is not starved by everything else on its cores"
        )
    return f"nice {before} -> 0"


class EngineReplica:
    """A Ray Serve deployment class (cluster/app.py wraps it): construct with the serve flags and thread count."""

    def __init__(self, argv: list[str], threads: int) -> None:
        logging.basicConfig(level=logging.INFO, format="[cpuserve] %(message)s", stream=sys.stderr, force=True)
        from cpuserve.platform.machine import detect_machine
        from cpuserve.platform.overrides import KVCACHE_SPACE
        from cpuserve.platform.sysfs import format_cpulist

        machine = detect_machine()
        by_node = usable_cores_by_node(machine)
        cores, why = claim_cores(by_node, threads)
        why += f"; {normal_priority()}"
        # The thread plan reads these like a user's settings: pinned before torch (and OpenMP) load.
        os.environ["CPUSERVE_THREADS_BIND"] = format_cpulist(cores)
        if not any(os.environ.get(name) for name in KVCACHE_SPACE):
            share = kv_share_gib(machine.resources.mem_available, len(cores), sum(map(len, by_node.values())))
            os.environ[KVCACHE_SPACE[0]] = f"{share:.2f}"
            why += f"; KV cache {share:.2f} GiB, the cores' share of half the available memory"
        log.info("replica on %s (pid %d): cores %s (%s)", socket.gethostname(), os.getpid(), format_cpulist(cores), why)
        from ray import serve

        from cpuserve.cli.common import platform_plan
        from cpuserve.server.serve import build_server

        self.fatal: BaseException | None = None
        self.cores = cores
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.node = socket.gethostname()
        args = serve_args(argv)
        self.built = build_server(args, platform_plan, on_fatal=self._on_fatal)
        self.app = self.built.app
        self.server = self.app.state.server
        self.log_stats = not args.disable_log_stats
        self._stats_log: Any = None  # started on the actor's event loop by the first request

    def _on_fatal(self, exc: BaseException) -> None:
        self.fatal = exc  # check_health raises from now on: Ray replaces this replica

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[str | ResponseStart | bytes]:
        """The replica's id first (so a retry can avoid it), then the response start, then body chunks."""
        if self._stats_log is None:
            from cpuserve.server.stats_log import start_stats_log

            self._stats_log = start_stats_log(self.built.engine, self.log_stats) or False
        yield self.replica
        # Closed at once when Ray cancels this generator (the client left): the app sees it go.
        async with contextlib.aclosing(run_asgi(self.app, request)) as response:
            async for item in response:
                yield ResponseStart(item[0], item[1], self.replica) if isinstance(item, tuple) else item

    def check_health(self) -> None:
        if self.fatal is not None or not self.built.engine.alive:
            raise RuntimeError(f"the engine stopped: {self.fatal}")

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the router weighs besides its own in-flight counts (a few numbers: Ray sends them to
        every handle and proxy whenever they change)."""
        stats = self.built.engine.stats()
        return {"running": stats.num_running, "waiting": stats.num_waiting, "kv_usage": round(stats.kv_usage, 3)}

    async def report(self) -> dict[str, Any]:
        """This replica for the ingress's /health and /metrics (asked by broadcast, on demand)."""
        stats = self.built.engine.stats()
        return {
            "replica": self.replica,
            "node": self.node,
            "pid": os.getpid(),
            "cores": self.cores,
            "running": stats.num_running,
            "waiting": stats.num_waiting,
            "kv_usage": stats.kv_usage,
            "prefix_queries": stats.prefix_queries,
            "prefix_hits": stats.prefix_hits,
            "generation_tokens": stats.generation_tokens,
            "metrics": self.server.metrics.render(stats).decode(),
        }

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.built.engine.shutdown()
