"""The flow controller alone: a capacity the test sets, a clock the test moves."""

from __future__ import annotations

import asyncio

import pytest

from extproc.flowcontrol import (
    DROPPED_HEADER,
    Capacity,
    FlowOutcome,
    FlowRejected,
    Grant,
)
from tests.flowcontrol._kit import kit, order, queued, req, run


def test_below_saturation_a_request_is_admitted_without_waiting() -> None:
    async def main() -> None:
        k = kit()
        k.pool.free = 3
        coro = k.flow.admit(req())
        # It completes on its first step: no await, no task switch.
        with pytest.raises(StopIteration) as stop:
            coro.send(None)
        grant = stop.value.value
        assert isinstance(grant, Grant) and grant.waited_s == 0.0
        assert k.sample("extproc_flow_control_outcomes_total", outcome="dispatched") == 1

    run(main())


def test_a_grant_holds_its_slot_until_released() -> None:
    async def main() -> None:
        k = kit()
        k.pool.free = 1
        first = await k.flow.admit(req())
        [second] = await queued(k, req())  # the one slot is in transit to the first
        assert k.flow.dispatch() == 0
        first.release()
        first.release()  # idempotent
        assert k.flow.dispatch() == 1
        assert (await second).waited_s == 0.0  # the manual clock did not move

    run(main())


def test_strict_priority_between_bands() -> None:
    async def main() -> None:
        k = kit()
        tasks = await queued(k, req(priority=0), req(priority=0), req(priority=5), req(priority=1))
        assert await order(k, tasks, ["low1", "low2", "high", "mid"]) == [
            "high", "mid", "low1", "low2",
        ]  # fmt: skip

    run(main())


def test_round_robin_between_flows_of_a_band() -> None:
    async def main() -> None:
        k = kit(fairness="round-robin")
        reqs = [req("heavy") for _ in range(4)] + [req("a"), req("b")]
        tasks = await queued(k, *reqs)
        got = await order(k, tasks, ["h1", "h2", "h3", "h4", "a", "b"])
        assert got == ["h1", "a", "b", "h2", "h3", "h4"]

    run(main())


def test_global_strict_is_one_order_over_the_band() -> None:
    async def main() -> None:
        k = kit(fairness="global-strict")
        tasks = await queued(k, req("heavy"), req("heavy"), req("a"))
        assert await order(k, tasks, ["h1", "h2", "a"]) == ["h1", "h2", "a"]

    run(main())


def test_token_fairness_serves_the_flow_that_used_fewest_tokens() -> None:
    async def main() -> None:
        k = kit(fairness="token")
        k.tokens.update({"heavy": 5000.0, "light": 10.0})
        tasks = await queued(k, req("heavy"), req("light"))
        assert await order(k, tasks, ["heavy", "light"]) == ["light", "heavy"]

    run(main())


def test_edf_orders_a_flow_by_deadline() -> None:
    async def main() -> None:
        k = kit(ordering="edf", ttl_s=60.0)
        tasks = await queued(k, req("u"), req("u", slo_ttft_s=0.5), req("u", ttl_s=10.0))
        assert await order(k, tasks, ["ttl60", "slo", "ttl10"]) == ["slo", "ttl10", "ttl60"]

    run(main())


def test_fcfs_ignores_deadlines() -> None:
    async def main() -> None:
        k = kit(ordering="fcfs")
        tasks = await queued(k, req("u"), req("u", slo_ttft_s=0.5))
        assert await order(k, tasks, ["first", "slo"]) == ["first", "slo"]

    run(main())


def test_a_full_band_rejects_at_once_by_count_and_by_bytes() -> None:
    async def main() -> None:
        k = kit(max_requests_per_band=2, max_bytes_per_band=1000)
        await queued(k, req(), req())
        with pytest.raises(FlowRejected) as err:
            await k.flow.admit(req())
        assert err.value.status == 429
        assert err.value.headers[DROPPED_HEADER] == "rejected-saturated"
        # Another band has caps of its own; its bytes count separately.
        await queued(k, req(priority=1, size=900))
        with pytest.raises(FlowRejected):
            await k.flow.admit(req(priority=1, size=200))
        assert k.flow.queued == 3

    run(main())


