"""The server's Prometheus metrics (chapter 10's plumbing), with `prometheus_client`, named and labelled as
vLLM 0.33.0's (`vllm/v1/metrics/loggers.py` `PrometheusStatLogger`, `vllm/v1/spec_decode/metrics.py`): `vllm:`
names with the labels `model_name` (the first served name) and `engine` ("0"), so that vLLM's Grafana
dashboards and `vllm bench serve` (which reads the `vllm:spec_decode_*` counters) find them.

Latencies are observed by the HTTP handlers, except the queue, prefill, decode and inference times, which
come from the engine's own timestamps (`RequestOutput.metrics`). The engine's numbers (requests running and
waiting, KV cache usage, prefix-cache queries and hits, preemptions, speculative-decoding counters) come
from the snapshot that `AsyncLLM` publishes after each turn of its engine loop: the HTTP side never reads the
scheduler, which the worker thread may be changing at that moment. Each server has a registry of its own,
so that several servers in one process (as in the tests and the notebook) keep apart, and nothing global
changes.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's default buckets (vllm/v1/metrics/buckets.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")
LABELS = ("model_name", "engine")


def one_two_five(limit: int) -> list[float]:
    """vLLM's `build_1_2_5_buckets`: 1, 2, 5, 10, 20, 50, ... up to `limit`."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return buckets
            buckets.append(float(mantissa * scale))
        scale *= 10


class EngineCollector:
    """Metrics read from the engine loop's latest snapshot (a dict that the loop replaces, never changes)."""

    def __init__(self, engine, labels: list[str]):
        self.engine, self.labels = engine, labels

    def collect(self):
        snapshot = self.engine.snapshot
        gauges = [("num_requests_running", "Number of requests in model execution batches."),
                  ("num_requests_waiting", "Number of requests waiting to be processed."),
                  ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")]
        for name, documentation in gauges:
            family = GaugeMetricFamily(f"vllm:{name}", documentation, labels=LABELS)
            family.add_metric(self.labels, snapshot[name])
            yield family
        counters = [("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
                    ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
                    ("num_preemptions", "Cumulative number of preemption from the engine."),
                    ("spec_decode_num_drafts", "Number of spec decoding drafts."),
                    ("spec_decode_num_draft_tokens", "Number of draft tokens."),
                    ("spec_decode_num_accepted_tokens", "Number of accepted tokens.")]
        for name, documentation in counters:
            if name in snapshot:  # the speculative-decoding counters exist only with a speculative engine
                family = CounterMetricFamily(f"vllm:{name}", documentation, labels=LABELS)
                family.add_metric(self.labels, snapshot[name])
                yield family
        if "spec_decode_num_accepted_tokens_per_pos" in snapshot:
            family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                         "Accepted tokens per draft position.", labels=(*LABELS, "position"))
            for position, count in enumerate(snapshot["spec_decode_num_accepted_tokens_per_pos"]):
                family.add_metric([*self.labels, str(position)], count)
            yield family


class ServerMetrics:
    def __init__(self, engine, model_name: str = "minivllm", max_model_len: int = 2048):
        self.registry = CollectorRegistry()
        self.labels = [model_name, "0"]

        def histogram(name, documentation, buckets):
            return Histogram(f"vllm:{name}", documentation, LABELS, buckets=buckets,
                             registry=self.registry).labels(*self.labels)

        def counter(name, documentation):
            return Counter(f"vllm:{name}", documentation, LABELS, registry=self.registry).labels(*self.labels)

        tokens = one_two_five(max_model_len)
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.phases = {name: histogram(f"request_{name}_time_seconds", f"Histogram of time spent in {what}.",
                                       REQUEST_BUCKETS)
                       for name, what in [("queue", "WAITING phase for request"), ("prefill", "PREFILL phase"),
                                          ("decode", "DECODE phase"), ("inference", "RUNNING phase")]}
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Number of generation tokens processed.", tokens)
        self.params_n = histogram("request_params_n", "Histogram of the n request parameter.",
                                  (1, 2, 5, 10, 20))
        self.params_max_tokens = histogram("request_params_max_tokens", "Histogram of the max_tokens request "
                                           "parameter.", tokens)
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_cached = counter("prompt_tokens_cached", "Number of cached prompt tokens.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          (*LABELS, "finished_reason"), registry=self.registry)
        self.request_success = {reason: success.labels(*self.labels, reason) for reason in FINISH_REASONS}
        self.registry.register(EngineCollector(engine, self.labels))

    def finished(self, output, params, arrival: float, first: float, now: float) -> None:
        """Count a request that finished normally (an aborted or failed one is not a success). A request is one
        prompt with its n choices, as minivllm's engine runs them (vLLM's runs each choice as a request of its
        own); its finish reason is its first choice's."""
        tokens = sum(len(c.token_ids) for c in output.outputs)
        self.e2e.observe(now - arrival)
        if tokens > 1:
            self.tpot.observe((now - first) / (tokens - 1))
        reason = output.outputs[0].finish_reason
        self.request_success.get(reason, self.request_success["stop"]).inc()
        self.request_generation_tokens.observe(tokens)
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.prompt_tokens_cached.inc(output.num_cached_tokens)
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.generation_tokens.inc(tokens)
        self.params_n.observe(params.n)
        if params.max_tokens is not None:
            self.params_max_tokens.observe(params.max_tokens)
        times = output.metrics  # the engine's clock (perf_counter)
        if None not in (times.first_scheduled_time, times.first_token_time, times.finished_time):
            self.phases["queue"].observe(times.first_scheduled_time - times.arrival_time)
            self.phases["prefill"].observe(times.first_token_time - times.first_scheduled_time)
            self.phases["decode"].observe(times.finished_time - times.first_token_time)
            self.phases["inference"].observe(times.finished_time - times.first_scheduled_time)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
