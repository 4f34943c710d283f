"""Prometheus metrics, in a registry of the server's own (several apps may live in one test process).
Named as vLLM names them (`vllm:` prefix, its `model_name` label), so dashboards and autoscaler rules
written for a vLLM server read this one; the hit-rate gauge vLLM does not have keeps cpuserve's prefix."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from cpuserve.engine import EngineStats, RequestOutput, SamplingParams

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# A whole request's phases, and its lengths (vLLM's buckets: requests take seconds to minutes; 1-2-5 steps)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
_REQUEST_BUCKETS += (480.0, 960.0, 1920.0, 7680.0)
_LENGTH_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))


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

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, list(labels), buckets=buckets, registry=self.registry).labels(**labels)

        # A finished request's phases, as vLLM splits them: waiting to be scheduled, scheduled to its
        # first token (prefill), first to last token (decode), scheduled to last (inference), and
        # arrival to last (e2e); the end is when the server sees the request's last output.
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to the last token", _REQUEST_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled", _REQUEST_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "Scheduled to first token", _REQUEST_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds", "First token to last", _REQUEST_BUCKETS)
        self.inference = histogram(
            "vllm:request_inference_time_seconds", "First scheduled to the last token", _REQUEST_BUCKETS
        )
        self.prompt_len = histogram("vllm:request_prompt_tokens", "Prompt tokens of a request", _LENGTH_BUCKETS)
        self.generation_len = histogram(
            "vllm:request_generation_tokens", "Tokens a request generated (all its sequences)", _LENGTH_BUCKETS
        )
        self.params_n = histogram("vllm:request_params_n", "The n of a request", (1, 2, 5, 10, 20))
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "The max_tokens of a request", _LENGTH_BUCKETS
        )
        self.model_name = model_name

    def finished(self, out: RequestOutput, params: SamplingParams, prompt_tokens: int, end: float) -> None:
        """A finished request's phases (from the engine's times, monotonic) and sizes."""
        times = out.metrics
        arrival, scheduled, first = times.get("arrival"), times.get("first_scheduled"), times.get("first_token")
        if arrival is not None:
            self.e2e.observe(end - arrival)
            if scheduled is not None:
                self.queue.observe(max(0.0, scheduled - arrival))
        if scheduled is not None:
            self.inference.observe(end - scheduled)
            if first is not None:
                self.prefill.observe(max(0.0, first - scheduled))
        if first is not None:
            self.decode.observe(max(0.0, end - first))
        self.prompt_len.observe(prompt_tokens)
        self.generation_len.observe(sum(len(o.token_ids) for o in out.outputs))
        self.params_n.observe(params.n)
        if params.max_tokens is not None:
            self.params_max_tokens.observe(params.max_tokens)

    def render(self, stats: EngineStats) -> bytes:
        """The exposition text; the engine gauges are set from `stats` (a snapshot) first."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        self.prefix_hit_rate.set(stats.prefix_hit_rate)
        self._stats = stats
        return generate_latest(self.registry)


class _PrefixCounters:
    """vllm:prefix_cache_queries / _hits: prompt tokens looked up in the prefix cache and found, and
    vllm:num_preemptions: the engine's running totals (a collector: prometheus_client's Counter
    cannot be set to a total)."""

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
            ("vllm:num_preemptions", "Sequences preempted (KV blocks short)", stats and stats.num_preemptions),
        ):
            family = CounterMetricFamily(name, doc, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), float(value or 0))
            yield family
