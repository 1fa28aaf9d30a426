"""/metrics with prometheus_client, in a registry of each app (so that tests can build several apps).

Names follow vLLM's with an `accelgen:` prefix (e.g. `accelgen:num_requests_running`,
`accelgen:spec_decode_num_accepted_tokens_total`), each labelled with the served model's name. The engine's
counters are read when scraped (EngineStats); latencies are observed as requests finish (`observe_request`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# seconds; CPU serving is slower than vLLM's GPUs, so the buckets reach further
FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class EngineCollector:
    """The engine's counters and gauges, read at each scrape."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        s = self.engine.stats
        counters = [
            ("accelgen:request_received", "Requests (sequences) received.", s.requests),
            ("accelgen:request_success", "Requests that finished.", s.finished),
            ("accelgen:request_aborted", "Requests cancelled (client gone or shutdown).", s.aborted),
            ("accelgen:request_failed", "Requests that failed with an error.", s.failed),
            ("accelgen:prompt_tokens", "Prompt tokens of the requests received.", s.prompt_tokens),
            ("accelgen:generation_tokens", "Tokens generated.", s.new_tokens),
            ("accelgen:spec_decode_num_draft_tokens", "Draft tokens proposed.", s.draft_tokens),
            ("accelgen:spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.accepted_tokens),
            ("accelgen:spec_decode_num_verify_steps",
             "Sequence-steps that verified a draft (tau = generated tokens / these).", s.verify_steps),
            ("accelgen:engine_steps",
             "Engine steps: a batched forward of the decoding sequences, plus one per prompt chunk.", s.forwards),
            ("accelgen:engine_step_seconds", "Seconds spent in engine steps.", s.step_seconds),
            ("accelgen:draft_cap", "Draft caps summed over engine steps (uncapped steps count 0).", s.draft_cap_total),
        ]
        gauges = [
            ("accelgen:num_requests_running", "Requests in the batch.", s.running),
            ("accelgen:num_requests_waiting", "Requests waiting for a batch slot.", s.queue_length),
            ("accelgen:batch_size", "Sequences in the last engine step.", s.batch_size),
            ("accelgen:last_draft_cap", "Most draft tokens per sequence in the last step (-1: no cap).",
             -1 if s.draft_cap is None else s.draft_cap),
            ("accelgen:spec_decode_draft_acceptance_rate", "Accepted / proposed draft tokens.",
             s.accepted_tokens / s.draft_tokens if s.draft_tokens else 0.0),
            ("accelgen:spec_decode_mean_tokens_per_step", "Mean tokens committed per sequence-step (tau).",
             s.new_tokens / s.verify_steps if s.verify_steps else 0.0),
        ]
        for families, kind in ((counters, CounterMetricFamily), (gauges, GaugeMetricFamily)):
            for name, documentation, value in families:
                family = kind(name, documentation, labels=["model_name"])
                family.add_metric([self.model_name], value)
                yield family


class Metrics:
    """An app's registry: the engine's figures, latency histograms and the process's (memory, CPU)."""

    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(EngineCollector(engine, model_name))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes & co (Linux /proc)

        def histogram(name: str, documentation: str, buckets) -> Histogram:
            return Histogram(name, documentation, ["model_name"], registry=self.registry, buckets=buckets)

        self.first_token = histogram("accelgen:time_to_first_token_seconds",
                                     "Seconds from a request's arrival to its first generated token.",
                                     FIRST_TOKEN_BUCKETS).labels(model_name)
        self.per_output_token = histogram("accelgen:time_per_output_token_seconds",
                                          "Seconds per generated token after the first (per request).",
                                          PER_TOKEN_BUCKETS).labels(model_name)
        self.request_latency = histogram("accelgen:e2e_request_latency_seconds",
                                         "Seconds from a request's arrival to its last token.",
                                         REQUEST_BUCKETS).labels(model_name)

    def observe_request(self, arrived: float, first_token: float | None, finished: float, tokens: int) -> None:
        """A finished sequence: arrival, first token and end times (time.monotonic) and its generated tokens."""
        self.request_latency.observe(finished - arrived)
        if first_token is not None:
            self.first_token.observe(first_token - arrived)
            if tokens > 1:
                self.per_output_token.observe((finished - first_token) / (tokens - 1))

    def text(self) -> bytes:
        return generate_latest(self.registry)
