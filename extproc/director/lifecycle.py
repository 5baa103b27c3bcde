"""The request lifecycle's step kinds: what the director runs, in order, for every request.

    route():   parse (parse, resolve, tokenize)                 -- Director._parse
               flow control       FlowStep.admit(parsed)         -- may wait, may reject
               observe (the candidates' state now)              -- Director.observe
               admit steps        AdmitStep.admit(req)           -- may reject (raise)
               decide             the strategy ranks the candidates
               pre-request steps  PreRequestStep.pre_request(req, decision, out)
               claim              Claim.claim(req, decision)     -- the last step, never awaits
    account(): response-complete  ResponseCompleteStep.complete(done), per access-log record

One signature per kind, as the Gateway API Inference Extension's request-control plugins
(Admit / PreRequest / ResponseComplete). A step holds what it needs from construction and
is testable alone: build it, call it with a `PreparedRequest` (and a Decision), read `out`.
The built-in steps are in `steps.py` (admit, pre-request, claim) and `response.py`
(response-complete); the director lists them in `Director.__init__`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from extproc.config import RouteSettings
from extproc.director.api import AccessRecord, RequestHead, RequestTicket, RoutedRequest
from extproc.director.snapshot import pod_at
from extproc.kvcache.prefix import PrefixIndex
from extproc.protocol.openai import rewrite_body
from extproc.routing.base import Decision, PodState, RoutingRequest, Strategy
from extproc.routing.rewrites import RewriteChoice
from extproc.tokenization import TokenizerPool
from extproc.types import InferenceRequest

__all__ = [
    "AdmitStep",
    "Claim",
    "Completed",
    "ModelRuntime",
    "Outgoing",
    "Parsed",
    "PreRequestStep",
    "PreparedRequest",
    "ResponseCompleteStep",
]


@dataclass
class ModelRuntime:
    """Everything the lifecycle needs for one served model."""

    name: str
    tokenizer: TokenizerPool
    prefix: PrefixIndex
    block_size: int = 16
    default_strategy: str | None = None
    lora_adapters: frozenset[str] = frozenset()
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Parsed:
    """A request parsed, resolved and tokenized: what stays true while it waits in flow
    control (`Director.observe` adds the candidates' state of the moment it is routed)."""

    head: RequestHead
    req: InferenceRequest
    runtime: ModelRuntime
    served_model: str
    lora: str | None
    settings: RouteSettings
    strategy_name: str
    strategy: Strategy
    token_ids: Sequence[int]
    hashes: tuple[int, ...]
    prompt_tokens: int
    tokenize_s: float
    estimated: bool
    user: str | None
    priority: int
    size: int = 0  # body bytes
    rewrite: RewriteChoice | None = None  # the model rewrite that chose served_model


@dataclass
class PreparedRequest:
    """Everything known about a request before a strategy runs (one per request)."""

    head: RequestHead
    req: InferenceRequest
    runtime: ModelRuntime
    served_model: str  # after the route's model mapping
    lora: str | None
    settings: RouteSettings  # the route's (defaults when the route has none)
    strategy_name: str
    strategy: Strategy
    routing: RoutingRequest
    pods: Sequence[PodState]  # a `PodRows`, or a `SnapshotTable` over many pods
    tokenize_s: float
    estimated: bool  # prompt_tokens is an estimate, not the tokenizer's count
    rewrite: RewriteChoice | None = None  # the model rewrite that chose served_model
    _picked: tuple[str, PodState | None] | None = field(default=None, repr=False)

    def pod(self, address: str) -> PodState | None:
        """The candidate at `address` (the pick, for the pre-request steps), found once: over
        a `SnapshotTable` that is an address lookup and one row built."""
        if self._picked is None or self._picked[0] != address:
            self._picked = (address, pod_at(self.pods, address))
        return self._picked[1]


@dataclass(slots=True)
class Outgoing:
    """What the pre-request steps add to a routed request on its way upstream."""

    model: str | None = None  # the served model name written into the body
    include_usage: bool = False  # ask a streaming engine for `usage` in its last event
    kv_transfer_params: Mapping[str, Any] | None = None  # P/D: the prefill's KV handle
    request_id: str | None = None  # Responses API: the response id, naming the pick
    priority: int | None = None  # the engine's `priority` (vLLM: lower first); None: as sent
    # Headers Envoy sets on the request it forwards (it echoes the session and explain ones
    # to the client).
    set_headers: dict[str, str] = field(default_factory=dict)
    routed: RoutedRequest | None = None  # dynamic metadata for the access log

    def body(self, original: Mapping[str, Any]) -> bytes | None:
        """The rewritten body, or None when the request goes upstream unchanged."""
        return rewrite_body(
            original,
            include_usage=self.include_usage,
            model=self.model,
            kv_transfer_params=self.kv_transfer_params,
            request_id=self.request_id,
            priority=self.priority,
        )


@dataclass(frozen=True, slots=True)
class Completed:
    """One routed request's end, from its access-log record (any process may get it)."""

    record: AccessRecord
    routed: RoutedRequest
    endpoint: str  # the host that served it (after retries), else the pick
    status: int  # the client's status; 499 when the client went away


class AdmitStep(Protocol):
    """Before the decision: raise a GatewayError (e.g. TooManyRequests) to reject."""

    def admit(self, req: PreparedRequest) -> None: ...


class PreRequestStep(Protocol):
    """After the decision, before the claim: prepare the request for the pick (body, headers,
    metadata, index updates). May await (the P/D prefill does); claims nothing."""

    async def pre_request(
        self, req: PreparedRequest, decision: Decision, out: Outgoing
    ) -> None: ...


class Claim(Protocol):
    """The last step: what the request holds until its access record ends it (the ticket, in
    the lease book). Synchronous, so nothing can cancel the request between the claim and the
    ticket reaching the stream."""

    def claim(self, req: PreparedRequest, decision: Decision) -> RequestTicket: ...


class ResponseCompleteStep(Protocol):
    """A consumer of finished requests (tokens, charges, per-pod samples). Must not await."""

    def complete(self, done: Completed) -> None: ...
