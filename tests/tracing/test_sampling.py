"""Head sampling: the parent's decision, then a ratio of trace ids of our own; the fast path
(`OtelTracer.begin`) and the SDK's sampler apply the one rule."""

from __future__ import annotations

import pytest

from extproc.tracing import (
    NO_TRACE,
    TraceParent,
    head_sampled,
    parse_traceparent,
    ratio_bound,
)
from tests._tracing import memory_tracer

TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
SPAN = 0x00F067AA0BA902B7
LOW = 0x0000000000000000_0000000000000001  # low 64 bits tiny: in any ratio above 0
HIGH = 0x0000000000000000_FFFFFFFFFFFFFFF0  # low 64 bits near the top: only in ratio 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"00-{TRACE:032x}-{SPAN:016x}-01", TraceParent(TRACE, SPAN, sampled=True)),
        (f"00-{TRACE:032x}-{SPAN:016x}-00", TraceParent(TRACE, SPAN, sampled=False)),
        (f"00-{TRACE:032X}-{SPAN:016X}-03", TraceParent(TRACE, SPAN, sampled=True)),  # flag bit
        (f" 00-{TRACE:032x}-{SPAN:016x}-01 ", TraceParent(TRACE, SPAN, sampled=True)),
        (f"01-{TRACE:032x}-{SPAN:016x}-01-future", TraceParent(TRACE, SPAN, sampled=True)),
        (f"00-{TRACE:032x}-{SPAN:016x}-01-extra", None),  # version 00 has four fields
        (f"ff-{TRACE:032x}-{SPAN:016x}-01", None),  # forbidden version
        (f"00-{0:032x}-{SPAN:016x}-01", None),  # all-zero trace id
        (f"00-{TRACE:032x}-{0:016x}-01", None),  # all-zero span id
        (f"00-{TRACE:032x}"[:-1] + f"-{SPAN:016x}-01", None),  # a short trace id
        ("00-xyz", None),
        ("", None),
        (None, None),
    ],
)
def test_traceparent_is_parsed_per_w3c(text: str | None, expected: TraceParent | None) -> None:
    assert parse_traceparent(text) == expected


def test_a_traceparent_round_trips() -> None:
    tp = TraceParent(TRACE, SPAN, sampled=True)
    assert parse_traceparent(tp.header()) == tp


@pytest.mark.parametrize(
    ("trace_id", "parent_sampled", "ratio", "sampled"),
    [
        (LOW, True, 1.0, True),  # parent sampled, full ratio
        (LOW, False, 1.0, False),  # parent not sampled: never, whatever the ratio
        (LOW, None, 1.0, True),  # no parent: the ratio alone
        (HIGH, True, 0.5, False),  # parent sampled, trace id outside our ratio
        (LOW, True, 0.5, True),
        (HIGH, None, 0.99, False),
        (HIGH, None, 1.0, True),
        (LOW, True, 0.0, False),  # ratio 0: nothing
        (LOW, None, 0.0, False),
    ],
)
def test_head_sampling_follows_the_parent_then_our_ratio(
    trace_id: int, parent_sampled: bool | None, ratio: float, sampled: bool
) -> None:
    assert head_sampled(trace_id, parent_sampled, ratio_bound(ratio)) is sampled


def test_the_ratio_samples_about_that_share_of_random_trace_ids() -> None:
    import random

    rng = random.Random(7)
    bound = ratio_bound(0.25)
    hits = sum(head_sampled(rng.getrandbits(128), None, bound) for _ in range(20_000))
    assert 4_600 < hits < 5_400


@pytest.mark.parametrize(
    ("flags", "trace_id", "ratio", "traced"),
    [
        ("01", TRACE, 1.0, True),
        ("00", TRACE, 1.0, False),
        ("01", HIGH, 0.5, False),
        ("01", LOW, 0.5, True),
    ],
)
def test_the_tracer_continues_a_sampled_parent_only(
    flags: str, trace_id: int, ratio: float, traced: bool
) -> None:
    tracer, exporter = memory_tracer(ratio)
    trace = tracer.begin(f"00-{trace_id:032x}-{SPAN:016x}-{flags}")
    with trace.phase("extproc.prepare"):
        pass
    trace.end()
    spans = exporter.get_finished_spans()
    if not traced:
        assert trace is NO_TRACE and spans == ()
        return
    assert {s.name for s in spans} == {"extproc.route", "extproc.prepare"}
    root = next(s for s in spans if s.name == "extproc.route")
    assert root.context is not None and root.parent is not None
    assert root.context.trace_id == trace_id  # the caller's trace, continued
    assert root.parent.span_id == SPAN and root.parent.is_remote
    assert parse_traceparent(trace.traceparent) == TraceParent(
        trace_id, root.context.span_id, sampled=True
    )


@pytest.mark.parametrize(("ratio", "expected"), [(1.0, 50), (0.0, 0)])
def test_without_a_parent_the_ratio_decides(ratio: float, expected: int) -> None:
    tracer, exporter = memory_tracer(ratio)
    for _ in range(50):
        tracer.begin(None).end()
    assert len(exporter.get_finished_spans()) == expected


def test_no_request_is_traced_before_start_or_after_shutdown() -> None:
    tracer, exporter = memory_tracer()
    tracer.shutdown()
    assert tracer.begin(f"00-{TRACE:032x}-{SPAN:016x}-01") is NO_TRACE
    assert exporter.get_finished_spans() == ()