def test_ttl_expiry_is_429_with_retry_after_while_pods_exist() -> None:
    async def main() -> None:
        k = kit(ttl_s=5.0, retry_after_s=2)
        [task] = await queued(k, req())
        k.clock.advance(4.9)
        k.flow.dispatch()
        assert not task.done()
        k.clock.advance(0.2)
        k.flow.dispatch()
        with pytest.raises(FlowRejected) as err:
            await task
        assert err.value.status == 429
        assert err.value.headers == {DROPPED_HEADER: "rejected-ttl-expired", "retry-after": "2"}
        assert k.flow.queued == 0
        assert k.sample(
            "extproc_flow_control_request_queue_duration_seconds_count",
            outcome="rejected-ttl-expired",
        ) == 1  # fmt: skip

    run(main())


def test_no_ready_endpoint_waits_then_503() -> None:
    async def main() -> None:
        k = kit(ttl_s=5.0)
        k.pool.endpoints, k.pool.free = 0, 0
        first, second = await queued(k, req(), req())
        k.clock.advance(2.0)
        k.pool.endpoints, k.pool.free = 1, 1  # a pod came up (scale from zero)
        assert k.flow.dispatch() == 1
        (await first).release()
        k.pool.endpoints, k.pool.free = 0, 0  # and went away again
        k.clock.advance(3.1)
        k.flow.dispatch()
        with pytest.raises(FlowRejected) as err:
            await second
        assert err.value.status == 503
        assert err.value.headers[DROPPED_HEADER] == "rejected-no-endpoints"

    run(main())


def test_sheddable_requests_are_shed_when_saturated_instead_of_queued() -> None:
    async def main() -> None:
        k = kit()
        with pytest.raises(FlowRejected) as err:
            await k.flow.admit(req(priority=-1))
        assert err.value.headers[DROPPED_HEADER] == "rejected-saturated"
        k.pool.free = 1
        grant = await k.flow.admit(req(priority=-1))  # room: it goes
        grant.release()
        k.pool.free = 0
        await queued(k, req(priority=0))
        k.pool.free = 5
        with pytest.raises(FlowRejected):  # others wait: a sheddable one does not jump them
            await k.flow.admit(req(priority=-1))

    run(main())


def test_a_client_that_leaves_while_queued_is_removed_and_counted() -> None:
    async def main() -> None:
        k = kit()
        gone, stays = await queued(k, req("a"), req("b"))
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert k.flow.queued == 1
        assert k.sample("extproc_flow_control_outcomes_total", outcome="cancelled") == 1
        assert k.sample("extproc_flow_control_queue_size", priority="0") == 1
        k.pool.free = 1
        assert k.flow.dispatch() == 1
        await stays

    run(main())


def test_stop_dispatches_everything_waiting() -> None:
    async def main() -> None:
        k = kit()
        tasks = await queued(k, req(), req(priority=3))
        await k.flow.stop()
        for t in tasks:
            assert isinstance(await t, Grant)
        assert k.sample("extproc_flow_control_outcomes_total", outcome="handed-off") == 2
        late = await k.flow.admit(req())  # arrives while stopping: goes at once
        assert isinstance(late, Grant)

    run(main())


def test_a_peer_holding_a_higher_band_goes_first() -> None:
    async def main() -> None:
        k = kit()
        [low] = await queued(k, req(priority=0))
        k.flow.set_remote("peer:1", {"m": {5: (2, 200)}})
        k.pool.free = 2
        assert k.flow.dispatch() == 0  # both slots are the peer's higher band
        k.pool.free = 3
        assert k.flow.dispatch() == 1  # the third is left for us
        await low

    run(main())


