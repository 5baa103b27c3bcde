"""NATS test helpers shared by the bus tests: a free port, a bounded wait, what a bus
received, and a round of messages every bus must see."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import pytest

from extproc.sync.nats import NatsBus

USER = "extproc"
SUBJECT = "extproc.sync.test"
WAIT_S = 5.0  # bound on anything that should happen "soon" (reconnects take ~0.5 s)
HANG_S = 2.0  # publish must come back well within this, whatever the server does


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def wait_until(condition: Callable[[], bool], what: str, within: float = WAIT_S) -> None:
    try:
        async with asyncio.timeout(within):
            while not condition():  # noqa: ASYNC110 - client state, no event to await
                await asyncio.sleep(0.01)
    except TimeoutError:
        pytest.fail(f"timed out after {within} s waiting for {what}")


class Inbox:
    """What one bus received."""

    def __init__(self) -> None:
        self.messages: list[bytes] = []

    def __call__(self, data: bytes) -> None:
        self.messages.append(data)

    async def wait_for(self, *expected: bytes) -> None:
        await wait_until(
            lambda: set(expected) <= set(self.messages), f"{expected!r} in {self.messages!r}"
        )


async def start(bus: NatsBus) -> Inbox:
    inbox = Inbox()
    await asyncio.wait_for(bus.start(inbox), HANG_S)  # never waits for the server
    return inbox


async def exchange(buses: dict[NatsBus, Inbox], tag: str) -> None:
    """Every bus publishes one message; every bus receives all of them, its own included."""
    sent = [f"{tag}-{i}".encode() for i in range(len(buses))]
    for bus, data in zip(buses, sent, strict=True):
        assert await asyncio.wait_for(bus.publish(data), HANG_S)
    for inbox in buses.values():
        await inbox.wait_for(*sent)
