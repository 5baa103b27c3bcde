"""What the protocol edge (server) hands to the request lifecycle, and what it gets back.

The server knows Envoy messages; the director knows requests, routing and accounting.
These plain types are the only thing they share.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from extproc.types import EMPTY_LABELS

__all__ = [
    "BodyMode",
    "ImmediateReply",
    "RequestHandler",
    "RequestHead",
    "ResponseObserver",
    "RouteResult",
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


@dataclass(frozen=True, slots=True)
class ImmediateReply:
    """Answer the client directly (errors, /v1/models)."""

    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=lambda: {"content-type": "application/json"})
    details: str = ""


class ResponseObserver(Protocol):
    """Watches one response: feeds token accounting and ends the in-flight lease."""

    def on_headers(self, status: int, headers: Mapping[str, str]) -> None: ...

    def on_body(self, chunk: bytes, end_of_stream: bool) -> None: ...

    def finish(self, *, complete: bool) -> Mapping[str, float]:
        """Idempotent. Returns token metadata (io.envoy.ai_gateway keys) when usage is known."""
        ...


@dataclass(frozen=True, slots=True)
class RouteResult:
    """A routing decision ready for the wire."""

    destinations: tuple[str, ...]  # first = pick, rest = fallbacks
    set_headers: Mapping[str, str] = field(default_factory=lambda: EMPTY_LABELS)
    body: bytes | None = None  # replacement body (None = unchanged)
    observer: ResponseObserver | None = None
    response_headers: Mapping[str, str] = field(
        default_factory=lambda: EMPTY_LABELS
    )  # where the mode allows it


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

    def observer_for(self, request_id: str) -> ResponseObserver | None:
        """The observer of a routed request, for a response-only (observability) stream."""
        ...

    def request_closed(self, request_id: str) -> None:
        """The routing stream of a request ended. Envoy keeps it open until the HTTP request
        is over, so an observer no response stream has claimed by then was cancelled early."""
        ...
