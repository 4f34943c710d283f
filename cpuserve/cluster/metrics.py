"""The ingress's /metrics: every replica's own metrics, each sample labelled with its replica, plus the ingress's."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class ReplicaMetrics:
    """A collector over the replicas' exposition texts, merged family by family."""

    def __init__(self) -> None:
        self.texts: dict[str, str] = {}

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for replica, text in sorted(self.texts.items()):
            for family in text_string_to_metric_families(text):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type)
                for s in family.samples:
                    merged.add_sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
        yield from families.values()


class IngressMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.replicas = ReplicaMetrics()
        self.registry.register(self.replicas)
        self.live = Gauge("cpuserve:cluster_replicas", "Replicas the ingress routes to", registry=self.registry)
        self.retries = Counter(
            "cpuserve:cluster_retries", "Requests sent again to another replica", ["reason"], registry=self.registry
        )
        self.failures = Counter(
            "cpuserve:cluster_replica_failures",
            "Requests whose replica died under them, after any retry",
            registry=self.registry,
        )
        self.prefix_routed = Gauge(
            "cpuserve:cluster_prefix_routed",
            "Requests routed to the replica holding their prefix",
            registry=self.registry,
        )

    def render(self, texts: dict[str, str], live: int, prefix_routed: int) -> bytes:
        self.replicas.texts = texts
        self.live.set(live)
        self.prefix_routed.set(prefix_routed)
        return generate_latest(self.registry)
