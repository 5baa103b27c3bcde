"""The flow controller under random arrivals, cancellations, room and time: every request ends
exactly one way, nothing lower is dispatched while something higher waits, the caps hold, and
the counts the metrics and the bus read agree with what waits."""

from __future__ import annotations

import asyncio
import random

import pytest

from extproc.config import FlowControlConfig
from extproc.flowcontrol import (
    Capacity,
    FlowController,
    FlowRejected,
    FlowRequest,
    Grant,
)
from tests._clock import ManualClock

CAP_REQUESTS = 6


def flow_id(rng: random.Random) -> str:
    """A fairness id: a few that come back, most of them never seen again (a client can send
    any of 2^64)."""
    return rng.choice("abc") if rng.random() < 0.3 else f"{rng.getrandbits(64):016x}"


def bounded(flow: FlowController) -> None:
    """The registry holds what waits, not what came: a flow per waiting flow, at most about
    twice a flow's waiting requests in its heap, twice the waiting in the expiry heap."""
    fp = flow.footprint()
    assert fp["flows"] <= fp["waiting"] and fp["bands"] <= fp["waiting"], fp
    assert fp["flow_entries"] <= 2 * fp["waiting"] + 8 * fp["flows"], fp
    assert fp["expiry_entries"] <= 2 * fp["waiting"] + 64, fp


@pytest.mark.parametrize("seed", range(25))
@pytest.mark.parametrize("fairness", ["global-strict", "round-robin", "token"])
def test_random_runs_keep_the_invariants(seed: int, fairness: str) -> None:
    async def main() -> None:
        rng = random.Random(seed)
        clock = ManualClock()
        room = {"free": 0, "endpoints": 1}
        flow = FlowController(
            settings=FlowControlConfig(
                fairness=fairness,
                ttl_s=3.0,
                max_requests_per_band=CAP_REQUESTS,
                ordering=rng.choice(["fcfs", "edf"]),
            ),
            capacity=lambda _m: Capacity(room["endpoints"], room["free"], 1.0),
            tokens=lambda f: float(len(f)),
            clock=clock.now,
        )
        tasks: dict[asyncio.Task[Grant], FlowRequest] = {}
        ended: dict[asyncio.Task[Grant], str] = {}
        dispatched_bands: list[tuple[int, int | None]] = []  # (band, highest left waiting)
        for _step in range(150):
            op = rng.random()
            if op < 0.45:
                r = FlowRequest("m", rng.choice([-1, 0, 0, 1, 3]), flow_id(rng), 10,
                                slo_ttft_s=rng.choice([None, 0.5]))  # fmt: skip
                tasks[asyncio.create_task(flow.admit(r))] = r
            elif op < 0.55 and tasks:
                t = rng.choice(list(tasks))
                if not t.done():
                    t.cancel()
            elif op < 0.8:
                room["free"] = rng.randint(0, 3)
                room["endpoints"] = rng.choice([0, 1, 1, 1])
                before = set(t for t in tasks if t.done())
                flow.dispatch()
                left = flow.depths().get("m", {})
                top = max(left) if left else None
                await asyncio.sleep(0)
                for t in tasks:
                    if t.done() and t not in before and not t.cancelled() and t.exception() is None:
                        dispatched_bands.append((tasks[t].priority, top))
            else:
                clock.advance(rng.uniform(0.0, 1.5))
            await asyncio.sleep(0)
            for t in [t for t in tasks if t.done() and t not in ended]:
                if t.cancelled():
                    ended[t] = "cancelled"
                elif isinstance(t.exception(), FlowRejected):
                    ended[t] = "rejected"
                else:
                    t.result().release()  # the claim is made at once here
                    ended[t] = "granted"
            depths = flow.depths().get("m", {})
            assert flow.queued == sum(n for n, _ in depths.values())
            assert all(n <= CAP_REQUESTS for n, _ in depths.values())
            assert flow.queued == sum(1 for t in tasks if not t.done())
            bounded(flow)
        # The rest: time runs out for everyone still waiting.
        clock.advance(10.0)
        flow.dispatch()
        await asyncio.sleep(0)
        for t in tasks:
            assert t.done(), "a request neither dispatched, rejected nor cancelled"
            if not t.cancelled() and t.exception() is None and t not in ended:
                t.result().release()
        assert flow.queued == 0 and flow.depths() == {}
        assert flow.footprint() == dict.fromkeys(flow.footprint(), 0)  # nothing remembered
        # Strict priority: nothing is dispatched while a higher band is left waiting.
        assert dispatched_bands
        for band, top in dispatched_bands:
            assert top is None or band >= top, (band, top)
        # Every grant was released, so nothing is left in transit.
        room["free"], room["endpoints"] = 1, 1
        grant = await flow.admit(FlowRequest("m", 0, "z", 1))
        grant.release()

    asyncio.run(main())
