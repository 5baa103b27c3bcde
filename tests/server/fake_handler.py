"""A RequestHandler fake for driving the protocol edge without routing (next to the interface it fakes)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from extproc.director.api import ImmediateReply, RequestHead, RouteResult


@dataclass
class RecordingObserver:
    events: list[tuple[str, object]] = field(default_factory=list)
    finished: bool | None = None

    def on_headers(self, status: int, headers: Mapping[str, str]) -> None:
        self.events.append(("headers", status))

    def on_body(self, chunk: bytes, end_of_stream: bool) -> None:
        self.events.append(("body", (chunk, end_of_stream)))

    def finish(self, *, complete: bool) -> Mapping[str, float]:
        if self.finished is None:
            self.finished = complete
        return {"llm_input_token": 3.0, "llm_output_token": 2.0} if complete else {}


@dataclass
class FakeHandler:
    destinations: tuple[str, ...] = ("10.0.0.1:8000", "10.0.0.2:8000")
    max_body_bytes: int = 1024
    new_body: bytes | None = None
    reply: ImmediateReply | None = None
    seen: list[tuple[RequestHead, bytes | None]] = field(default_factory=list)
    observers: dict[str, RecordingObserver] = field(default_factory=dict)

    async def route(self, head: RequestHead, body: bytes | None) -> RouteResult | ImmediateReply:
        self.seen.append((head, body))
        if self.reply is not None:
            return self.reply
        obs = RecordingObserver()
        self.observers[head.request_id] = obs
        return RouteResult(
            destinations=self.destinations,
            set_headers={"x-routing-strategy": "fake"},
            body=self.new_body,
            observer=obs,
        )

    def reject(self, head: RequestHead | None, status: int, message: str) -> ImmediateReply:
        return ImmediateReply(status=status, body=message.encode())

    closed: list[str] = field(default_factory=list)

    def observer_for(self, request_id: str) -> RecordingObserver | None:
        return self.observers.get(request_id)

    def request_closed(self, request_id: str) -> None:
        self.closed.append(request_id)
