"""Prometheus metrics, in a registry of the server's own (several apps may live in one test process).
Named as vLLM names them (`vllm:` prefix, its `model_name` label), so dashboards and autoscaler rules
written for a vLLM server read this one; the hit-rate gauge vLLM does not have keeps cpuserve's prefix."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from cpuserve.engine import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(labels), registry=self.registry).labels(**labels)

        self.running = gauge("vllm:num_requests_running", "Sequences in the running batch")
        self.waiting = gauge("vllm:num_requests_waiting", "Sequences waiting to be scheduled")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use")
        self.prefix_hit_rate = gauge("cpuserve:prefix_cache_hit_rate", "Prompt tokens served from the prefix cache")
        self._stats: EngineStats | None = None
        self.registry.register(_PrefixCounters(self, labels))  # vLLM's counters, from the engine's totals
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens received", list(labels), registry=self.registry
        ).labels(**labels)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated", list(labels), registry=self.registry
        ).labels(**labels)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Request arrival to first token",
            list(labels),
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between streamed tokens",
            list(labels),
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self.requests = Counter(
            "vllm:request_success", "Finished requests", [*labels, "finished_reason"], registry=self.registry
        )
        self.model_name = model_name

    def render(self, stats: EngineStats) -> bytes:
        """The exposition text; the engine gauges are set from `stats` (a snapshot) first."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        self.prefix_hit_rate.set(stats.prefix_hit_rate)
        self._stats = stats
        return generate_latest(self.registry)


class _PrefixCounters:
    """vllm:prefix_cache_queries / _hits: prompt tokens looked up in the prefix cache and found, the
    engine's running totals (a collector: prometheus_client's Counter cannot be set to a total)."""

    def __init__(self, metrics: Metrics, labels: dict[str, str]) -> None:
        self.metrics, self.labels = metrics, labels

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self.metrics._stats
        for name, doc, value in (
            (
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache",
                stats and stats.prefix_queries,
            ),
            ("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache", stats and stats.prefix_hits),
        ):
            family = CounterMetricFamily(name, doc, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), float(value or 0))
            yield family
