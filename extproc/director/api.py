"""What the protocol edge (server) hands to the request lifecycle, and what it gets back.

The server knows Envoy messages; the director knows requests, routing and accounting.
These plain types are the only thing they share.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from extproc.types import EMPTY_LABELS, TokenUsage

__all__ = [
    "AccessRecord",
    "BodyMode",
    "ImmediateReply",
    "LeaseKey",
    "MetadataValue",
    "Outcome",
    "RequestHandler",
    "RequestHead",
    "RequestTicket",
    "RouteResult",
    "RoutedRequest",
]


class BodyMode(enum.IntEnum):
    """Envoy's ProcessingMode.BodySendMode numbers, as announced in protocol_config."""

    NONE = 0
    STREAMED = 1
    BUFFERED = 2
    BUFFERED_PARTIAL = 3
    FULL_DUPLEX_STREAMED = 4


@dataclass(frozen=True, slots=True)
class RequestHead:
    """The request as seen at its headers."""

    request_id: str
    method: str
    path: str
    headers: Mapping[str, str]  # lower-case names; pseudo-headers (":path") included
    route_name: str | None = None  # xds.route_name attribute, when Envoy sends it
    subset: tuple[str, ...] | None = None  # envoy.lb.subset_hint: pick only among these
    has_body: bool = True
    # The caller's W3C trace context (Envoy's ext_proc span, else the request's header), read
    # only when tracing is on: our routing span continues that trace.
    traceparent: str | None = None


@dataclass(frozen=True, slots=True)
class ImmediateReply:
    """Answer the client directly (errors, /v1/models)."""

    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=lambda: {"content-type": "application/json"})
    details: str = ""


@dataclass(frozen=True, slots=True)
class LeaseKey:
    """Names one routed request's lease on every process: the replica that holds it (host:pid)
    and its number there. It travels in the decision's metadata and comes back in the
    request's access-log record, on whatever process Envoy sends that to."""

    replica: str
    seq: int


class RequestTicket(Protocol):
    """A routed request's claim on its endpoint (the in-flight lease, the user's active count).

    The routing stream ends once its answer is delivered; the request goes on without it. The
    ticket then lives in the routing process's lease book until the request's access-log
    record (on any process, forwarded over the replica bus) or its expiry ends it. The stream
    calls `close()` only when its answer never reached Envoy, or for a `hold`ing result (no
    access log: the stream's end is the request's end). Ending is idempotent."""

    @property
    def key(self) -> LeaseKey: ...

    def close(self) -> None: ...


MetadataValue = str | int | float | bool


@dataclass(frozen=True, slots=True)
class RoutedRequest:
    """What the routing decision knew, as it travels with the request in dynamic metadata
    (`extproc.wire.REQUEST_NAMESPACE`) and comes back in the request's access-log record."""

    model: str
    endpoint: str
    strategy: str
    route: str = ""
    user: str = ""
    prompt_tokens: int = 0  # the gateway's count (tokenized, or estimated when `estimated`)
    estimated: bool = False
    stream: bool = False
    replica: str = ""  # the process that routed it (host:pid)
    # The pick's latency features and prediction (accounting.latency_model.DecisionTag), or "".
    latency: str = ""
    # The routing span as a `traceparent` (sampled requests only, else ""): the access record
    # brings it back, so the response joins the request's trace on whatever process gets it.
    trace: str = ""

    def metadata(self) -> dict[str, MetadataValue]:
        out: dict[str, MetadataValue] = {
            "model": self.model,
            "endpoint": self.endpoint,
            "strategy": self.strategy,
            "prompt_tokens": self.prompt_tokens,
            "estimated": self.estimated,
            "stream": self.stream,
        }
        for key in ("route", "user", "replica", "latency", "trace"):
            value = getattr(self, key)
            if value:
                out[key] = value
        return out


class Outcome(enum.StrEnum):
    """How a response ended, as Envoy saw it."""

    COMPLETE = "complete"
    CLIENT_ABORTED = "client_aborted"  # the client went away (reported as status 499)
    UPSTREAM_FAILED = "upstream_failed"  # reset, refused or timed out upstream


@dataclass(frozen=True, slots=True)
class AccessRecord:
    """One finished request as Envoy's access log reports it: everything needed to account
    it on any process (the routing decision's metadata, the served host, status, usage,
    timings). Durations are seconds from the request's first byte; None when not reached."""

    request_id: str
    status: int  # HTTP status sent to the client; 0 when none was
    outcome: Outcome
    routed: RoutedRequest | None  # None: never routed (rejected at the gateway, accounting off)
    upstream: str | None  # host:port that served it (after retries)
    usage: TokenUsage
    start_time: float  # wall clock, seconds since the epoch
    received_s: float | None = None  # last byte of the client's request received
    upstream_sent_s: float | None = None  # first byte sent upstream
    upstream_first_byte_s: float | None = None  # first byte received from upstream
    first_token_s: float | None = None  # first content token seen in the response body
    upstream_done_s: float | None = None  # last upstream byte received
    attempts: int = 0
    lease: LeaseKey | None = None  # the lease the routing decision took, if any


@dataclass(frozen=True, slots=True)
class RouteResult:
    """A routing decision ready for the wire."""

    destinations: tuple[str, ...]  # first = pick, rest = fallbacks
    set_headers: Mapping[str, str] = field(default_factory=lambda: EMPTY_LABELS)
    body: bytes | None = None  # replacement body (None = unchanged)
    ticket: RequestTicket | None = None  # ended by the access record (see RequestTicket)
    routed: RoutedRequest | None = None  # written to dynamic metadata for the access log
    # No access log reports this request's end: the routing stream stays open for the whole
    # request and its end closes the ticket (a restart of the server then cuts the request).
    hold: bool = False


class RequestHandler(Protocol):
    """Implemented by the director; called by the server once per request."""

    @property
    def max_body_bytes(self) -> int: ...

    async def route(self, head: RequestHead, body: bytes | None) -> RouteResult | ImmediateReply:
        """Decide where the request goes. Never raises: errors come back as ImmediateReply."""
        ...

    def reject(self, head: RequestHead | None, status: int, message: str) -> ImmediateReply:
        """An OpenAI-style error reply produced at the protocol edge (e.g. body too large)."""
        ...

    def account(self, record: AccessRecord) -> None:
        """A request's access-log record, on whatever process Envoy sent it. Never raises."""
        ...
