"""A RequestHandler fake for driving the protocol edge without routing (next to the interface it fakes)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from extproc.director.api import (
    AccessRecord,
    ImmediateReply,
    LeaseKey,
    RequestHead,
    RoutedRequest,
    RouteResult,
)


@dataclass
class RecordingTicket:
    key: LeaseKey = field(default_factory=lambda: LeaseKey("fake:1", 1))
    closes: int = 0

    def close(self) -> None:
        self.closes += 1


@dataclass
class FakeHandler:
    destinations: tuple[str, ...] = ("10.0.0.1:8000", "10.0.0.2:8000")
    max_body_bytes: int = 1024
    new_body: bytes | None = None
    reply: ImmediateReply | None = None
    seen: list[tuple[RequestHead, bytes | None]] = field(default_factory=list)
    tickets: dict[str, RecordingTicket] = field(default_factory=dict)
    records: list[AccessRecord] = field(default_factory=list)
    fail_accounting: bool = False
    hold: bool = False  # no access log: the stream is held for the request's life
    after_route: Callable[[], None] | None = None  # called as each decision returns

    async def route(self, head: RequestHead, body: bytes | None) -> RouteResult | ImmediateReply:
        self.seen.append((head, body))
        if self.reply is not None:
            return self.reply
        ticket = RecordingTicket(key=LeaseKey("fake:1", len(self.tickets) + 1))
        self.tickets[head.request_id] = ticket
        if self.after_route is not None:
            self.after_route()
        return RouteResult(
            destinations=self.destinations,
            set_headers={"x-routing-strategy": "fake"},
            body=self.new_body,
            ticket=ticket,
            routed=RoutedRequest(
                model="m", endpoint=self.destinations[0], strategy="fake", prompt_tokens=7
            ),
            hold=self.hold,
        )

    def reject(self, head: RequestHead | None, status: int, message: str) -> ImmediateReply:
        return ImmediateReply(status=status, body=message.encode())

    def account(self, record: AccessRecord) -> None:
        if self.fail_accounting:
            raise RuntimeError("accounting bug")
        self.records.append(record)
