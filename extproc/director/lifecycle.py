"""The request lifecycle's step kinds and what they pass along.

    route():  prepare steps    PrepareStep.prepare(draft)                   -> the Request
              admit steps      AdmitStep.admit(req) -> Grant                may wait, may reject
              place            PlaceStep.place(req) -> Placement            the candidates now
              decide           DecideStep.decide(req, place, state)         the strategy ranks
              pre-request      PreRequestStep.pre_request(req, place, decision, out)
              claim            Claim.claim(req, place, decision)            last; never awaits
    account(): response-complete  ResponseCompleteStep.complete(done), per access-log record

A `Request` is what never changes once parsed (head, body, model, strategy, attributes, prompt
tokens); a `Placement` is one attempt to place it (the candidates' state of that moment and the
routing layer's view of the request). One signature per kind, as the Gateway API Inference
Extension's request-control plugins (Admit / PreRequest / ResponseComplete); a step holds what
it needs from construction and is testable alone. The composition root (`extproc.app`) builds
the lists (`Steps`); the director (`director.py`) only runs them. Built-in steps: `prepare.py`,
`flow.py` and `steps.py` (admit), `placement.py`, `steps.py` (decide, pre-request, claim),
`responses.py`, `latency.py`, `response.py` (response-complete).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from extproc.config import RouteSettings
from extproc.director.api import AccessRecord, RequestHead, RequestTicket, RoutedRequest
from extproc.director.attributes import RequestAttributes
from extproc.director.snapshot import pod_at
from extproc.kvcache.prefix import PrefixIndex
from extproc.protocol.openai import rewrite_body
from extproc.routing.base import Decision, PodState, RoutingMemory, RoutingRequest, Strategy
from extproc.routing.rewrites import RewriteChoice
from extproc.tokenization import TokenizerPool
from extproc.types import InferenceRequest

__all__ = [
    "ADMITTED",
    "AdmitStep",
    "Claim",
    "Completed",
    "DecideStep",
    "Draft",
    "Grant",
    "ModelRuntime",
    "Outgoing",
    "PlaceStep",
    "Placement",
    "PreRequestStep",
    "PrepareStep",
    "Prompt",
    "Request",
    "ResponseCompleteStep",
    "RoutingState",
    "Steps",
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


class RoutingState:
    """What decisions carry from one to the next: the random source and the rules' memory (a
    round-robin's turn). One per process, kept across config reloads; an explain draws from a
    `copy()`, so it shows the next decision and leaves it as it was."""

    __slots__ = ("memory", "rng")

    def __init__(self, rng: random.Random, memory: RoutingMemory | None = None) -> None:
        self.rng = rng
        self.memory = memory if memory is not None else RoutingMemory()

    def copy(self) -> RoutingState:
        rng = random.Random()
        rng.setstate(self.rng.getstate())
        return RoutingState(rng, self.memory.copy())


@dataclass(frozen=True, slots=True)
class Prompt:
    """The prompt as the routing rules read it."""

    token_ids: Sequence[int]  # empty when the rule reads no tokens (not tokenized)
    hashes: tuple[int, ...]  # chained hashes of its full blocks
    tokens: int  # exact when tokenized, else estimated
    tokenize_s: float
    estimated: bool  # `tokens` is an estimate, not the tokenizer's count


@dataclass(frozen=True, slots=True)
class Request:
    """A request parsed, resolved and tokenized: what stays true while it waits for admission
    and through every attempt to place it."""

    head: RequestHead
    request_id: str  # the head's, else one made up
    size: int  # body bytes
    dry_run: bool  # an explain: no step leaves a trace (counts, queues, metrics)
    parsed: InferenceRequest
    settings: RouteSettings  # the route's (defaults when the route has none)
    attributes: RequestAttributes
    runtime: ModelRuntime
    served_model: str  # after the route's model mapping or a model rewrite
    lora: str | None
    rewrite: RewriteChoice | None  # the model rewrite that chose served_model
    strategy_name: str
    strategy: Strategy
    prompt: Prompt


class Draft:
    """A request while the prepare steps build it. Each step sets the fields it is for, in the
    order the composition root lists them (a field read before a step set it is a wiring error:
    AttributeError); `request()` freezes the result."""

    __slots__ = (
        "attributes",
        "body",
        "dry_run",
        "head",
        "lora",
        "parsed",
        "prompt",
        "request_id",
        "rewrite",
        "rng",
        "runtime",
        "served_model",
        "settings",
        "strategy",
        "strategy_name",
    )

    parsed: InferenceRequest
    settings: RouteSettings
    attributes: RequestAttributes
    runtime: ModelRuntime
    served_model: str
    lora: str | None
    rewrite: RewriteChoice | None
    strategy_name: str
    strategy: Strategy
    prompt: Prompt

    def __init__(
        self, head: RequestHead, body: bytes, *, request_id: str, rng: random.Random, dry_run: bool
    ) -> None:
        self.head = head
        self.body = body
        self.request_id = request_id
        self.rng = rng  # the decision's random source (an explain's copy)
        self.dry_run = dry_run

    def request(self) -> Request:
        return Request(
            head=self.head, request_id=self.request_id, size=len(self.body), dry_run=self.dry_run,
            parsed=self.parsed, settings=self.settings, attributes=self.attributes,
            runtime=self.runtime, served_model=self.served_model, lora=self.lora,
            rewrite=self.rewrite, strategy_name=self.strategy_name, strategy=self.strategy,
            prompt=self.prompt,
        )  # fmt: skip


@dataclass(slots=True)
class Placement:
    """One attempt to place a request: its candidates as the strategy sees them now, and the
    routing layer's view of the request (`placement.routing_request`)."""

    pods: Sequence[PodState]  # a `PodRows`, or a `SnapshotTable` over many pods
    routing: RoutingRequest
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


