"""Deadlines that mean something: a request with a TTFT SLO it cannot meet is answered 429 at
once (or as soon as waiting makes it unmeetable), not dispatched to miss it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

from extproc.config import FlowControlConfig
from extproc.flowcontrol import (
    DROPPED_HEADER,
    Capacity,
    FlowController,
    FlowMetrics,
    FlowOutcome,
    FlowRejected,
    FlowRequest,
    Grant,
)
from extproc.flowcontrol.controller import RATE_SAMPLES
from tests._clock import ManualClock


@dataclass
class Pool:
    free: int = 0

    def __call__(self, model: str) -> Capacity:
        return Capacity(endpoints=2, free=self.free, saturation=1.0)


@dataclass
class Kit:
    flow: FlowController
    pool: Pool
    clock: ManualClock
    engine: dict[str, float]


def kit(**settings: object) -> Kit:
    pool, clock = Pool(), ManualClock()
    engine: dict[str, float] = {}  # the predicted TTFT once dispatched, by flow
    flow = FlowController(
        settings=FlowControlConfig(**settings),  # type: ignore[arg-type]
        capacity=pool,
        ttft=lambda r: engine.get(r.flow),
        metrics=FlowMetrics(CollectorRegistry()),
        clock=clock.now,
    )
    return Kit(flow, pool, clock, engine)


def req(flow: str = "f", priority: int = 0, slo_s: float | None = None) -> FlowRequest:
    return FlowRequest(model="m", priority=priority, flow=flow, size=10, slo_ttft_s=slo_s)


def run(coro: Awaitable[None]) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def backlog(k: Kit, per_s: float) -> None:
    """Requests leave the queue at `per_s` a second for a while (the rate slots free at)."""
    for _ in range(RATE_SAMPLES):
        task = asyncio.create_task(k.flow.admit(req("warm")))
        await settle()
        k.clock.advance(1.0 / per_s)
        k.pool.free = 1
        assert k.flow.dispatch() == 1
        (await task).release()
        k.pool.free = 0


def test_an_slo_no_pod_can_meet_is_refused_even_with_room() -> None:
    async def main() -> None:
        k = kit()
        k.pool.free = 4
        k.engine["f"] = 0.3  # the best pod's predicted TTFT
        with pytest.raises(FlowRejected) as err:
            await k.flow.admit(req(slo_s=0.2))
        assert err.value.status == 429
        assert err.value.headers[DROPPED_HEADER] == "rejected-slo-unmet"
        assert "300 ms on the best endpoint" in err.value.message
        grant = await k.flow.admit(req(slo_s=0.5))  # one it can meet goes at once
        assert isinstance(grant, Grant)
        grant.release()
        grant = await k.flow.admit(req())  # no SLO: nothing to meet
        grant.release()

    run(main())


def test_the_wait_for_the_requests_ahead_counts_against_the_slo() -> None:
    async def main() -> None:
        k = kit(fairness="global-strict")
        await backlog(k, per_s=10.0)  # one leaves every 0.1 s
        ahead = [asyncio.create_task(k.flow.admit(req("other"))) for _ in range(9)]
        await settle()
        k.engine["f"] = 0.05
        # 9 ahead + itself at 10 a second = 1.0 s, + 0.05 s on the pod: over 0.8 s.
        with pytest.raises(FlowRejected) as err:
            await k.flow.admit(req(slo_s=0.8))
        assert err.value.outcome is FlowOutcome.SLO_UNMET
        assert "1000 ms waiting for room" in err.value.message
        late = asyncio.create_task(k.flow.admit(req(slo_s=1.5)))  # 1.05 s: it may wait
        await settle()
        assert not late.done()
        # A higher band does not wait behind them.
        high = asyncio.create_task(k.flow.admit(req(priority=5, slo_s=0.3)))
        await settle()
        assert not high.done()
        await k.flow.stop()
        for t in (*ahead, late, high):
            (await t).release()

    run(main())


def test_a_request_that_can_no_longer_meet_its_slo_is_refused_while_waiting() -> None:
    async def main() -> None:
        k = kit()
        k.engine["f"] = 0.1
        task = asyncio.create_task(k.flow.admit(req(slo_s=0.5)))  # no rate known: it waits
        await settle()
        k.clock.advance(0.39)
        k.flow.dispatch()
        assert not task.done()
        k.clock.advance(0.02)  # 0.41 s waited + 0.1 s on the pod: past 0.5 s
        k.flow.dispatch()
        with pytest.raises(FlowRejected) as err:
            await task
        assert err.value.outcome is FlowOutcome.SLO_UNMET
        assert k.flow.queued == 0
        # The same request given room in time is dispatched, not refused.
        task = asyncio.create_task(k.flow.admit(req(slo_s=0.5)))
        await settle()
        k.clock.advance(0.3)
        k.pool.free = 1
        assert k.flow.dispatch() == 1
        (await task).release()

    run(main())


def test_without_a_known_rate_nothing_is_refused_on_a_guess() -> None:
    async def main() -> None:
        k = kit()
        tasks = [asyncio.create_task(k.flow.admit(req("other"))) for _ in range(50)]
        await settle()
        slo = asyncio.create_task(k.flow.admit(req(slo_s=0.2)))
        await settle()
        assert not slo.done()  # no dispatch seen yet: the wait is unknown, it waits
        await k.flow.stop()
        for t in (*tasks, slo):
            (await t).release()

    run(main())
