"""Several replicas dispatching from one view of the room: what they send together in one pass
is bounded by the room plus one per other replica (each rounds its share up), whatever their
queues; the in-flight view then tells each what the others sent (one sync tick later)."""

from __future__ import annotations

import asyncio
import random

import pytest

from extproc.config import FlowControlConfig
from extproc.flowcontrol import Capacity, FlowController, FlowRequest, Grant


@pytest.mark.parametrize("seed", range(40))
def test_one_pass_of_every_replica_overshoots_by_at_most_the_replicas_but_one(seed: int) -> None:
    rng = random.Random(seed)
    replicas = rng.randint(2, 4)
    room = rng.randint(0, 6)
    free = {"now": 0}  # full while the requests arrive: every one waits

    async def main() -> None:
        flows = [
            FlowController(
                settings=FlowControlConfig(fairness=rng.choice(["round-robin", "token"])),
                capacity=lambda _m: Capacity(endpoints=2, free=free["now"], saturation=1.0),
            )
            for _ in range(replicas)
        ]
        tasks: list[asyncio.Task[Grant]] = []
        for flow in flows:
            for _ in range(rng.randint(0, 8)):
                band = rng.choice([0, 0, 5])
                request = FlowRequest(model="m", priority=band, flow=str(rng.randint(0, 2)), size=1)
                tasks.append(asyncio.create_task(flow.admit(request)))
        for _ in range(3):
            await asyncio.sleep(0)
        waiting = [f.queued for f in flows]
        # Every replica hears every other's depths (the replica bus), then all dispatch from
        # the same view of the room, before any hears what the others sent.
        for i, flow in enumerate(flows):
            for j, peer in enumerate(flows):
                if i != j:
                    flow.set_remote(str(j), peer.depths())
        free["now"] = room
        sent = [flow.dispatch() for flow in flows]
        assert sum(sent) <= min(sum(waiting), room + replicas - 1)
        if sum(waiting) and room:
            assert sum(sent) >= min(sum(waiting), room)  # and the room is used
        for flow in flows:
            await flow.stop()
        for t in tasks:
            (await t).release()

    asyncio.run(main())


@pytest.mark.parametrize("seed", range(20))
def test_replicas_together_leave_the_reserved_slots_to_the_higher_bands(seed: int) -> None:
    """With `reserved_slots`, every replica's default band together takes at most the free slots
    beyond the reserved ones, plus one per other replica (the same rounding as above), and a
    higher band waiting on any replica takes them."""
    rng = random.Random(seed)
    replicas = rng.randint(2, 4)
    reserved = rng.randint(1, 3)
    free = {"now": 0}

    def capacity(_m: str) -> Capacity:
        n = free["now"]
        pods = ("p:1",) if n else ()
        return Capacity(endpoints=2, free=n, saturation=1.0, pods=pods, running=n,
                        running_pods=pods, slots=8)  # fmt: skip

    async def main() -> None:
        flows = [
            FlowController(settings=FlowControlConfig(reserved_slots=reserved), capacity=capacity)
            for _ in range(replicas)
        ]
        low = [
            asyncio.create_task(flow.admit(FlowRequest("m", 0, str(i), 1)))
            for flow in flows
            for i in range(rng.randint(1, 6))
        ]
        for _ in range(3):
            await asyncio.sleep(0)
        for i, flow in enumerate(flows):
            for j, peer in enumerate(flows):
                if i != j:
                    flow.set_remote(str(j), peer.depths())
        room = rng.randint(0, 6)
        free["now"] = room
        sent = sum(flow.dispatch() for flow in flows)
        assert sent <= min(len(low), max(0, room - reserved) + replicas - 1)
        if room > reserved:
            assert sent >= min(len(low), room - reserved)
        await asyncio.sleep(0)
        for t in low:  # their claims made: the pool's view counts them from now on
            if t.done():
                t.result().release()
        # A higher band arriving now is admitted at once into a reserved slot.
        free["now"] = min(room, reserved)
        if free["now"]:
            grant = await flows[rng.randrange(replicas)].admit(FlowRequest("m", 5, "h", 1))
            assert grant.pods == ("p:1",)
            grant.release()
        for flow in flows:
            await flow.stop()  # hands off what still waits
        for t in low:
            (await t).release()

    asyncio.run(main())
