"""The director runs the request lifecycle's steps (kinds and order in `lifecycle.py`); the
composition root (`extproc.app`) builds them. It holds no state of its own: what outlives a
config reload (the routing state, the deciding count, the lease book) is handed to it.

The server calls `route()` once per request and ends the routing stream once the answer is
delivered; the returned ticket stays in the lease book (`leases.py`) until the request's
access-log record, handed to `account()` on whatever process Envoy sends it to, ends it.
Everything that becomes an HTTP error is a GatewayError mapped to a reply in `error_reply`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from extproc.accounting.gateway_metrics import GatewayMetrics
from extproc.director.api import AccessRecord, ImmediateReply, RequestHead, RouteResult
from extproc.director.bodyless import Bodyless, destinations
from extproc.director.explain import explain_json
from extproc.director.leases import LeaseBook
from extproc.director.lifecycle import (
    Draft,
    Grant,
    Outgoing,
    Placement,
    Request,
    RoutingState,
    Steps,
)
from extproc.director.response import RecordAccounting
from extproc.director.tracing import (
    decision_attributes,
    rejection_reason,
    request_attributes,
    response_span,
)
from extproc.protocol.errors import error_json
from extproc.tracing import NO_TRACER, RequestTrace, Tracer
from extproc.types import GatewayError, TooManyRequests

__all__ = [
    "ADMIT_SPAN",
    "DECIDE_SPAN",
    "PREPARE_SPAN",
    "PRE_REQUEST_SPAN",
    "Deciding",
    "Director",
    "Limits",
    "redact",
]

log = logging.getLogger("extproc.director")

# The routing span's children: one per phase of the lifecycle.
PREPARE_SPAN = "extproc.prepare"
ADMIT_SPAN = "extproc.admit"
DECIDE_SPAN = "extproc.decide"
PRE_REQUEST_SPAN = "extproc.pre_request"

SENSITIVE_HEADERS = frozenset(
    {"authorization", "proxy-authorization", "x-api-key", "api-key", "cookie"}
)


def redact(headers: Mapping[str, str]) -> dict[str, str]:
    """Headers safe to log: credentials replaced."""
    return {k: ("<redacted>" if k in SENSITIVE_HEADERS else v) for k, v in headers.items()}


@dataclass(frozen=True, slots=True)
class Limits:
    max_body_bytes: int  # larger bodies get 413
    max_pending: int  # requests awaiting a decision; past it, 429 at once
    max_fallbacks: int  # addresses after the pick, for Envoy's retries


class Deciding:
    """Requests between arrival and routing decision (bounded by `Limits.max_pending`): parsed,
    tokenizing, prefilling. A request waiting in an admit step is not deciding: the queue it
    waits in has caps of its own. One per process: it outlives config reloads."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