class Grant(Protocol):
    """An admit step's answer: the request may go on. `release()` (idempotent) once the
    request's claim is made, which then holds its place; `waited_s`: how long it waited;
    `pods`: the pods it was admitted into (flow control's room), the place step's candidates
    narrowed to them; empty: no restriction."""

    @property
    def waited_s(self) -> float: ...

    @property
    def pods(self) -> tuple[str, ...]: ...

    def release(self) -> None: ...


class _Admitted:
    """The grant of a step that never waits and holds nothing."""

    __slots__ = ()
    waited_s = 0.0
    pods: tuple[str, ...] = ()

    def release(self) -> None:
        pass


ADMITTED: Grant = _Admitted()


class PrepareStep(Protocol):
    """Builds the request: sets its part of the draft (parse, resolve, tokenize). May await
    (tokenizing does); raise a GatewayError to reject."""

    async def prepare(self, draft: Draft) -> None: ...


class AdmitStep(Protocol):
    """Before the request is placed: may wait (flow control holds it for room), raise a
    GatewayError to reject (429, 503), or return a grant. Time spent waiting is neither
    decision time nor counted as deciding. In a dry run (`req.dry_run`) it must not wait."""

    async def admit(self, req: Request) -> Grant: ...


class PlaceStep(Protocol):
    """The candidates and their state now; raise a GatewayError when there are none."""

    def place(self, req: Request, room: Sequence[str] = ()) -> Placement: ...


class DecideStep(Protocol):
    """Ranks the placement's candidates (the strategy), with the state's random source and
    memory; raise a GatewayError when it refuses (an SLO no pod meets)."""

    def decide(self, req: Request, place: Placement, state: RoutingState) -> Decision: ...


class PreRequestStep(Protocol):
    """After the decision, before the claim: prepare the request for the pick (body, headers,
    metadata, index updates). May await (the P/D prefill does); claims nothing."""

    async def pre_request(
        self, req: Request, place: Placement, decision: Decision, out: Outgoing
    ) -> None: ...


class Claim(Protocol):
    """The last step: what the request holds until its access record ends it (the ticket, in
    the lease book). Synchronous, so nothing can cancel the request between the claim and the
    ticket reaching the stream."""

    def claim(self, req: Request, place: Placement, decision: Decision) -> RequestTicket: ...


class ResponseCompleteStep(Protocol):
    """A consumer of finished requests (tokens, charges, per-pod samples). Must not await."""

    def complete(self, done: Completed) -> None: ...


@dataclass(frozen=True)
class Steps:
    """Every step the director runs, in order, per kind (built by the composition root)."""

    prepare: Sequence[PrepareStep]
    admit: Sequence[AdmitStep]
    place: PlaceStep
    decide: DecideStep
    pre_request: Sequence[PreRequestStep]
    claim: Claim
    complete: Sequence[ResponseCompleteStep]
