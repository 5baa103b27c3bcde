"""A real OpenTelemetry tracer (`extproc.tracing.otel.OtelTracer`) whose spans stay in memory:
the SDK's in-memory exporter behind a simple (synchronous) processor instead of OTLP batches."""

from __future__ import annotations

from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from extproc.config import TracingConfig
from extproc.tracing.otel import OtelTracer

__all__ = ["memory_tracer"]


def memory_tracer(sample_ratio: float = 1.0) -> tuple[OtelTracer, InMemorySpanExporter]:
    """A started tracer at `sample_ratio`, and the exporter holding what it finished."""
    exporter = InMemorySpanExporter()
    tracer = OtelTracer(
        TracingConfig(enabled=True, sample_ratio=sample_ratio),
        instance="test:1",
        processor=SimpleSpanProcessor(exporter),
    )
    tracer.start()
    return tracer, exporter