def test_a_band_shared_with_a_peer_is_split_by_depth() -> None:
    async def main() -> None:
        k = kit()
        tasks = await queued(k, *(req() for _ in range(4)))
        k.flow.set_remote("peer:1", {"m": {0: (4, 400)}})
        k.pool.free = 4
        assert k.flow.dispatch() == 2  # half the room: half the depth is ours
        await asyncio.sleep(0)
        assert sum(t.done() for t in tasks) == 2
        k.flow.drop_remote("peer:1")
        for t in tasks:
            if t.done():
                t.result().release()
        assert k.flow.dispatch() == 2
        assert k.flow.queued == 0

    run(main())


def test_an_arrival_waits_while_a_peer_queues_its_band() -> None:
    async def main() -> None:
        k = kit()
        k.pool.free = 5
        k.flow.set_remote("peer:1", {"m": {0: (1, 10)}})
        [task] = await queued(k, req(priority=0))  # it does not jump the peer's queue
        k.flow.set_remote("peer:1", {})
        assert k.flow.dispatch() == 1
        await task

    run(main())


def test_depths_are_what_waits() -> None:
    async def main() -> None:
        k = kit()
        await queued(k, req(size=10), req(size=20), req(priority=2, size=5))
        assert k.flow.depths() == {"m": {0: (2, 30), 2: (1, 5)}}
        k.flow.set_remote("peer:1", {"m": {0: (1, 70)}})
        assert k.flow.queued_bytes("m") == 105

    run(main())


def test_the_dispatch_loop_wakes_on_room() -> None:
    async def main() -> None:
        k = kit(tick_s=3600.0)  # only a wake-up can dispatch in this test
        await k.flow.start()
        [task] = await queued(k, req())
        k.pool.free = 1
        k.flow.wake()
        grant = await asyncio.wait_for(task, 5.0)  # a guard against a hang, not a timing
        assert grant.waited_s == 0.0
        await k.flow.stop()

    run(main())


def test_unknown_policy_names_are_refused() -> None:
    with pytest.raises(ValueError, match="fairness"):
        kit(fairness="lottery")
    with pytest.raises(ValueError, match="ordering"):
        kit(ordering="lifo")


def test_outcomes_are_the_documented_set() -> None:
    assert {str(o) for o in FlowOutcome} == {
        "dispatched", "rejected-saturated", "rejected-slo-unmet", "rejected-ttl-expired",
        "rejected-no-endpoints", "cancelled", "handed-off",
    }  # fmt: skip


def test_a_band_above_the_default_may_wait_next_in_line_in_an_engine() -> None:
    async def main() -> None:
        k = kit()
        k.pool.line = ("full:1",)  # every slot taken, nothing waiting in that engine
        grant = await k.flow.admit(req(priority=3))  # next in line at once, on that pod
        assert grant.pods == ("full:1",)
        [low] = await queued(k, req(priority=0))  # the default band waits in the gateway
        [mid, high] = await queued(k, req(priority=1), req(priority=2))
        grant.release()
        # Only the highest band waiting takes the place in line; the others wait for room.
        assert k.flow.dispatch() == 1
        await asyncio.sleep(0)
        assert high.done() and not mid.done() and not low.done()
        assert (await high).pods == ("full:1",)
        (await high).release()
        k.pool.line = ()
        k.pool.free = 2  # room: the rest go to the pods with room
        assert k.flow.dispatch() == 2
        assert (await mid).pods == ("room:1",) and (await low).pods == ("room:1",)

    run(main())


# A pool of 3 free running slots on "run:1" and 2 places in the queues of "full:1" (its slots
# all taken): where each band may go with `reserved_slots` kept for the bands above the default.
HEADROOM_CAP = Capacity(endpoints=2, free=5, saturation=0.9, pods=("run:1", "full:1"),
                        running=3, running_pods=("run:1",), queued=2, queued_pods=("full:1",),
                        slots=8)  # fmt: skip
