"""What a request's spans say (`extproc.tracing` makes them): attributes in the OpenTelemetry
GenAI and HTTP semantic conventions where they exist, `extproc.*` where they do not.

Built from a whitelist of fields, never from the body or the headers wholesale: no prompt text,
no header value, no query string; the user only as `user.hash`. Called only for a request whose
trace is recording.
"""

from __future__ import annotations

import hashlib

from extproc.director.api import AccessRecord, Outcome
from extproc.director.lifecycle import Placement, Request
from extproc.routing.base import Decision
from extproc.tracing import AttributeValue, ResponseSpan, parse_traceparent
from extproc.types import GatewayError, RequestKind

__all__ = [
    "decision_attributes",
    "rejection_reason",
    "request_attributes",
    "response_span",
    "user_hash",
]

# gen_ai.operation.name of each request kind (GenAI semantic conventions' well-known values).
_OPERATION = {
    RequestKind.CHAT: "chat",
    RequestKind.COMPLETION: "text_completion",
    RequestKind.EMBEDDINGS: "embeddings",
    RequestKind.RESPONSES: "chat",
    RequestKind.MESSAGES: "chat",
}


def user_hash(user: str) -> str:
    """The user as OpenTelemetry's `user.hash`: correlates one user's requests, names no one."""
    return hashlib.sha256(user.encode("utf-8", "replace")).hexdigest()[:32]


def request_attributes(req: Request) -> dict[str, AttributeValue]:
    """What is known once the request is parsed, resolved and tokenized."""
    head, parsed, attrs = req.head, req.parsed, req.attributes
    out: dict[str, AttributeValue] = {
        "http.request.method": head.method,
        "url.path": head.path.partition("?")[0],  # a query may carry keys
        "gen_ai.request.model": parsed.model,
        "extproc.request_id": req.request_id,
        "extproc.model": req.runtime.name,
        "extproc.strategy": req.strategy_name,
        "extproc.priority": attrs.priority,
        "extproc.prompt.tokens": req.prompt.tokens,
        "extproc.prompt.estimated": req.prompt.estimated,
        "extproc.stream": parsed.stream,
    }
    operation = _OPERATION.get(parsed.kind)
    if operation is not None:
        out["gen_ai.operation.name"] = operation
    if parsed.max_tokens is not None:
        out["gen_ai.request.max_tokens"] = parsed.max_tokens
    if req.served_model != parsed.model:
        out["extproc.served_model"] = req.served_model
    if head.route_name:
        out["http.route"] = head.route_name
    if attrs.objective:
        out["extproc.objective"] = attrs.objective
    if attrs.user:
        out["user.hash"] = user_hash(attrs.user)
    return out


def decision_attributes(
    req: Request, place: Placement, decision: Decision, *, fallbacks: int, waited_s: float
) -> dict[str, AttributeValue]:
    """The decision: the pick, how many candidates it was chosen from, its prefix hit."""
    pick = decision.endpoint.address
    out: dict[str, AttributeValue] = {
        "extproc.endpoint": pick,
        "extproc.strategy": decision.strategy,
        "extproc.candidates": len(place.pods),
        "extproc.fallbacks": fallbacks,
        "extproc.admit.waited_s": round(waited_s, 6),
    }
    pod = place.pod(pick)
    if pod is not None:
        out["extproc.prefix.hit_blocks"] = pod.prefix_match_tokens // max(1, req.runtime.block_size)
        out["extproc.prefix.hit_tokens"] = pod.prefix_match_tokens
        out["extproc.prefix.exact"] = pod.prefix_exact
    if decision.prefill is not None:
        out["extproc.prefill.endpoint"] = decision.prefill.address
    return out


def rejection_reason(err: GatewayError) -> str:
    """A rejection's low-cardinality reason (flow control's outcome, the error's code or
    type), never its message (which may quote what the client sent)."""
    return err.code or err.error_type


def _ns(start: float, offset_s: float) -> int:
    return int((start + offset_s) * 1e9)


def response_span(record: AccessRecord) -> ResponseSpan | None:
    """The record's response as a span of its request's trace (None: the routing was not
    traced): from the first byte sent upstream to the last received, TTFT and usage as
    attributes, the first token as an event."""
    routed = record.routed
    parent = parse_traceparent(routed.trace) if routed is not None else None
    if routed is None or parent is None or record.start_time <= 0:
        return None
    start = record.start_time
    sent = record.upstream_sent_s or record.received_s or 0.0
    done = record.upstream_done_s
    end = done if done is not None and done >= sent else sent
    attrs: dict[str, AttributeValue] = {
        "http.response.status_code": record.status,
        "gen_ai.request.model": routed.model,
        "extproc.endpoint": record.upstream or routed.endpoint,
        "extproc.outcome": str(record.outcome),
        "extproc.attempts": record.attempts,
    }
    usage = record.usage
    if usage.prompt_tokens is not None:
        attrs["gen_ai.usage.input_tokens"] = usage.prompt_tokens
    if usage.completion_tokens is not None:
        attrs["gen_ai.usage.output_tokens"] = usage.completion_tokens
    if usage.cached_tokens is not None:
        attrs["extproc.usage.cached_input_tokens"] = usage.cached_tokens
    events: tuple[tuple[str, int], ...] = ()
    first = record.first_token_s
    if first is not None:
        attrs["extproc.ttft_s"] = round(max(0.0, first - sent), 6)
        events = (("first_token", _ns(start, first)),)
    error = None
    if record.outcome is not Outcome.COMPLETE:
        error = str(record.outcome)
    elif record.status >= 500:
        error = str(record.status)
    return ResponseSpan(
        parent=parent, start_ns=_ns(start, sent), end_ns=_ns(start, end), attributes=attrs,
        events=events, error=error,
    )  # fmt: skip
