"""Ray Serve request router for cpuserve replicas: prefix affinity first, then the least-loaded replica.

Ray Serve runs this in the process that holds the deployment handle (the ingress). For each request
it ranks the live replicas: the one that last served the longest shared prompt prefix (its prefix
cache then hits), unless it is much busier than the least-loaded one; then the rest from least to
most loaded, by the requests this router has in flight on each and then KV-cache use (each
replica's `record_routing_stats`). A retry names the replicas it must avoid.
Ray's base class handles the rest: probing queue lengths, skipping full replicas, backing off.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

import cpuserve.cluster.live as live  # by reference: this module travels by value (cluster/live.py)
from cpuserve.cluster.forwarding import ForwardedRequest
from cpuserve.cluster.prefix import PrefixTable

log = logging.getLogger("cpuserve.cluster")
PLACING_TTL_S = 10.0  # a choice not followed by a send within this long (cancelled, failed) stops counting


def replica_key(replica_id: ReplicaID) -> str:
    return replica_id.unique_id


def request_of(pending: PendingRequest | None) -> ForwardedRequest | None:
    if pending is None:
        return None
    return next((a for a in pending.args if isinstance(a, ForwardedRequest)), None)


def rank_replicas(load: dict[str, float], kv: dict[str, float], owner: str | None, imbalance: float) -> list[list[str]]:
    """Ranks of replica keys, best first: the prefix's owner alone (if it is within `imbalance`
    requests of the least loaded), then one rank per replica from least to most loaded (requests in
    flight, then KV-cache use, then key for a stable order)."""
    ordered = sorted(load, key=lambda k: (load[k], kv.get(k, 0.0), k))
    if owner in load and load[owner] - min(load.values()) <= imbalance:
        return [[owner], *([k] for k in ordered if k != owner)]
    return [[k] for k in ordered]


class PrefixAwareRouter(RequestRouter):
    """Prefix affinity within `imbalance` requests of the least-loaded replica, else least loaded."""

    def initialize_state(self, imbalance: int = 4, **_: Any) -> None:
        self.imbalance = imbalance
        self.prefixes = PrefixTable()
        self.prefix_routed = 0  # requests sent where their prefix was
        # Requests this router sent to each replica and not yet finished: exact and current, where
        # the replicas' own figures (record_routing_stats) are up to a second old.
        self.in_flight: dict[str, set[str]] = {}
        # Requests chosen for but not yet sent to a replica (request id -> replica, when): a burst of
        # requests is ranked one after another, and each must see the ones placed before it.
        self.placing: dict[str, tuple[str, float]] = {}
        live.ROUTERS.add(self)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        request = request_of(pending_request)
        avoid = set(request.avoid) if request else set()
        candidates = [r for r in candidate_replicas if replica_key(r.replica_id) not in avoid] or candidate_replicas
        if not candidates:
            return []
        now = time.monotonic()
        self.placing = {rid: p for rid, p in self.placing.items() if now - p[1] < PLACING_TTL_S}
        load: dict[str, float] = {}
        kv: dict[str, float] = {}
        for r in candidates:
            key = replica_key(r.replica_id)
            load[key] = float(len(self.in_flight.get(key, ())))
            kv[key] = float((r.routing_stats or {}).get("kv_usage", 0.0))
        request_id = pending_request.metadata.internal_request_id if pending_request is not None else None
        for rid, (key, _) in self.placing.items():
            if key in load and rid != request_id:
                load[key] += 1
        owner = self.prefixes.match(request.prefix, set(load))[0] if request is not None and request.prefix else None
        ranks = rank_replicas(load, kv, owner, self.imbalance)
        if request_id is not None:
            self.placing[request_id] = (ranks[0][0], now)
        by_key = {replica_key(r.replica_id): r for r in candidates}
        return [[by_key[k] for k in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request_id = pending_request.metadata.internal_request_id
        self.placing.pop(request_id, None)
        self.in_flight.setdefault(replica_key(replica_id), set()).add(request_id)
        request = request_of(pending_request)
        if request is not None and request.prefix:
            key = replica_key(replica_id)
            owner, _ = self.prefixes.match(request.prefix, {key})
            self.prefix_routed += owner == key
            self.prefixes.record(request.prefix, key)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Replicas scaled down, replaced after a failed health check or gone: forget what they held."""
        super().update_replicas(replicas)
        current = {replica_key(r.replica_id) for r in replicas}
        for key in [k for k in self.in_flight if k not in current]:
            self._forget(key)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.placing.pop(internal_request_id, None)
        self.in_flight.get(replica_key(replica_id), set()).discard(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_key(replica_id))
        log.warning("replica %s died: no more requests go to it", replica_key(replica_id))

    def _forget(self, key: str) -> None:
        """A replica gone holds nothing and runs nothing."""
        self.in_flight.pop(key, None)
        self.prefixes.forget(key)
        self.placing = {rid: p for rid, p in self.placing.items() if p[0] != key}