# One free slot, and a place in the same engine's queue (behind that slot: not a place the
# default band may take while the slot is kept).
ONE_SLOT_CAP = Capacity(endpoints=1, free=2, saturation=0.9, pods=("run:1",), running=1,
                        running_pods=("run:1",), slots=4)  # fmt: skip


@pytest.mark.parametrize(
    ("reserved", "room", "priority", "parts"),
    [
        (0, 5, 0, [(5, ("run:1", "full:1"))]),  # none reserved: any room, any pod
        (2, 5, 0, [(1, ("run:1",)), (2, ("full:1",))]),  # 1 slot beyond the 2 kept, the queues
        (3, 5, 0, [(0, ("run:1",)), (2, ("full:1",))]),  # every slot kept: only the queues
        (2, 3, 0, [(0, ("run:1",)), (2, ("full:1",))]),  # 2 in transit took 2 of the slots
        (2, 5, 1, [(3, ("run:1",)), (2, ("run:1", "full:1"))]),  # above: free slots first
        (2, 2, 1, [(0, ("run:1",)), (2, ("run:1", "full:1"))]),  # 3 in transit: counted as
        # having taken the free slots first
    ],
)
def test_reserved_slots_are_kept_free_for_the_bands_above_the_default(
    reserved: int, room: int, priority: int, parts: list[tuple[int, tuple[str, ...]]]
) -> None:
    k = kit(reserved_slots=reserved)
    assert list(k.flow.parts(HEADROOM_CAP, room, priority)) == parts


def test_a_queue_place_behind_a_reserved_slot_is_not_the_default_bands() -> None:
    k = kit(reserved_slots=1)
    assert list(k.flow.parts(ONE_SLOT_CAP, 2, 0)) == [(0, ("run:1",)), (0, ())]
    assert list(k.flow.parts(ONE_SLOT_CAP, 2, 1)) == [(1, ("run:1",)), (1, ("run:1",))]


@pytest.mark.parametrize(("slots", "spare"), [(8, 0), (4, 1), (2, 2), (0, 3)])
def test_at_most_half_the_learned_slots_are_reserved(slots: int, spare: int) -> None:
    # 3 reserved asked, 3 free slots: the default band gets what is beyond half the pool's
    # slots (none learned yet: nothing is kept), so it is never starved, idle pool or not.
    k = kit(reserved_slots=3)
    cap = Capacity(endpoints=2, free=3, saturation=0.5, pods=("run:1",), running=3,
                   running_pods=("run:1",), slots=slots)  # fmt: skip
    assert k.flow.parts(cap, 3, 0)[0][0] == spare


def test_a_reserved_slot_leaves_the_default_band_waiting_and_the_higher_one_served() -> None:
    async def main() -> None:
        k = kit(reserved_slots=1)
        k.pool.free = 1  # one free running slot (the fake's room is all running slots)
        [low] = await queued(k, req(priority=0))  # it is the one kept
        high = await k.flow.admit(req(priority=1))
        assert high.pods == ("room:1",)
        high.release()
        k.pool.free = 2
        assert k.flow.dispatch() == 1  # one beyond the reserved one now
        assert (await low).pods == ("room:1",)

    run(main())


def test_requests_admitted_at_once_share_one_read_of_the_room() -> None:
    async def main() -> None:
        k = kit(room_cache_s=0.005)
        k.pool.free = 3
        grants = [await k.flow.admit(req()) for _ in range(3)]  # one read, three grants
        assert k.pool.calls == 1
        for g in grants:
            g.release()
        k.pool.free = 0  # they took the slots
        [fourth] = await queued(k, req())  # the read showed 3: read again, and it is full now
        assert k.pool.calls == 2
        k.pool.free = 5
        k.clock.advance(0.01)
        assert k.flow.dispatch() == 1
        (await fourth).release()
        # A fresh read showing room serves the next requests without another pass.
        grants = [await k.flow.admit(req()) for _ in range(4)]
        assert k.pool.calls == 3
        for g in grants:
            g.release()

    run(main())
