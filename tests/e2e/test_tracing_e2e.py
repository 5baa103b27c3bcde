"""Traces end to end: real Envoy with its OpenTelemetry tracer, the real server with tracing
on, and a real OTLP/gRPC receiver. Envoy's request span and our routing span share one trace id,
ours a descendant of Envoy's (through Envoy's ext_proc call); the response from the access record
joins it; what the spans say is what was decided, and never the prompt."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from extproc.stack.local import LocalStack
from extproc.stack.otlp import ReceivedSpan, SpanReceiver, span_tree
from tests.e2e.harness import running_stack, stack_options

pytestmark = pytest.mark.e2e

SECRET = "a prompt nobody may read: pelican-4471"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-b7ad6b7169203331-01"
OURS = ("extproc.route", "extproc.prepare", "extproc.admit", "extproc.decide")


@pytest.fixture(scope="module")
def receiver() -> Iterator[SpanReceiver]:
    with SpanReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, receiver: SpanReceiver) -> Iterator[LocalStack]:
    opts = stack_options(tmp_path_factory.mktemp("stack"), sims=2, tracing=receiver.address)
    with running_stack(opts) as s:
        yield s


def _trace(spans: list[ReceivedSpan], trace_id: str) -> dict[str, list[ReceivedSpan]]:
    out: dict[str, list[ReceivedSpan]] = {}
    for s in spans:
        if s.trace_id == trace_id:
            out.setdefault(s.name, []).append(s)
    return out


def _ancestors(span: ReceivedSpan, spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
    by_id = {s.span_id: s for s in spans}
    chain = []
    while span.parent_span_id in by_id:
        span = by_id[span.parent_span_id]
        chain.append(span)
    return chain


def test_envoys_span_and_ours_share_one_trace(stack: LocalStack, receiver: SpanReceiver) -> None:
    with httpx.Client(base_url=stack.base_url, timeout=30) as http:
        resp = http.post(
            "/v1/chat/completions",
            headers={"traceparent": CLIENT_PARENT, "x-user-id": "carol"},
            json={
                "model": "qwen3",
                "messages": [{"role": "user", "content": SECRET}],
                "max_tokens": 4,
                "stream": True,
            },
        )
    assert resp.status_code == 200, resp.text

    def complete(spans: list[ReceivedSpan]) -> bool:
        names = set(_trace(spans, CLIENT_TRACE))
        return {*OURS, "extproc.response"} <= names and any(
            s.service == "envoy" for s in spans if s.trace_id == CLIENT_TRACE
        )

    spans = [s for s in receiver.wait_for(complete, timeout=20) if s.trace_id == CLIENT_TRACE]
    named = _trace(spans, CLIENT_TRACE)
    assert complete(spans), span_tree(spans, CLIENT_TRACE)
    envoy = [s for s in spans if s.service == "envoy"]
    envoy_root = next(s for s in envoy if s.parent_span_id == "b7ad6b7169203331")
    (route,) = named["extproc.route"]
    assert route.service == "extproc"
    # Ours is a descendant of Envoy's request span (via Envoy's ext_proc gRPC call span).
    chain = _ancestors(route, spans)
    assert envoy_root in chain
    assert all(s.service == "envoy" for s in chain)
    for phase in OURS[1:]:
        (child,) = named[phase]
        assert child.parent_span_id == route.span_id
    attrs = route.attributes
    assert attrs["gen_ai.request.model"] == "qwen3"
    assert attrs["extproc.strategy"] == "least-request"
    assert attrs["extproc.endpoint"] in {stack.options.sim_address(i) for i in range(2)}
    assert attrs["extproc.prompt.tokens"] > 5
    assert "user.hash" in attrs
    # The access record's response joins the trace, as a child of the routing span.
    (response,) = named["extproc.response"]
    assert response.parent_span_id == route.span_id
    assert response.attributes["gen_ai.usage.output_tokens"] == 4
    assert response.attributes["http.response.status_code"] == 200
    assert "extproc.ttft_s" in response.attributes
    # Nothing private in anything exported.
    said = repr([(s.name, dict(s.attributes), s.events) for s in receiver.spans()])
    assert "pelican" not in said and "carol" not in said


def test_a_rejection_is_traced_with_its_status(stack: LocalStack, receiver: SpanReceiver) -> None:
    _reject_traced(stack, receiver, "1af7651916cd43dd8448eb211c80319c")


def _reject_traced(stack: LocalStack, receiver: SpanReceiver, trace: str) -> None:
    """A request for an unknown model, traced: its routing span says 404 and why."""
    with httpx.Client(base_url=stack.base_url, timeout=30) as http:
        resp = http.post(
            "/v1/chat/completions",
            headers={"traceparent": f"00-{trace}-c7ad6b7169203331-01"},
            json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert resp.status_code == 404

    def routed(spans: list[ReceivedSpan]) -> bool:
        return "extproc.route" in _trace(spans, trace)

    (route,) = _trace(receiver.wait_for(routed, timeout=20), trace)["extproc.route"]
    assert route.attributes["http.response.status_code"] == 404
    assert route.attributes["error.type"] == "model_not_found"
    assert route.status_code == 2  # error


def test_an_unsampled_request_leaves_no_span_of_ours(
    stack: LocalStack, receiver: SpanReceiver
) -> None:
    trace = "2af7651916cd43dd8448eb211c80319c"
    with httpx.Client(base_url=stack.base_url, timeout=30) as http:
        resp = http.post(
            "/v1/chat/completions",
            headers={"traceparent": f"00-{trace}-d7ad6b7169203331-00"},
            json={"model": "qwen3", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert resp.status_code == 200
    # A sampled request sent after it: once its spans are in, the unsampled one's would be too.
    _reject_traced(stack, receiver, "3af7651916cd43dd8448eb211c80319c")
    assert "extproc.route" not in _trace(receiver.spans(), trace)
