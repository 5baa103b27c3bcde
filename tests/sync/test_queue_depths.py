"""Flow control's queue depths on the replica bus: real controllers on two replicas, a peer's
higher band holds this replica's lower band, and a silent peer's depths expire."""

from __future__ import annotations

import asyncio

from extproc.accounting import FairnessCounters, InflightTracker
from extproc.config import FlowControlConfig
from extproc.flowcontrol import Capacity, FlowController, FlowRequest
from extproc.kvcache.approx import ApproximateIndex
from extproc.sync import MemoryNetwork, StateSync
from tests.sync._bus import SETTINGS, Clock

ROOM = {"free": 0}


def capacity(model: str) -> Capacity:
    return Capacity(endpoints=1, free=ROOM["free"], saturation=1.0)


def make(name: str, net: MemoryNetwork, clock: Clock) -> tuple[StateSync, FlowController]:
    flow = FlowController(settings=FlowControlConfig(), capacity=capacity)
    approx = ApproximateIndex(ttl_s=600)
    sync = StateSync(
        replica=name, bus=net.bus(), inflight=InflightTracker(clock=clock),
        fairness=FairnessCounters(), approx=lambda _m: approx, models=lambda: ["m"],
        queues=flow.depths, on_queues=flow.set_remote, settings=SETTINGS, clock=clock,
    )  # fmt: skip
    return sync, flow


async def tick(syncs: list[StateSync], clock: Clock) -> None:
    clock.now += SETTINGS.tick_s
    for s in syncs:
        await s.tick()
    await asyncio.sleep(0.003)


async def test_a_peers_higher_band_holds_ours_until_it_is_served() -> None:
    clock, net = Clock(), MemoryNetwork()
    (sa, fa), (sb, fb) = make("a", net, clock), make("b", net, clock)
    for s in (sa, sb):
        await s._bus.start(s.receive)
    ROOM["free"] = 0
    low = asyncio.create_task(fa.admit(FlowRequest("m", 0, "u", 10)))
    high = asyncio.create_task(fb.admit(FlowRequest("m", 9, "v", 20)))
    await asyncio.sleep(0)
    await tick([sa, sb], clock)
    assert fa.queued_bytes("m") == 30  # its own and the peer's
    ROOM["free"] = 1  # one slot: the peer's high band takes it, not our earlier low one
    assert fa.dispatch() == 0
    assert fb.dispatch() == 1
    (await high).release()
    await tick([sa, sb], clock)  # b says its queue is empty
    assert fa.dispatch() == 1
    (await low).release()
    await tick([sa, sb], clock)
    assert fb.queued_bytes("m") == 0


async def test_a_silent_peers_depths_expire() -> None:
    clock, net = Clock(), MemoryNetwork()
    (sa, fa), (sb, fb) = make("a", net, clock), make("b", net, clock)
    for s in (sa, sb):
        await s._bus.start(s.receive)
    ROOM["free"] = 0
    waiting = asyncio.create_task(fb.admit(FlowRequest("m", 5, "v", 20)))
    await asyncio.sleep(0)
    await tick([sa, sb], clock)
    assert fa.queued_bytes("m") == 20
    await sb._bus.close()  # b dies with its queue
    clock.now += SETTINGS.expire_s + 0.01
    await tick([sa], clock)
    assert fa.queued_bytes("m") == 0  # its band no longer holds anyone here
    waiting.cancel()
