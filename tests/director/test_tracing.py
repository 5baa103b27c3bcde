"""A routed request's spans, from the real director with a real OpenTelemetry tracer: the
routing span continues the caller's trace, each phase is its child, the attributes say what was
decided, a rejection says why, the access record's response joins the trace; and nothing
private (prompt text, user id, header values) is in any span."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from extproc.director.api import ImmediateReply, RequestHead, RouteResult
from extproc.director.tracing import user_hash
from extproc.tracing import parse_traceparent
from extproc.tracing.otel import MAX_ATTRIBUTE_CHARS
from extproc.types import TokenUsage
from tests._director import DirectorKit, build_director, config_text
from tests._tracing import memory_tracer
from tests.director._records import record_for

TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
ENVOY_SPAN = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{TRACE:032x}-{ENVOY_SPAN:016x}-01"
SECRET = "the launch code is swordfish-7341"
USER = "alice@example.com"
API_KEY = "sk-very-secret-key"
PHASES = ("extproc.prepare", "extproc.admit", "extproc.decide", "extproc.pre_request")


def body(model: str = "qwen3") -> bytes:
    return orjson.dumps(
        {"model": model, "messages": [{"role": "user", "content": SECRET}], "max_tokens": 8}
    )


def head(traceparent: str | None = TRACEPARENT) -> RequestHead:
    return RequestHead(
        request_id="req-1",
        method="POST",
        path=f"/v1/chat/completions?api-key={API_KEY}",
        headers={"x-user-id": USER, "authorization": f"Bearer {API_KEY}"},
        traceparent=traceparent,
    )


@pytest.fixture
def traced(qwen_tokenizer_dir: Path) -> Iterator[tuple[DirectorKit, InMemorySpanExporter]]:
    tracer, exporter = memory_tracer()
    kit = build_director(config_text(), qwen_tokenizer_dir, tracer=tracer)
    yield kit, exporter
    kit.close()
    tracer.shutdown()


def by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {s.name: s for s in spans}


def everything_said(spans: tuple[ReadableSpan, ...]) -> str:
    """Every name, attribute and event of the spans, as text."""
    parts = []
    for s in spans:
        parts.append(s.name)
        parts.extend(f"{k}={v!r}" for k, v in (s.attributes or {}).items())
        parts.extend(f"{e.name} {dict(e.attributes or {})}" for e in s.events)
        parts.extend(f"{k}={v!r}" for k, v in s.resource.attributes.items())
        parts.append(str(s.status.description))
    return "\n".join(parts)


async def test_the_routing_is_a_span_tree_under_the_callers_span(
    traced: tuple[DirectorKit, InMemorySpanExporter],
) -> None:
    kit, exporter = traced
    res = await kit.director.route(head(), body())
    assert isinstance(res, RouteResult)
    spans = by_name(exporter.get_finished_spans())
    assert set(spans) == {"extproc.route", *PHASES}
    root = spans["extproc.route"]
    assert root.context is not None and root.parent is not None
    assert (root.context.trace_id, root.parent.span_id) == (TRACE, ENVOY_SPAN)
    for name in PHASES:
        child = spans[name]
        assert child.parent is not None and child.parent.span_id == root.context.span_id
        assert child.context is not None and child.context.trace_id == TRACE
    attrs = dict(root.attributes or {})
    assert attrs["gen_ai.request.model"] == "qwen3"
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.max_tokens"] == 8
    assert attrs["extproc.endpoint"] == res.destinations[0]
    assert attrs["extproc.strategy"] == "prefix-cache"
    assert attrs["extproc.priority"] == 0
    assert isinstance(attrs["extproc.prompt.tokens"], int) and attrs["extproc.prompt.tokens"] > 5
    assert attrs["extproc.prefix.hit_blocks"] == 0
    assert attrs["url.path"] == "/v1/chat/completions"
    assert attrs["user.hash"] == user_hash(USER)
    assert root.status.status_code is not StatusCode.ERROR
    # The access record carries the routing span back (whatever process gets it).
    assert res.routed is not None and parse_traceparent(res.routed.trace) is not None


async def test_no_span_says_anything_private(
    traced: tuple[DirectorKit, InMemorySpanExporter],
) -> None:
    kit, exporter = traced
    res = await kit.director.route(head(), body())
    assert isinstance(res, RouteResult)
    kit.director.account(record_for(res, usage=TokenUsage(31, 8, 0)))
    await kit.director.route(head(), body("no-such-model"))  # a rejection too
    spans = exporter.get_finished_spans()
    assert len(spans) == 1 + len(PHASES) + 1 + 2  # routed, its response, the rejection
    said = everything_said(spans)
    for private in (SECRET, "swordfish", USER, "alice", API_KEY, "Bearer"):
        assert private not in said


async def test_a_rejection_says_its_status_and_reason(
    traced: tuple[DirectorKit, InMemorySpanExporter],
) -> None:
    kit, exporter = traced
    res = await kit.director.route(head(), body("no-such-model"))
    assert isinstance(res, ImmediateReply) and res.status == 404
    spans = by_name(exporter.get_finished_spans())
    assert set(spans) == {"extproc.route", "extproc.prepare"}  # it ended in parsing
    root = spans["extproc.route"]
    assert root.status.status_code is StatusCode.ERROR
    attrs = dict(root.attributes or {})
    assert attrs["http.response.status_code"] == 404
    assert attrs["error.type"] == "model_not_found"  # the error's code, never its message
    assert spans["extproc.prepare"].status.status_code is StatusCode.ERROR


async def test_the_response_joins_the_trace_with_usage_and_ttft(
    traced: tuple[DirectorKit, InMemorySpanExporter], qwen_tokenizer_dir: Path
) -> None:
    kit, exporter = traced
    res = await kit.director.route(head(), body())
    assert isinstance(res, RouteResult)
    route_span = by_name(exporter.get_finished_spans())["extproc.route"]
    assert route_span.context is not None
    # Another process (its own director and tracer) gets the record.
    tracer, other_spans = memory_tracer()
    other = build_director(config_text(), qwen_tokenizer_dir, tracer=tracer)
    try:
        other.director.account(record_for(res, usage=TokenUsage(31, 8, 2), first_token_s=0.1))
    finally:
        other.close()
        tracer.shutdown()
    (response,) = other_spans.get_finished_spans()
    assert response.name == "extproc.response"
    assert response.context is not None and response.parent is not None
    assert response.context.trace_id == TRACE
    assert response.parent.span_id == route_span.context.span_id
    attrs = dict(response.attributes or {})
    assert attrs["gen_ai.usage.input_tokens"] == 31
    assert attrs["gen_ai.usage.output_tokens"] == 8
    assert attrs["http.response.status_code"] == 200
    assert attrs["extproc.ttft_s"] == pytest.approx(0.099, abs=1e-6)
    assert [e.name for e in response.events] == ["first_token"]
    assert response.start_time is not None and response.end_time is not None
    assert response.end_time - response.start_time == pytest.approx(0.399e9, rel=1e-3)


async def test_an_unsampled_request_makes_no_span_and_carries_no_trace(
    traced: tuple[DirectorKit, InMemorySpanExporter],
) -> None:
    kit, exporter = traced
    res = await kit.director.route(head(f"00-{TRACE:032x}-{ENVOY_SPAN:016x}-00"), body())
    assert isinstance(res, RouteResult) and res.routed is not None
    assert res.routed.trace == ""
    kit.director.account(record_for(res))
    assert exporter.get_finished_spans() == ()


async def test_a_client_chosen_value_is_cut_to_a_bound(
    traced: tuple[DirectorKit, InMemorySpanExporter],
) -> None:
    kit, exporter = traced
    long_id = "r" * 5000
    res = await kit.director.route(
        RequestHead(
            request_id=long_id, method="POST", path="/v1/chat/completions", headers={},
            traceparent=TRACEPARENT,
        ),
        body(),
    )  # fmt: skip
    assert isinstance(res, RouteResult)
    root = by_name(exporter.get_finished_spans())["extproc.route"]
    assert dict(root.attributes or {})["extproc.request_id"] == "r" * MAX_ATTRIBUTE_CHARS
