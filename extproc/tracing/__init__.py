"""Traces: every routing decision a span in the request's own trace (docs/operations.md,
"Traces").

A layer of its own, as flow control is. The server hands on the caller's `traceparent` as a
plain string; the director begins a `RequestTrace` per request and wraps each phase of its step
runner in a child span; the access record's response becomes a span of the same trace on
whatever process receives it. `open_tracer` is the one way in: with `tracing.enabled` false it
is `NO_TRACER` and OpenTelemetry is never imported.
"""

from __future__ import annotations

from extproc.config import TracingConfig
from extproc.tracing.api import (
    NO_TRACE,
    NO_TRACER,
    AttributeValue,
    RequestTrace,
    ResponseSpan,
    TraceParent,
    Tracer,
    head_sampled,
    parse_traceparent,
    ratio_bound,
)

__all__ = [
    "NO_TRACE",
    "NO_TRACER",
    "AttributeValue",
    "RequestTrace",
    "ResponseSpan",
    "TraceParent",
    "Tracer",
    "head_sampled",
    "open_tracer",
    "parse_traceparent",
    "ratio_bound",
]


def open_tracer(config: TracingConfig, *, instance: str = "") -> Tracer:
    """The process's tracer for `config` (not started: `start()` before serving)."""
    if not config.enabled:
        return NO_TRACER
    from extproc.tracing.otel import OtelTracer  # OpenTelemetry only where tracing is on

    return OtelTracer(config, instance=instance)
