"""The server's Prometheus metrics (chapter 10's plumbing), with `prometheus_client`, named as vLLM's
(`vllm/v1/metrics/loggers.py`, with `minivllm:` for `vllm:`).

Latencies are observed by the HTTP handlers. The engine's numbers (requests running and waiting, KV cache
usage, prefix-cache queries and hits, preemptions) come from the snapshot that `AsyncLLM` publishes after
each turn of its engine loop: the HTTP side never reads the scheduler, which the worker thread may be
changing at that moment. Each server has a registry of its own, so that several servers in one process (as
in the tests and the notebook) keep apart, and nothing global changes.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EngineCollector:
    """Metrics read from the engine loop's latest snapshot (a dict that the loop replaces, never changes)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        snapshot = self.engine.snapshot
        gauges = [("num_requests_running", "Requests in the running batch."),
                  ("num_requests_waiting", "Requests waiting to be scheduled."),
                  ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).")]
        for name, documentation in gauges:
            yield GaugeMetricFamily(f"minivllm:{name}", documentation, value=snapshot[name])
        counters = [("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
                    ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
                    ("num_preemptions", "Requests preempted to free KV blocks.")]
        for name, documentation in counters:
            yield CounterMetricFamily(f"minivllm:{name}", documentation, value=snapshot[name])


class ServerMetrics:
    def __init__(self, engine, model_name: str = "minivllm"):
        self.registry = CollectorRegistry()

        def histogram(name, documentation):
            return Histogram(f"minivllm:{name}", documentation, buckets=LATENCY_BUCKETS, registry=self.registry)

        def counter(name, documentation):
            return Counter(f"minivllm:{name}", documentation, registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token, from the request's arrival.")
        self.itl = histogram("inter_token_latency_seconds", "Time between two outputs of a request.")
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token.")
        self.tpot = histogram("request_time_per_output_token_seconds", "(e2e - TTFT) / (tokens - 1), per request.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.")
        self.request_success = counter("request_success", "Requests that finished.")
        self.registry.register(EngineCollector(engine))

    def finished(self, output, arrival: float, first: float, now: float) -> None:
        """Count a request that finished normally (an aborted or failed one is not a success)."""
        tokens = sum(len(c.token_ids) for c in output.outputs)
        self.e2e.observe(now - arrival)
        if tokens > 1:
            self.tpot.observe((now - first) / (tokens - 1))
        self.request_success.inc()
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(tokens)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
