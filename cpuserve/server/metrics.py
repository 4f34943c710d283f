"""Prometheus metrics, in a registry of the server's own (several apps may live in one test process).
Named as vLLM names them (`vllm:` prefix, same labels), so dashboards and autoscaler rules written
for a vLLM server read this one unchanged."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
        self.prefix_hit_rate = gauge("vllm:prefix_cache_hit_rate", "Prompt tokens served from the prefix cache")
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
        return generate_latest(self.registry)
