"""The flow controller's test kit: a capacity the test sets, a clock the test moves, the
metrics in a registry of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from extproc.config import FlowControlConfig
from extproc.flowcontrol import Capacity, FlowController, FlowMetrics, FlowRequest, Grant
from tests._clock import ManualClock
from tests._metrics import sample


@dataclass
class Pool:
    """The capacity the controller reads: the test sets endpoints and free slots."""

    endpoints: int = 2
    free: int = 0
    calls: int = 0
    line: tuple[str, ...] = ()  # full pods with an empty engine queue
    slots: int = 4  # running slots learned over the pool

    def __call__(self, model: str) -> Capacity:
        self.calls += 1
        pods = ("room:1",) if self.free > 0 else ()
        return Capacity(endpoints=self.endpoints, free=self.free, saturation=1.0, pods=pods,
                        line=self.line, running=self.free, running_pods=pods,
                        slots=self.slots)  # fmt: skip


@dataclass
class Kit:
    flow: FlowController
    pool: Pool
    clock: ManualClock
    registry: CollectorRegistry
    tokens: dict[str, float] = field(default_factory=dict)

    def sample(self, name: str, **labels: str) -> float:
        return sample(self.registry, name, **labels)


def kit(tick_s: float = 0.02, room_cache_s: float = 0.0, **settings: object) -> Kit:
    pool = Pool()
    clock = ManualClock()
    registry = CollectorRegistry()
    tokens: dict[str, float] = {}
    flow = FlowController(
        settings=FlowControlConfig(**settings),  # type: ignore[arg-type]
        tick_s=tick_s,
        capacity=pool,
        tokens=lambda f: tokens.get(f, 0.0),
        metrics=FlowMetrics(registry),
        clock=clock.now,
        room_cache_s=room_cache_s,
    )
    return Kit(flow, pool, clock, registry, tokens)


def req(flow: str = "", priority: int = 0, size: int = 100, **kw: object) -> FlowRequest:
    return FlowRequest(model="m", priority=priority, flow=flow, size=size, **kw)  # type: ignore[arg-type]


async def queued(k: Kit, *requests: FlowRequest) -> list[asyncio.Task[Grant]]:
    tasks = [asyncio.create_task(k.flow.admit(r)) for r in requests]
    for _ in range(3):
        await asyncio.sleep(0)
    assert all(not t.done() for t in tasks), "every request should be waiting"
    return tasks


async def order(k: Kit, tasks: list[asyncio.Task[Grant]], labels: list[str]) -> list[str]:
    """Dispatch one at a time (one free slot, released after each) and read who went."""
    went: list[str] = []
    while len(went) < len(tasks):
        k.pool.free = 1
        assert k.flow.dispatch() == 1
        await asyncio.sleep(0)
        done = [i for i, t in enumerate(tasks) if t.done() and labels[i] not in went]
        assert len(done) == 1
        tasks[done[0]].result().release()
        went.append(labels[done[0]])
    return went


def run(coro: Awaitable[None]) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]
