"""The built-in lifecycle steps (kinds in `lifecycle.py`) of the admit, decide, pre-request and
claim phases, in the order the composition root lists them.

admit:        ShedSheddable (without flow control; with it, `flow.FlowControl`)
decide:       DecideStrategy
pre-request:  RecordPick, RewriteBody, RemotePrefill, SessionAffinity, (StampResponseId),
              ExplainHeader, TagForAccounting
claim:        ClaimEndpoint
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from extproc.accounting.fairness import FairnessCounters
from extproc.accounting.gateway_metrics import GatewayMetrics
from extproc.director.api import RoutedRequest
from extproc.director.explain import explain_header
from extproc.director.leases import LeaseBook, Ticket
from extproc.director.lifecycle import (
    ADMITTED,
    Grant,
    Outgoing,
    Placement,
    Request,
    RoutingState,
)
from extproc.director.placement import Candidates
from extproc.director.prefill import PrefillClient, PrefillError
from extproc.routing.base import Decision, PodState, Snapshot
from extproc.routing.predicted import SLO_UNMET
from extproc.routing.saturation import SaturationConfig, is_saturated
from extproc.routing.session import SessionTokens
from extproc.types import RequestKind, ServiceUnavailable, TooManyRequests

__all__ = [
    "DEFAULT_OUTPUT_ESTIMATE",
    "EXPLAIN_HEADER",
    "ClaimEndpoint",
    "DecideStrategy",
    "ExplainHeader",
    "RecordPick",
    "RemotePrefill",
    "RewriteBody",
    "SessionAffinity",
    "ShedSheddable",
    "TagForAccounting",
]

log = logging.getLogger("extproc.director")

EXPLAIN_HEADER = "x-routing-explain"
DEFAULT_OUTPUT_ESTIMATE = 256  # in-flight token estimate when a request sets no max_tokens


# -- admit ---------------------------------------------------------------------------------------


class ShedSheddable:
    """429 for a sheddable request (priority < 0, on a route that sheds) when every candidate
    is saturated; counted as shed unless it is a dry run (explain). Never waits."""

    def __init__(
        self,
        *,
        candidates: Candidates,
        metrics: GatewayMetrics,
        saturation: SaturationConfig,
    ) -> None:
        self._candidates = candidates
        self._metrics = metrics
        self._saturation = saturation

    async def admit(self, req: Request) -> Grant:
        if req.attributes.priority >= 0 or not req.settings.shed_sheddable:
            return ADMITTED
        ready = self._candidates.of(req)  # none: the place step answers 503
        if ready and is_saturated([PodState(ep, m) for ep, m in ready], self._saturation):
            if not req.dry_run:
                self._metrics.observe_shed(req.runtime.name, "saturated")
            raise TooManyRequests("every endpoint is saturated; sheddable request dropped")
        return ADMITTED


# -- decide --------------------------------------------------------------------------------------


class DecideStrategy:
    """Implements `DecideStep`: the request's strategy ranks the candidates on one snapshot.
    A refusal (the SLO filter's 429 for a sheddable request) is counted as shed unless it is a
    dry run."""

    def __init__(
        self, *, fairness: FairnessCounters, metrics: GatewayMetrics, clock: Callable[[], float]
    ) -> None:
        self._fairness = fairness
        self._metrics = metrics
        self._clock = clock

    def decide(self, req: Request, place: Placement, state: RoutingState) -> Decision:
        snap = Snapshot(
            now=self._clock(), pods=place.pods, fairness=self._fairness, memory=state.memory
        )
        try:
            decision = req.strategy.route(place.routing, snap, state.rng)
        except TooManyRequests as err:
            if not req.dry_run:
                slo = err.code == SLO_UNMET
                self._metrics.observe_shed(req.runtime.name, "slo" if slo else "saturated")
            raise
        if not decision.ranked:
            raise ServiceUnavailable(f"strategy {req.strategy.name!r} found no endpoint")
        return decision


# -- pre-request ---------------------------------------------------------------------------------


class RecordPick:
    """The pick now holds the prompt's blocks: record them in the approximate index, tell the
    KV-event manager when the pod should now publish events (`on_routed`: the prompt has
    full blocks the pick does not hold), observe the pick's prefix match."""

    def __init__(
        self,
        *,
        metrics: GatewayMetrics,
        clock: Callable[[], float],
        on_routed: Callable[[str], None] | None = None,
    ) -> None:
        self._metrics = metrics
        self._clock = clock
        self._on_routed = on_routed

    async def pre_request(
        self, req: Request, place: Placement, decision: Decision, out: Outgoing
    ) -> None:
        address = decision.endpoint.address
        blocks = req.prompt.hashes
        req.runtime.prefix.record(address, blocks, self._clock())
        pod = place.pod(address)
        if self._on_routed is not None:
            # Only a prompt with full blocks the pick does not hold yet makes the engine
            # publish (BlockStored); a shorter one, or a full cache hit, is rightly silent.
            cached = 0 if pod is None else pod.prefix_match_tokens // max(1, req.runtime.block_size)
            if len(blocks) > cached:
                self._on_routed(address)
        if pod is not None:
            self._metrics.observe_prefix_match(
                req.runtime.name, pod.prefix_match_tokens, exact=pod.prefix_exact
            )


class RewriteBody:
    """Model-name mapping, and `stream_options.include_usage` on streams whose usage the
    route accounts (the engine only reports a stream's usage when asked)."""

    def __init__(self, *, inject_include_usage: bool) -> None:
        self._inject = inject_include_usage

    async def pre_request(
        self, req: Request, place: Placement, decision: Decision, out: Outgoing
    ) -> None:
        if req.parsed.kind is RequestKind.OTHER:
            return  # its body was not parsed: forward it as the client sent it
        if req.served_model != req.parsed.model:
            out.model = req.served_model
        settings = req.settings
        inject = (
            settings.inject_include_usage
            if settings.inject_include_usage is not None
            else self._inject
        )
        # Only chat and completions streams report usage on request; the others always do.
        usage_opt_in = req.parsed.kind in (RequestKind.CHAT, RequestKind.COMPLETION)
        out.include_usage = settings.accounting and inject and usage_opt_in


class RemotePrefill:
    """P/D disaggregation: run the prefill on the decision's prefill pod and hand its KV handle
    to the decode pod. Without a prefill pod or on failure, the decode pod does it all."""

    def __init__(self, *, client: PrefillClient | None, metrics: GatewayMetrics) -> None:
        self._client = client
        self._metrics = metrics

    async def pre_request(
        self, req: Request, place: Placement, decision: Decision, out: Outgoing
    ) -> None:
        if decision.prefill is not None:
            out.kv_transfer_params = await self._prefill(req, decision)
        elif decision.disaggregated:
            self._metrics.observe_pd_fallback(req.runtime.name)  # no ready prefill pod

    async def _prefill(self, req: Request, decision: Decision) -> dict[str, Any] | None:
        prefill = decision.prefill
        assert prefill is not None
        if self._client is None:
            self._metrics.observe_pd_fallback(req.runtime.name)
            return None
        head = req.head
        try:
            return await self._client.prefill(prefill, head.path, req.parsed.body, head.headers)
        except PrefillError as exc:
            log.warning(
                "prefill on %s failed (%s); decoding without remote KV", prefill.address, exc
            )
            self._metrics.observe_pd_fallback(req.runtime.name)
            return None


class SessionAffinity:
    """A request that came with a session id (or that a session rule routed) gets the opaque
    token of the pod it went to, so the client's next turn sticks to it (never the address)."""

    def __init__(self, *, header: str, tokens: SessionTokens) -> None:
        self._header = header
        self._tokens = tokens

    async def pre_request(
        self, req: Request, place: Placement, decision: Decision, out: Outgoing
    ) -> None:
        if decision.session_id is not None or place.routing.session_id is not None:
            sid = self._tokens.token(req.runtime.name, decision.endpoint.address)
            out.set_headers[self._header] = sid


class ExplainHeader:
    """`x-routing-explain: true` (when the server allows it): the decision in a header."""

    def __init__(self, *, allowed: bool) -> None:
        self._allowed = allowed

    async def pre_request(
        self, req: Request, place: Placement, decision: Decision, out: Outgoing
    ) -> None:
        if not self._allowed or req.head.headers.get(EXPLAIN_HEADER, "").lower() != "true":
            return
        text = explain_header(decision, place.pods)
        out.set_headers[EXPLAIN_HEADER] = text
        log.debug("routing explain %s: %s", req.request_id, text)


class TagForAccounting:
    """What the decision knew, as dynamic metadata the request's access-log record carries
    back to whichever process accounts it. None on routes with accounting off."""

    def __init__(self, *, replica: str) -> None:
        self._replica = replica

    async def pre_request(
        self, req: Request, place: Placement, decision: Decision, out: Outgoing
    ) -> None:
        if not req.settings.accounting:
            return
        out.routed = RoutedRequest(
            model=req.runtime.name,
            endpoint=decision.endpoint.address,
            strategy=decision.strategy,
            route=req.head.route_name or "",
            user=req.attributes.user or "",
            prompt_tokens=req.prompt.tokens,
            estimated=req.prompt.estimated,
            stream=req.parsed.stream,
            replica=self._replica,
        )


# -- claim ---------------------------------------------------------------------------------------


class ClaimEndpoint:
    """An in-flight lease on the pick and the user's active count, held by the ticket in the
    lease book until the request's access-log record ends it."""

    def __init__(self, *, leases: LeaseBook) -> None:
        self._leases = leases
        self._inflight = leases.inflight
        self._fairness = leases.fairness

    def claim(self, req: Request, place: Placement, decision: Decision) -> Ticket:
        max_tokens, prompt, user = req.parsed.max_tokens, req.prompt.tokens, req.attributes.user
        max_out = max_tokens if max_tokens is not None else DEFAULT_OUTPUT_ESTIMATE
        # The lease's tokens are the work this request adds to the pod: its prompt tokens the
        # pod does not hold yet, and its output. A cached prefix costs no prefill and its blocks
        # are counted once (Dynamo's active blocks dedupe shared prefixes the same way); counting
        # it made a pod serving three questions on one document look busier than an idle pod
        # without it, so kv-aware spread documents and evicted them (docs/benchmarks.md §3.3).
        # A route with accounting off has no records: its requests never count towards the
        # stall detector.
        pod = place.pod(decision.endpoint.address)
        cached = pod.prefix_match_tokens if pod is not None else 0
        lease = self._inflight.start(
            decision.endpoint, max(0, prompt - cached) + max_out, watched=req.settings.accounting
        )
        if user:
            self._fairness.request_started(user, prompt)
        return self._leases.issue(lease, user=user, model=req.runtime.name)
