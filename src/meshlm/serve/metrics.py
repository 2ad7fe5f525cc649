"""Prometheus metrics of `meshlm serve` (GET /metrics, text format), in a registry of the app's own.

    meshlm_requests_finished_total{reason}   stop | length | cancelled | timeout | error |
                                             shutdown (from the batcher)
    meshlm_requests_refused_total{status}    400, 429, 503 … answered without decoding
    meshlm_generated_tokens_total            tokens delivered
    meshlm_requests_running / _queued        rows decoding now / requests waiting for a row
    meshlm_batch_rows_mean                   rows per decode step, averaged over all steps so far
    meshlm_loop_steps_per_token_mean         core passes per decoded token (exit and `loops` move
                                             it)
    meshlm_loop_steps_total / _decoded_tokens_total   its numerator and denominator
    meshlm_time_to_first_token_seconds       histogram, from submission to the first token
    meshlm_inter_token_latency_seconds       histogram, between deliveries (a speculative round's
                                             several tokens arrive together: the gap is shared among
                                             them)
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _BatcherCollector:
    """Reads the batcher's counters at scrape time (they are plain ints written by the decoding
    thread)."""

    def __init__(self, batcher):
        self.batcher = batcher

    def collect(self):
        b, st = self.batcher, self.batcher.stats
        finished = CounterMetricFamily("meshlm_requests_finished", "requests finished, by reason",
                                       labels=["reason"])
        for reason, n in dict(st.finished).items():
            finished.add_metric([reason], n)
        yield finished
        yield CounterMetricFamily("meshlm_generated_tokens", "tokens delivered to requests",
                                  value=st.tokens)
        yield GaugeMetricFamily("meshlm_requests_running", "requests decoding in a batch row",
                                value=b.running)
        yield GaugeMetricFamily("meshlm_requests_queued", "requests waiting for a batch row",
                                value=b.queued)
        yield GaugeMetricFamily("meshlm_batch_rows_mean",
                                "rows per decode step, mean over all steps",
                                value=st.step_rows / st.steps if st.steps else 0.0)
        yield GaugeMetricFamily("meshlm_loop_steps_per_token_mean",
                                "core passes per decoded token, mean",
                                value=st.loop_steps / st.decoded if st.decoded else 0.0)
        yield CounterMetricFamily("meshlm_loop_steps", "core passes of decoded tokens, summed",
                                  value=st.loop_steps)
        yield CounterMetricFamily("meshlm_decoded_tokens", "tokens decoded by batch steps",
                                  value=st.decoded)


class Metrics:
    def __init__(self, batcher):
        self.registry = CollectorRegistry()
        self.registry.register(_BatcherCollector(batcher))
        self._refused = Counter("meshlm_requests_refused",
                                "requests answered with an error before decoding",
                                ["status"], registry=self.registry)
        self.ttft = Histogram("meshlm_time_to_first_token_seconds", "submission to first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("meshlm_inter_token_latency_seconds", "time between tokens",
                             buckets=LATENCY_BUCKETS, registry=self.registry)

    def refused(self, status: int) -> None:
        self._refused.labels(str(status)).inc()

    def timing(self) -> Timing:
        return Timing(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Timing:
    """One request's token arrivals, observed into the latency histograms."""

    def __init__(self, metrics: Metrics):
        self.metrics, self.last, self.first = metrics, time.perf_counter(), True

    def arrived(self, n: int) -> None:
        now = time.perf_counter()
        gap, self.last = now - self.last, now
        if self.first:
            self.metrics.ttft.observe(gap)
            self.first, n = False, n - 1
            gap = 0.0
        for _ in range(n):
            self.metrics.itl.observe(gap / n)
