"""The OpenTelemetry SDK behind `Tracer`: spans continue the caller's trace and go, batched by
the SDK's worker thread, over OTLP/gRPC to the configured collector. Imported only when
`tracing.enabled` (the composition root imports it lazily), so a process with tracing off never
loads OpenTelemetry.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    get_current_span,
    set_span_in_context,
)
from opentelemetry.trace import Tracer as OtelApiTracer
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes as OtelAttributes

from extproc.config import TracingConfig
from extproc.tracing.api import (
    NO_TRACE,
    Attributes,
    RequestTrace,
    ResponseSpan,
    TraceParent,
    head_sampled,
    parse_traceparent,
    ratio_bound,
)

__all__ = [
    "EXPORT_TIMEOUT_S",
    "INSTRUMENTATION",
    "MAX_ATTRIBUTE_CHARS",
    "RESPONSE_SPAN",
    "ROUTE_SPAN",
    "OtelTracer",
    "ParentRatioSampler",
]

INSTRUMENTATION = "extproc"
ROUTE_SPAN = "extproc.route"  # the routing of one request (children: its phases)
RESPONSE_SPAN = "extproc.response"  # its response, from the access record
EXPORT_TIMEOUT_S = 5.0  # one export (with its retries) to the collector
MAX_ATTRIBUTE_CHARS = 256


class ParentRatioSampler(Sampler):
    """`head_sampled` as the SDK's sampler: a span whose parent was not sampled is not; the
    others are when their trace id falls in the ratio."""

    def __init__(self, ratio: float) -> None:
        self._ratio = ratio
        self._bound = ratio_bound(ratio)

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: OtelAttributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        parent = get_current_span(parent_context).get_span_context()
        if not parent.is_valid:
            sampled = head_sampled(trace_id, None, self._bound)
        elif parent.is_remote:
            sampled = head_sampled(trace_id, parent.trace_flags.sampled, self._bound)
        else:
            sampled = parent.trace_flags.sampled  # a phase of our own span: decided with it
        if not sampled:
            return SamplingResult(Decision.DROP, None, parent.trace_state)
        return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes, parent.trace_state)

    def get_description(self) -> str:
        return f"ParentRatio{{{self._ratio}}}"


def _remote(parent: TraceParent) -> Context:
    flags = TraceFlags(TraceFlags.SAMPLED if parent.sampled else TraceFlags.DEFAULT)
    ctx = SpanContext(parent.trace_id, parent.span_id, is_remote=True, trace_flags=flags)
    return set_span_in_context(NonRecordingSpan(ctx))


def _traceparent(span: Span) -> str:
    ctx = span.get_span_context()
    return TraceParent(ctx.trace_id, ctx.span_id, ctx.trace_flags.sampled).header()


class _Trace:
    """One sampled request: the routing span, its phases as children."""

    __slots__ = ("_context", "_span", "_tracer")
    recording = True

    def __init__(self, tracer: OtelApiTracer, span: Span) -> None:
        self._tracer = tracer
        self._span = span
        self._context = set_span_in_context(span)

    @property
    def traceparent(self) -> str:
        return _traceparent(self._span)

    def phase(self, name: str) -> AbstractContextManager[None]:
        return self._phase(name)

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        span = self._tracer.start_span(name, context=self._context)
        try:
            yield
        except BaseException as exc:  # a rejection, a bug, or the client gone (cancelled)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            span.end()

    def annotate(self, attributes: Attributes) -> None:
        self._span.set_attributes(attributes)

    def fail(self, status: int, reason: str) -> None:
        span = self._span
        span.set_attribute("http.response.status_code", status)
        span.set_attribute("error.type", reason)
        span.set_status(Status(StatusCode.ERROR, reason))

    def end(self) -> None:
        self._span.end()


class OtelTracer:
    """Implements `extproc.tracing.Tracer` on the OpenTelemetry SDK. Nothing is built before
    `start()` (the batch processor's worker thread, the exporter's channel); until then, and
    after `shutdown()`, no request is traced. `processor` replaces the OTLP batch export
    (tests: an in-memory exporter behind a simple processor)."""

    def __init__(
        self, config: TracingConfig, *, instance: str = "", processor: SpanProcessor | None = None
    ) -> None:
        self._config = config
        self._instance = instance
        self._processor = processor
        self._bound = ratio_bound(config.sample_ratio)
        self._provider: TracerProvider | None = None
        self._tracer: OtelApiTracer | None = None

    def start(self) -> None:
        if self._provider is not None:
            return
        cfg = self._config
        attrs: dict[str, str] = {"service.name": cfg.service_name}
        if self._instance:
            attrs["service.instance.id"] = self._instance
        provider = TracerProvider(
            sampler=ParentRatioSampler(cfg.sample_ratio),
            resource=Resource.create(attrs),
            # A client-chosen value (request id, objective name) is cut, never exported whole.
            span_limits=SpanLimits(max_attribute_length=MAX_ATTRIBUTE_CHARS),
        )
        provider.add_span_processor(self._processor or self._batch(cfg))
        self._provider = provider
        self._tracer = provider.get_tracer(INSTRUMENTATION)

    @staticmethod
    def _batch(cfg: TracingConfig) -> SpanProcessor:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        # A collector that is down costs the export thread, and the last flush at shutdown,
        # EXPORT_TIMEOUT_S at most; spans beyond the queue are dropped, never waited for.
        exporter: SpanExporter = OTLPSpanExporter(
            endpoint=cfg.endpoint,
            insecure=cfg.endpoint.startswith("http://"),
            timeout=EXPORT_TIMEOUT_S,
        )
        return BatchSpanProcessor(
            exporter,
            max_queue_size=cfg.max_queue_spans,
            schedule_delay_millis=cfg.flush_interval_s * 1000,
            max_export_batch_size=min(512, cfg.max_queue_spans),
        )

    def shutdown(self) -> None:
        provider, self._provider, self._tracer = self._provider, None, None
        if provider is not None:
            provider.shutdown()  # flushes what is queued

    def begin(self, traceparent: str | None) -> RequestTrace:
        tracer = self._tracer
        if tracer is None:
            return NO_TRACE
        parent = parse_traceparent(traceparent)
        if parent is None:
            context = None  # a new trace: the sampler decides on its new trace id
        elif head_sampled(parent.trace_id, parent.sampled, self._bound):
            context = _remote(parent)
        else:
            return NO_TRACE  # decided before any span is made: an unsampled request costs nothing
        span = tracer.start_span(ROUTE_SPAN, context=context, kind=SpanKind.SERVER)
        if not span.is_recording():
            return NO_TRACE
        return _Trace(tracer, span)

    def record_response(self, response: ResponseSpan) -> None:
        tracer = self._tracer
        parent = response.parent
        if tracer is None or not head_sampled(parent.trace_id, parent.sampled, self._bound):
            return
        span = tracer.start_span(
            RESPONSE_SPAN, context=_remote(parent), start_time=response.start_ns,
            attributes=response.attributes,
        )  # fmt: skip
        for name, at in response.events:
            span.add_event(name, timestamp=at)
        if response.error is not None:
            span.set_attribute("error.type", response.error)
            span.set_status(Status(StatusCode.ERROR, response.error))
        span.end(end_time=response.end_ns)
