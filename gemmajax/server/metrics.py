"""Prometheus metrics of one server app, in a registry of its own (never the process-global one).

Request counts and latencies are recorded by the app as requests pass; engine gauges (running / waiting
requests, KV cache usage, and any other numeric field of `EngineStats`) are read from `engine.stats()` at
scrape time by a custom collector, so they are never stale and cost nothing between scrapes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.4, 0.8, 2.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0, 600.0)

# EngineStats field -> (metric name, help), always exported. Other numeric fields are exported as
# gemmajax_engine_<field>, except those of _OPTIONAL_GAUGES, which get their own names when the stats have them.
_ENGINE_GAUGES = {
    "num_running": ("gemmajax_num_requests_running", "Requests the engine is running now."),
    "num_waiting": ("gemmajax_num_requests_waiting", "Requests waiting in the engine's queue."),
    "kv_cache_usage": ("gemmajax_kv_cache_usage_perc", "Fraction of KV cache pages in use (0..1)."),
}
# Cumulative engine counts, exported as Prometheus counters (vLLM's spec-decode names).
_ENGINE_COUNTERS = {
    "spec_num_drafts": ("gemmajax_spec_decode_num_drafts", "Speculative drafting rounds (sequences x steps)."),
    "spec_num_draft_tokens": ("gemmajax_spec_decode_num_draft_tokens", "Tokens drafted."),
    "spec_num_accepted_tokens": ("gemmajax_spec_decode_num_accepted_tokens", "Drafted tokens accepted."),
}
_OPTIONAL_GAUGES = {
    "kv_pages_used": ("gemmajax_kv_cache_pages_used", "KV cache pages held by requests, all KV groups together."),
}


def stats_fields(stats: Any) -> dict[str, float]:
    """The numeric fields of an EngineStats-like object (dataclass, dict or plain object)."""
    if dataclasses.is_dataclass(stats):
        items = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
    elif isinstance(stats, dict):
        items = dict(stats)
    else:
        items = {k: v for k, v in vars(stats).items() if not k.startswith("_")}
    return {k: float(v) for k, v in items.items() if isinstance(v, int | float) and not isinstance(v, bool)}


class _EngineStatsCollector(Collector):
    def __init__(self, stats_fn: Callable[[], Any]) -> None:
        self._stats_fn = stats_fn

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # do not call the engine at registration time

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            fields = stats_fields(self._stats_fn())
        except Exception:  # a failing engine must not break /metrics
            logger.exception("engine.stats() failed while collecting metrics")
            return
        for key, (name, doc) in _ENGINE_GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=fields.pop(key, 0.0))
        for key, (name, doc) in _OPTIONAL_GAUGES.items():
            if key in fields:
                yield GaugeMetricFamily(name, doc, value=fields.pop(key))
        for key, (name, doc) in _ENGINE_COUNTERS.items():
            if key in fields:
                yield CounterMetricFamily(name, doc, value=fields.pop(key))
        for key, value in sorted(fields.items()):
            yield GaugeMetricFamily(f"gemmajax_engine_{key}", f"EngineStats.{key}", value=value)


class ServerMetrics:
    """All metrics of one app. `registry` is private to it; `render()` gives the Prometheus text."""

    def __init__(self, stats_fn: Callable[[], Any] | None = None) -> None:
        r = self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("gemmajax_requests", "HTTP requests by endpoint and status code.",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("gemmajax_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("gemmajax_generation_tokens", "Generated tokens.", registry=r)
        self.ttft = Histogram("gemmajax_time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("gemmajax_inter_token_latency_seconds", "Time between generated tokens.",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("gemmajax_e2e_request_latency_seconds", "Arrival to last token of a generation.",
                             buckets=_E2E_BUCKETS, registry=r)
        self.in_flight = Gauge("gemmajax_server_requests_in_flight", "Generation requests the server holds.",
                               registry=r)
        if stats_fn is not None:
            r.register(_EngineStatsCollector(stats_fn))

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint if endpoint in ENDPOINTS else "other", status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class GenerationTimer:
    """Latency bookkeeping of one generation (one choice): first token, gaps between tokens, end."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrival = self.last = time.monotonic()
        self.first_seen = False

    def on_tokens(self, num_new: int) -> None:
        """Record `num_new` tokens that just arrived (a multi-token step spreads its gap over its tokens)."""
        if num_new <= 0:
            return
        t = time.monotonic()
        if not self.first_seen:
            self.metrics.ttft.observe(t - self.arrival)
            self.first_seen = True
            num_gaps, gap = num_new - 1, 0.0
        else:
            num_gaps, gap = num_new, (t - self.last) / num_new
        for _ in range(num_gaps):
            self.metrics.itl.observe(gap)
        self.metrics.generation_tokens.inc(num_new)
        self.last = t

    def on_finish(self, num_prompt_tokens: int) -> None:
        self.metrics.e2e.observe(time.monotonic() - self.arrival)
        self.metrics.prompt_tokens.inc(num_prompt_tokens)
