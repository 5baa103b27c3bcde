"""Floods of client-chosen keys: thousands of requests, each with a fairness id never seen
before, queued and then abandoned (the client goes away, or their TTL runs out). What the
controller keeps afterwards is what still waits, so a second round leaves it exactly where the
first left it: no flow, band or heap entry outlives its requests."""

from __future__ import annotations

import asyncio
import gc
import itertools
import tracemalloc

import pytest

from extproc.flowcontrol import FlowController, Grant
from tests.flowcontrol._kit import Kit, kit, req

ROUND = 3000


async def flood(k: Kit, tag: str, *, expire: bool) -> None:
    """ROUND requests with fresh fairness ids over three bands, all abandoned while queued."""
    tasks = [
        asyncio.create_task(k.flow.admit(req(f"{tag}-{i}", priority=i % 3, size=10)))
        for i in range(ROUND)
    ]
    await asyncio.sleep(0)
    assert k.flow.queued == ROUND
    if expire:
        k.clock.advance(k.flow.settings.ttl_s + 1)
        k.flow.dispatch()
    else:
        for t in tasks:
            t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert k.flow.queued == 0


def empty(flow: FlowController) -> bool:
    return not any(flow.footprint().values())


async def settle() -> None:
    """Let the loop run the done callbacks of the round's tasks, then collect them."""
    for _ in range(5):
        await asyncio.sleep(0)
    gc.collect()


@pytest.mark.parametrize("expire", [False, True], ids=["cancelled", "expired"])
def test_abandoned_flows_are_forgotten_and_a_second_round_costs_no_memory(expire: bool) -> None:
    async def main() -> None:
        k = kit(ttl_s=5.0, max_requests_per_band=ROUND)
        await flood(k, "warm", expire=expire)  # first use: metric children, policy state
        await settle()
        tracemalloc.start()
        try:
            snapshots = []
            for tag in ("one", "two", "three"):
                await flood(k, tag, expire=expire)
                assert empty(k.flow), k.flow.footprint()
                await settle()
                snapshots.append(tracemalloc.take_snapshot())
        finally:
            tracemalloc.stop()
        # tracemalloc sees the whole worker process: another thread allocating during one
        # round (a leftover of an earlier test) is not the controller keeping anything. What
        # the controller kept grows with every round, so the smaller of two rounds' growth
        # is the one that tells.
        grown = min(
            sum(d.size_diff for d in after.compare_to(before, "filename"))
            for before, after in itertools.pairwise(snapshots)
        )
        assert grown < 16 * 1024, f"{grown} bytes kept after {ROUND} abandoned requests"
        # And the pool still works: a request arriving now waits alone and goes first.
        task = asyncio.create_task(k.flow.admit(req("late")))
        await asyncio.sleep(0)
        k.pool.free = 1
        assert k.flow.dispatch() == 1
        assert isinstance(await task, Grant)

    asyncio.run(main())


def test_a_flow_that_keeps_one_request_waiting_holds_no_more_than_twice_what_waits() -> None:
    """One request of a flow waits throughout while thousands of the same flow come and go:
    the flow stays, its removed entries do not pile up behind the waiting one."""

    async def main() -> None:
        k = kit(ttl_s=60.0, max_requests_per_band=ROUND + 1)
        first = asyncio.create_task(k.flow.admit(req("tenant")))
        await asyncio.sleep(0)
        for _ in range(3):
            tasks = [asyncio.create_task(k.flow.admit(req("tenant"))) for _ in range(ROUND)]
            await asyncio.sleep(0)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            fp = k.flow.footprint()
            assert fp["waiting"] == fp["flows"] == 1
            assert fp["flow_entries"] <= 2 + 8, fp
            assert fp["expiry_entries"] <= 2 + 64, fp
        k.pool.free = 1
        assert k.flow.dispatch() == 1
        assert isinstance(await first, Grant)
        assert empty(k.flow)

    asyncio.run(main())