class Director:
    """Implements `extproc.director.api.RequestHandler`: runs `steps` per request."""

    def __init__(
        self,
        steps: Steps,
        *,
        bodyless: Bodyless,
        leases: LeaseBook,
        state: RoutingState,
        deciding: Deciding,
        metrics: GatewayMetrics,
        limits: Limits,
        tracer: Tracer = NO_TRACER,
    ) -> None:
        self.steps = steps
        self._bodyless = bodyless
        self._leases = leases
        self._state = state
        self._deciding = deciding
        self._metrics = metrics
        self._limits = limits
        self._tracer = tracer
        self._records = RecordAccounting(steps.complete, metrics=metrics)

    # -- RequestHandler ---------------------------------------------------------------------

    @property
    def max_body_bytes(self) -> int:
        return self._limits.max_body_bytes

    def reject(self, head: RequestHead | None, status: int, message: str) -> ImmediateReply:
        err = GatewayError(message)
        err.status = status
        err.error_type = "invalid_request_error" if status < 500 else "internal_error"
        if status == 413:
            err.code = "request_too_large"
        self._metrics.observe_request("", status, "")
        return self.error_reply(err, head.path if head is not None else "")

    def account(self, record: AccessRecord) -> None:
        try:
            if record.lease is not None:
                self._leases.settle(record.lease)  # the request is over: its lease ends
            self._records.account(record)
            if record.routed is not None and record.routed.trace:
                span = response_span(record)  # the response joins the request's trace
                if span is not None:
                    self._tracer.record_response(span)
        except Exception:  # a bug must never end Envoy's access-log stream
            log.exception("cannot account the record of request %s", record.request_id)
            self._metrics.access_records.labels("error").inc()

    async def route(self, head: RequestHead, body: bytes | None) -> RouteResult | ImmediateReply:
        started = time.perf_counter()
        # Bound the work waiting for a decision (tokenizer queue, prefill calls): past the limit
        # shed at once with 429 instead of queueing bodies and growing memory.
        limit = self._limits.max_pending
        if self._deciding.count >= limit:
            self._metrics.observe_shed("", "overloaded")
            self._metrics.observe_request("", 429, "")
            log.info(
                "request %s shed: %d requests already awaiting a decision", head.request_id, limit
            )
            err = TooManyRequests(
                f"the gateway is overloaded ({limit} requests awaiting a routing decision)"
            )
            shed = self._tracer.begin(head.traceparent)
            shed.fail(err.status, "overloaded")
            shed.end()
            return self.error_reply(err, head.path)
        # The routing span, a child of the caller's (NO_TRACE when tracing is off or the
        # request is not sampled: then nothing below costs anything).
        trace = self._tracer.begin(head.traceparent)
        self._deciding.count += 1
        try:
            return await self._route(head, body, started, trace)
        except GatewayError as err:
            trace.fail(err.status, rejection_reason(err))
            self._metrics.observe_request("", err.status, "")
            log.info(
                "request %s %s rejected with %d: %s",
                head.request_id, head.path, err.status, err.message,
            )  # fmt: skip
            return self.error_reply(err, head.path)
        except Exception:  # a bug must never crash the stream: answer 500 and log it
            log.exception("unexpected error routing request %s", head.request_id)
            trace.fail(500, "internal_error")
            self._metrics.observe_request("", 500, "")
            return self.error_reply(
                GatewayError("internal error while routing the request"), head.path
            )
        finally:
            self._deciding.count -= 1
            trace.end()

    # -- the lifecycle ------------------------------------------------------------------------

    async def _route(
        self, head: RequestHead, body: bytes | None, started: float, trace: RequestTrace
    ) -> RouteResult | ImmediateReply:
        """The steps in order, each phase a child span of the request's trace (the one place
        spans are made: no step knows of tracing)."""
        if body is None or not head.has_body:
            return self._bodyless.route(head)
        with trace.phase(PREPARE_SPAN):  # parse, resolve, tokenize
            req = await self._prepare(head, body, self._state, dry_run=False)
        if trace.recording:
            trace.annotate(request_attributes(req))
        with trace.phase(ADMIT_SPAN):  # the flow-control wait
            grants, waited = await self._admit(req)
        try:
            room = tuple(pod for grant in grants for pod in grant.pods)
            return await self._routed(req, started + waited, room, trace, waited)
        finally:
            for grant in grants:  # the claim holds the request's place now
                grant.release()

    async def _prepare(
        self, head: RequestHead, body: bytes, state: RoutingState, *, dry_run: bool
    ) -> Request:
        draft = Draft(
            head, body, request_id=head.request_id or uuid.uuid4().hex, rng=state.rng,
            dry_run=dry_run,
        )  # fmt: skip
        for step in self.steps.prepare:
            await step.prepare(draft)
        return draft.request()

    async def _admit(self, req: Request) -> tuple[list[Grant], float]:
        """The admit steps' grants, and the seconds the steps that waited took (not decision
        time). Waiting for admission is not deciding: the queue has caps of its own."""
        grants: list[Grant] = []
        waited = 0.0
        self._deciding.count -= 1
        try:
            for step in self.steps.admit:
                before = time.perf_counter()
                grant = await step.admit(req)
                grants.append(grant)
                if grant.waited_s > 0:
                    waited += time.perf_counter() - before
        except BaseException:
            for grant in grants:
                grant.release()
            raise
        finally:
            self._deciding.count += 1
        return grants, waited

    async def _routed(
        self,
        req: Request,
        started: float,
        room: tuple[str, ...],
        trace: RequestTrace,
        waited: float,
    ) -> RouteResult:
        """Place, decide, the pre-request steps, then the claim. The claim comes last, after
        the last await and anything that can raise, so a cancelled stream cannot leave one
        behind: the ticket reaches the stream, which closes it when the request ends."""
        steps = self.steps
        with trace.phase(DECIDE_SPAN):
            place = steps.place.place(req, room)  # among the pods admitted into, if named
            decision = steps.decide.decide(req, place, self._state)
        out = Outgoing()
        with trace.phase(PRE_REQUEST_SPAN):
            for step in steps.pre_request:
                await step.pre_request(req, place, decision, out)
        body_out = out.body(req.parsed.body)
        to = destinations(decision, self._limits.max_fallbacks)
        if trace.recording:
            trace.annotate(
                decision_attributes(req, place, decision, fallbacks=len(to) - 1, waited_s=waited)
            )
            if out.routed is not None:  # the access record brings the routing span back
                out.routed = dataclasses.replace(out.routed, trace=trace.traceparent)
        ticket = steps.claim.claim(req, place, decision)
        log.debug(
            "routed %s model=%s strategy=%s -> %s (prompt %d tokens%s)",
            req.request_id, req.runtime.name, decision.strategy, ",".join(to),
            req.prompt.tokens, ", estimated" if req.prompt.estimated else "",
        )  # fmt: skip
        self._metrics.observe_decision(req.strategy_name, time.perf_counter() - started)
        self._metrics.observe_plugins(decision.timings)
        return RouteResult(
            destinations=to, set_headers=out.set_headers, body=body_out, ticket=ticket,
            routed=out.routed, hold=not self._leases.records,
        )  # fmt: skip

    async def dry_run(
        self, head: RequestHead, body: bytes, state: RoutingState | None = None
    ) -> tuple[Request, Placement]:
        """The request as `route` would prepare, admit and place it, as a dry run: no step
        waits, counts or claims. Draws from `state` (default: a copy of the live one)."""
        state = state if state is not None else self._state.copy()
        req = await self._prepare(head, body, state, dry_run=True)
        for step in self.steps.admit:
            (await step.admit(req)).release()
        return req, self.steps.place.place(req)

    async def explain(self, head: RequestHead, body: bytes) -> dict[str, Any]:
        """What `route` would decide, without routing: a dry run (no pre-request step) on
        copies of the random state and routing memory, so it shows the next decision and
        leaves it as it was."""
        state = self._state.copy()
        req, place = await self.dry_run(head, body, state)
        decision = self.steps.decide.decide(req, place, state)
        return explain_json(
            decision, place.pods, place.routing, tokenize_s=req.prompt.tokenize_s,
            estimated=req.prompt.estimated,
        )  # fmt: skip

    # -- reading -----------------------------------------------------------------------------

    @property
    def deciding(self) -> int:
        """Requests between arrival and routing decision (bounded by server.max_pending_requests)."""
        return self._deciding.count

    def lease_count(self) -> int:
        return self._leases.inflight.total()

    @staticmethod
    def error_reply(err: GatewayError, path: str = "") -> ImmediateReply:
        """The error's body in the shape the path's clients read (Anthropic on /v1/messages),
        with the error's own headers (flow control's reason and Retry-After)."""
        headers = {"content-type": "application/json", **err.headers}
        return ImmediateReply(
            status=err.status, body=error_json(err, path=path), headers=headers,
            details=f"extproc_{err.status}",
        )  # fmt: skip
