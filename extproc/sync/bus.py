"""The bus that replicas share state over: a protocol, and an in-memory one for tests.

A bus carries opaque messages on one subject to every subscriber, at most once, in no
guaranteed order. `publish` never waits on the network: it hands the bytes to the client's
buffer and says whether it could (a bus that is down drops, and the caller counts it).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["Bus", "MemoryBus", "MemoryNetwork"]

Handler = Callable[[bytes], None]


class Bus(Protocol):
    @property
    def connected(self) -> bool: ...

    async def start(self, on_message: Handler) -> None:
        """Connect (or begin reconnecting in the background) and deliver every message to
        `on_message`, including this bus's own (the receiver ignores its own)."""
        ...

    async def publish(self, data: bytes) -> bool:
        """Queue one message; False when it was dropped (not connected, buffer full)."""
        ...

    async def close(self) -> None: ...


@dataclass
class MemoryNetwork:
    """Several `MemoryBus`es joined into one subject, with faults to inject: `lag_s` delay,
    `loss` probability, `duplicate` probability, `reorder` (random extra delay up to lag_s),
    `down` (every publish dropped) and `max_bytes` (a larger message is refused, as NATS
    refuses one over its max_payload). Seeded, so a test run is reproducible."""

    lag_s: float = 0.0
    loss: float = 0.0
    duplicate: float = 0.0
    reorder: bool = False
    down: bool = False
    max_bytes: int | None = None
    seed: int = 0
    _handlers: list[Handler] = field(default_factory=list)
    _rng: random.Random = field(init=False)
    delivered: int = 0
    dropped: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def bus(self) -> MemoryBus:
        return MemoryBus(self)

    def _send(self, data: bytes) -> bool:
        if self.down or (self.max_bytes is not None and len(data) > self.max_bytes):
            return False
        copies = 2 if self._rng.random() < self.duplicate else 1
        loop = asyncio.get_running_loop()
        for handler in list(self._handlers):
            for _ in range(copies):
                if self._rng.random() < self.loss:
                    self.dropped += 1
                    continue
                delay = self.lag_s + (self._rng.random() * self.lag_s if self.reorder else 0.0)
                loop.call_later(delay, self._deliver, handler, data)
        return True

    def _deliver(self, handler: Handler, data: bytes) -> None:
        self.delivered += 1
        handler(data)


class MemoryBus:
    """Implements `Bus` inside one event loop (tests and single-process simulations).

    `down` is this bus's own link broken (a NATS client reconnecting): it publishes nothing
    and hears nothing, while the others go on; what is published meanwhile is not replayed
    to it, as core NATS delivers only to the subscriptions that exist at publish time."""

    def __init__(self, network: MemoryNetwork) -> None:
        self._network = network
        self._handler: Handler | None = None
        self.down = False

    @property
    def connected(self) -> bool:
        return not self._network.down and not self.down and self._handler is not None

    async def start(self, on_message: Handler) -> None:
        def deliver(data: bytes) -> None:
            if not self.down:
                on_message(data)

        self._handler = deliver
        self._network._handlers.append(deliver)

    async def publish(self, data: bytes) -> bool:
        if self._handler is None or self.down:
            return False
        return self._network._send(data)

    async def close(self) -> None:
        if self._handler is not None:
            self._network._handlers.remove(self._handler)
            self._handler = None
