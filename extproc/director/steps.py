"""The built-in lifecycle steps (kinds in `lifecycle.py`), in the order the director runs them.

admit:        ShedSheddable
pre-request:  RecordPick, RewriteBody, RemotePrefill, SessionAffinity, ExplainHeader,
              TagForAccounting
claim:        ClaimEndpoint
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from extproc.accounting.gateway_metrics import GatewayMetrics
from extproc.director.api import RoutedRequest
from extproc.director.explain import explain_header
from extproc.director.leases import LeaseBook, Ticket
from extproc.director.lifecycle import Outgoing, PreparedRequest
from extproc.director.prefill import PrefillClient, PrefillError
from extproc.routing.base import Decision
from extproc.routing.saturation import SaturationConfig, is_saturated
from extproc.routing.session import SessionTokens
from extproc.types import RequestKind, TooManyRequests

__all__ = [
    "DEFAULT_OUTPUT_ESTIMATE",
    "EXPLAIN_HEADER",
    "ClaimEndpoint",
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
    """429 for a sheddable request (priority < 0) when every candidate is saturated.

    The director counts the shed (a real request's, not an explain's)."""

    def __init__(self, *, saturation: SaturationConfig) -> None:
        self._saturation = saturation

    def admit(self, req: PreparedRequest) -> None:
        if (
            req.routing.priority < 0
            and req.settings.shed_sheddable
            and is_saturated(req.pods, self._saturation)
        ):
            raise TooManyRequests("every endpoint is saturated; sheddable request dropped")


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

    async def pre_request(self, req: PreparedRequest, decision: Decision, out: Outgoing) -> None:
        address = decision.endpoint.address
        blocks = req.routing.block_hashes
        req.runtime.prefix.record(address, blocks, self._clock())
        pod = req.pod(address)
        if self._on_routed is not None:
            # Only a prompt with full blocks the pick does not hold yet makes the engine
            # publish (BlockStored); a shorter one, or a full cache hit, is rightly silent.
            cached = 0 if pod is None else pod.prefix_match_tokens // max(1, req.routing.block_size)
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

    async def pre_request(self, req: PreparedRequest, decision: Decision, out: Outgoing) -> None:
        if req.req.kind is RequestKind.OTHER:
            return  # its body was not parsed: forward it as the client sent it
        if req.served_model != req.req.model:
            out.model = req.served_model
        settings = req.settings
        inject = (
            settings.inject_include_usage
            if settings.inject_include_usage is not None
            else self._inject
        )
        # Only chat and completions streams report usage on request; the others always do.
        usage_opt_in = req.req.kind in (RequestKind.CHAT, RequestKind.COMPLETION)
        out.include_usage = settings.accounting and inject and usage_opt_in


class RemotePrefill:
    """P/D disaggregation: run the prefill on the decision's prefill pod and hand its KV handle
    to the decode pod. Without a prefill pod or on failure, the decode pod does it all."""

    def __init__(self, *, client: PrefillClient | None, metrics: GatewayMetrics) -> None:
        self._client = client
        self._metrics = metrics

    async def pre_request(self, req: PreparedRequest, decision: Decision, out: Outgoing) -> None:
        if decision.prefill is not None:
            out.kv_transfer_params = await self._prefill(req, decision)
        elif decision.disaggregated:
            self._metrics.observe_pd_fallback(req.runtime.name)  # no ready prefill pod

    async def _prefill(self, req: PreparedRequest, decision: Decision) -> dict[str, Any] | None:
        prefill = decision.prefill
        assert prefill is not None
        if self._client is None:
            self._metrics.observe_pd_fallback(req.runtime.name)
            return None
        head = req.head
        try:
            return await self._client.prefill(prefill, head.path, req.req.body, head.headers)
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

    async def pre_request(self, req: PreparedRequest, decision: Decision, out: Outgoing) -> None:
        if decision.session_id is not None or req.routing.session_id is not None:
            sid = self._tokens.token(req.runtime.name, decision.endpoint.address)
            out.set_headers[self._header] = sid


class ExplainHeader:
    """`x-routing-explain: true` (when the server allows it): the decision in a header."""

    def __init__(self, *, allowed: bool) -> None:
        self._allowed = allowed

    async def pre_request(self, req: PreparedRequest, decision: Decision, out: Outgoing) -> None:
        if not self._allowed or req.head.headers.get(EXPLAIN_HEADER, "").lower() != "true":
            return
        text = explain_header(decision, req.pods)
        out.set_headers[EXPLAIN_HEADER] = text
        log.debug("routing explain %s: %s", req.routing.request_id, text)


class TagForAccounting:
    """What the decision knew, as dynamic metadata the request's access-log record carries
    back to whichever process accounts it. None on routes with accounting off."""

    def __init__(self, *, replica: str) -> None:
        self._replica = replica

    async def pre_request(self, req: PreparedRequest, decision: Decision, out: Outgoing) -> None:
        if not req.settings.accounting:
            return
        out.routed = RoutedRequest(
            model=req.runtime.name,
            endpoint=decision.endpoint.address,
            strategy=decision.strategy,
            route=req.head.route_name or "",
            user=req.routing.user or "",
            prompt_tokens=req.routing.prompt_tokens,
            estimated=req.estimated,
            stream=req.req.stream,
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

    def claim(self, req: PreparedRequest, decision: Decision) -> Ticket:
        routing = req.routing
        max_out = routing.max_tokens if routing.max_tokens is not None else DEFAULT_OUTPUT_ESTIMATE
        # The lease's tokens are the work this request adds to the pod: its prompt tokens the
        # pod does not hold yet, and its output. A cached prefix costs no prefill and its blocks
        # are counted once (Dynamo's active blocks dedupe shared prefixes the same way); counting
        # it made a pod serving three questions on one document look busier than an idle pod
        # without it, so kv-aware spread documents and evicted them (docs/benchmarks.md §3.3).
        # A route with accounting off has no records: its requests never count towards the
        # stall detector.
        pod = req.pod(decision.endpoint.address)
        cached = pod.prefix_match_tokens if pod is not None else 0
        lease = self._inflight.start(
            decision.endpoint,
            max(0, routing.prompt_tokens - cached) + max_out,
            watched=req.settings.accounting,
        )
        if routing.user:
            self._fairness.request_started(routing.user, routing.prompt_tokens)
        return self._leases.issue(lease, user=routing.user, model=req.runtime.name)
