"""Engine metrics: Prometheus-text parsing, name presets, the endpoint store, the poller."""

from __future__ import annotations

from extproc.metrics.names import PRESETS, SGLANG, VLLM, MetricNames, extract, preset
from extproc.metrics.parse import ParseResult, Sample, parse
from extproc.metrics.poller import SCRAPE_RESULTS, MetricsPoller, ScrapeObserver
from extproc.metrics.store import EndpointState, EndpointStore, ReadyEndpoint

__all__ = [
    "PRESETS",
    "SCRAPE_RESULTS",
    "SGLANG",
    "VLLM",
    "EndpointState",
    "EndpointStore",
    "MetricNames",
    "MetricsPoller",
    "ParseResult",
    "ReadyEndpoint",
    "Sample",
    "ScrapeObserver",
    "extract",
    "parse",
    "preset",
]
