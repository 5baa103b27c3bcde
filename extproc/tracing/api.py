"""What the director sees of tracing: a `Tracer` that begins one `RequestTrace` per request,
the W3C trace context as plain values, and head sampling as one pure function. Nothing here
imports OpenTelemetry: with tracing off, `NO_TRACER` is all a process ever runs.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "NO_TRACE",
    "NO_TRACER",
    "AttributeValue",
    "RequestTrace",
    "ResponseSpan",
    "TraceParent",
    "Tracer",
    "head_sampled",
    "parse_traceparent",
    "ratio_bound",
]

AttributeValue = str | bool | int | float
Attributes = Mapping[str, AttributeValue]

_LOW64 = (1 << 64) - 1
# version 00 (and any later version, read as 00: the spec's forward compatibility)
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


@dataclass(frozen=True, slots=True)
class TraceParent:
    """A W3C `traceparent`: the caller's span (Envoy's), ours a child of it."""

    trace_id: int
    span_id: int
    sampled: bool

    def header(self) -> str:
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{'01' if self.sampled else '00'}"


def parse_traceparent(text: str | None) -> TraceParent | None:
    """The trace context of a `traceparent` value, or None when absent or invalid (all-zero
    ids, version ff, bad hex: the spec says to start a new trace then)."""
    if not text:
        return None
    m = _TRACEPARENT.match(text.strip().lower())
    if m is None:
        return None
    version, trace, span, flags = m.groups()
    trace_id, span_id = int(trace, 16), int(span, 16)
    if version == "ff" or trace_id == 0 or span_id == 0:
        return None
    if version == "00" and len(text.strip()) != 55:
        return None  # version 00 has exactly four fields
    return TraceParent(trace_id, span_id, sampled=bool(int(flags, 16) & 1))


def ratio_bound(ratio: float) -> int:
    """Trace ids whose low 64 bits are below this are sampled (OpenTelemetry's
    TraceIdRatioBased rule, so any process or collector with the same ratio agrees)."""
    return round(min(1.0, max(0.0, ratio)) * (_LOW64 + 1))


def head_sampled(trace_id: int, parent_sampled: bool | None, bound: int) -> bool:
    """The head-sampling decision: a request whose parent was not sampled is not; one whose
    parent was, or that has none (`None`), is when its trace id falls in the ratio (`bound`
    from `ratio_bound`). The one rule the fast path and the SDK's sampler both apply."""
    if parent_sampled is False:
        return False
    return (trace_id & _LOW64) < bound


class RequestTrace(Protocol):
    """The spans of one request's routing. `recording` False: every call does nothing (the
    director then builds no attributes)."""

    @property
    def recording(self) -> bool: ...

    @property
    def traceparent(self) -> str:
        """The routing span as a `traceparent` ("" when not recording), for the access record."""
        ...

    def phase(self, name: str) -> AbstractContextManager[None]:
        """A child span around one phase of the routing (an exception marks it failed)."""
        ...

    def annotate(self, attributes: Attributes) -> None:
        """Attributes of the routing span."""
        ...

    def fail(self, status: int, reason: str) -> None:
        """The request was rejected with HTTP `status` (the span's status is an error)."""
        ...

    def end(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ResponseSpan:
    """A routed request's response, from its access record, as a span of its trace: times in
    nanoseconds since the epoch; events (name, time) inside it."""

    parent: TraceParent  # the routing span, as the record carried it
    start_ns: int
    end_ns: int
    attributes: Attributes
    events: tuple[tuple[str, int], ...] = ()
    error: str | None = None


class Tracer(Protocol):
    """Begins a request's trace (after the caller's sampling decision) and records responses.
    `start()` before serving (the exporter's worker), `shutdown()` at the end (flushes)."""

    def begin(self, traceparent: str | None) -> RequestTrace: ...

    def record_response(self, span: ResponseSpan) -> None: ...

    def start(self) -> None: ...

    def shutdown(self) -> None: ...


class _NoTrace:
    """The trace of a request not sampled, or of a process with tracing off: no cost."""

    __slots__ = ()
    recording = False
    traceparent = ""

    def phase(self, name: str) -> AbstractContextManager[None]:
        return _NULL

    def annotate(self, attributes: Attributes) -> None:
        pass

    def fail(self, status: int, reason: str) -> None:
        pass

    def end(self) -> None:
        pass


class _NoTracer:
    __slots__ = ()

    def begin(self, traceparent: str | None) -> RequestTrace:
        return NO_TRACE

    def record_response(self, span: ResponseSpan) -> None:
        pass

    def start(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


_NULL: AbstractContextManager[None] = contextlib.nullcontext()
NO_TRACE: RequestTrace = _NoTrace()
NO_TRACER: Tracer = _NoTracer()
