"""The production export path without Envoy: `open_tracer`'s batch processor and OTLP/gRPC
exporter deliver the spans to a real TraceService (the stack's receiver), and the receiver's
span tree shows them nested."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from extproc.config import TracingConfig
from extproc.stack.otlp import SpanReceiver, span_tree
from extproc.tracing import open_tracer

TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT = f"00-{TRACE:032x}-00f067aa0ba902b7-01"


@pytest.fixture
def receiver() -> Iterator[SpanReceiver]:
    with SpanReceiver() as r:
        yield r


def test_spans_reach_an_otlp_receiver_in_batches(receiver: SpanReceiver) -> None:
    tracer = open_tracer(
        TracingConfig(
            enabled=True, endpoint=f"http://{receiver.address}", service_name="gw",
            flush_interval_s=0.05,
        ),
        instance="host:1",
    )  # fmt: skip
    tracer.start()
    try:
        for _ in range(3):
            trace = tracer.begin(PARENT)
            with trace.phase("extproc.prepare"):
                pass
            trace.annotate({"gen_ai.request.model": "qwen3", "extproc.prompt.tokens": 12})
            trace.end()
        spans = receiver.wait_for(lambda got: len(got) == 6, timeout=10)
    finally:
        tracer.shutdown()
    assert len(spans) == 6
    assert {s.service for s in spans} == {"gw"}
    assert {s.trace_id for s in spans} == {f"{TRACE:032x}"}
    routes = [s for s in spans if s.name == "extproc.route"]
    assert {s.parent_span_id for s in routes} == {"00f067aa0ba902b7"}
    assert all(s.attributes["extproc.prompt.tokens"] == 12 for s in routes)
    tree = span_tree(spans, f"{TRACE:032x}").splitlines()
    assert tree[0] == f"trace {TRACE:032x}"
    # Envoy's span is not here: each routing span is a root, its phase indented under it.
    assert [line.split()[0] for line in tree[1:]] == ["extproc.route", "extproc.prepare"] * 3
    assert tree[1].startswith("  extproc.route [gw]") and tree[2].startswith("    extproc.prepare")


def test_shutdown_sends_what_is_still_queued(receiver: SpanReceiver) -> None:
    tracer = open_tracer(
        TracingConfig(enabled=True, endpoint=f"http://{receiver.address}", flush_interval_s=60)
    )
    tracer.start()
    tracer.begin(PARENT).end()
    tracer.shutdown()  # long before the minute's flush
    assert [s.name for s in receiver.spans()] == ["extproc.route"]
