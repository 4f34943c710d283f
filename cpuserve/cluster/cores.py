"""Which cores a replica pins its threads to: disjoint from the other replicas on the same machine.

Ray counts CPUs per node but does not say which cores an actor may use; two replicas left to the
kernel share cores and each one's OpenMP pool stalls on the other's. So each replica claims
physical cores in a machine-wide file of its user's (under a lock), preferring one NUMA node, and
releases them by dying: claims of processes that no longer exist (pid and start time) are dropped
by the next claimer.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections import Counter
from pathlib import Path

CLAIMS_FILE = Path(
    os.environ.get("CPUSERVE_CLUSTER_CLAIMS") or f"/tmp/cpuserve-{os.getuid()}/cluster-cores.json"
)  # per user: another user's replicas neither read nor block these


def choose_cores(cores_by_node: dict[int, list[int]], taken: list[int], count: int) -> tuple[list[int], str]:
    """`count` cores, free ones first, all from one NUMA node when one has enough; and why.

    `cores_by_node`: the usable physical cores of each node; `taken`: cores other replicas hold
    (a core may appear once per holder).
    """
    use = Counter(taken)
    free = {node: [c for c in cores if use[c] == 0] for node, cores in cores_by_node.items()}
    fits = [node for node, cores in sorted(free.items()) if len(cores) >= count]
    if fits:
        node = min(fits, key=lambda n: (len(free[n]), n))  # the tightest fit keeps big holes for big replicas
        where = f"NUMA node {node}" if len(cores_by_node) > 1 else "this machine"
        return free[node][:count], f"{count} free core(s) of {where}"
    every = [c for _, cores in sorted(cores_by_node.items()) for c in cores]
    chosen = sorted(every, key=lambda c: use[c])[:count]  # stable: node order among equally used cores
    shared = [c for c in chosen if use[c]]
    if shared:
        return chosen, f"only {count - len(shared)} free core(s) left: sharing {len(shared)} with other replicas"
    return chosen, f"{count} free core(s) across NUMA nodes"


def process_start(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), or None if no such process: a pid reused by a
    later process does not keep a dead replica's claim."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22, counted after the command name


def claim_cores(cores_by_node: dict[int, list[int]], count: int, path: Path = CLAIMS_FILE) -> tuple[list[int], str]:
    """Claim cores for this process in the machine-wide file; see choose_cores."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stored = json.loads(f.read() or "{}")
            claims = {int(pid): (c["start"], c["cores"]) for pid, c in stored.items()}
        except (ValueError, TypeError, KeyError, AttributeError):
            claims = {}  # unreadable: start again (the holders' processes still pin themselves)
        me = os.getpid()
        claims = {pid: c for pid, c in claims.items() if pid != me and process_start(pid) == c[0]}
        chosen, why = choose_cores(cores_by_node, [core for _, cores in claims.values() for core in cores], count)
        claims[me] = (process_start(me), chosen)
        f.seek(0)
        f.truncate()
        f.write(json.dumps({str(pid): {"start": start, "cores": cores} for pid, (start, cores) in claims.items()}))
    return chosen, why
