"""The fairness policies' indexes against a brute-force reference: the real controller driven
through random enqueues, cancellations, expiries, dispatches and token counts (a real
`FairnessCounters`, small enough to forget users) over fairness ids from a space of thousands,
two models and three bands, and at every dispatch the request it sends is the one the scan over
the band's flows (what each policy computed before it had an index) names.

The reference keeps its own copy of what waits (from the operations alone, not from the
controller), applies the TTLs itself and, for `round-robin`, keeps the turns as the scan did:
one map for every band, updated by each pick, pruned to the picking band's flows when it
outgrows four times their number."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.accounting import FairnessCounters
from extproc.config import FlowControlConfig
from extproc.flowcontrol import Capacity, FlowController, FlowRejected, FlowRequest, Grant
from extproc.flowcontrol.policies import Deadline, Fcfs, OrderingPolicy, Queued
from tests._clock import ManualClock

FAIRNESS = ["global-strict", "round-robin", "token"]
MODELS = ["m0", "m1"]
HOT = [f"hot{i}" for i in range(4)]  # ids that come back, besides the many that do not
TTLS = [1.0, 2.0, 5.0, 30.0]

Op = tuple[str, int, int, str, float]  # (kind, model or index, priority, flow id, number)


@dataclass
class RefItem:
    task: asyncio.Task[Grant]
    model: str
    priority: int
    queued: Queued
    key: tuple[float, int]  # the ordering policy's


@dataclass
class Reference:
    """What waits and who goes next, by scanning every flow of the band."""

    fairness: str
    ordering: OrderingPolicy
    tokens: Callable[[str], float]
    waiting: dict[int, RefItem] = field(default_factory=dict)  # by arrival number
    last: dict[str, int] = field(default_factory=dict)  # round-robin's turns
    turn: itertools.count[int] = field(default_factory=itertools.count)

    def expire(self, now: float) -> set[asyncio.Task[Grant]]:
        gone = [seq for seq, r in self.waiting.items() if r.queued.expires <= now]
        return {self.waiting.pop(seq).task for seq in gone}

    def pick(self, model: str) -> RefItem | None:
        """The request the scan dispatches next for `model` (and the turn it takes)."""
        mine = [r for r in self.waiting.values() if r.model == model]
        if not mine:
            return None
        top = max(r.priority for r in mine)
        heads: dict[str, RefItem] = {}
        for r in mine:
            if r.priority == top:
                name = r.queued.flow
                if name not in heads or r.key < heads[name].key:
                    heads[name] = r
        flows = list(heads.values())
        if self.fairness == "global-strict":
            chosen = min(flows, key=lambda h: h.key)
        elif self.fairness == "token":
            chosen = min(flows, key=lambda h: (self.tokens(h.queued.flow), h.queued.seq))
        else:
            chosen = min(flows, key=lambda h: (self.last.get(h.queued.flow, -1), h.queued.seq))
            self.last[chosen.queued.flow] = next(self.turn)
            if len(self.last) > 4 * max(16, len(flows)):
                live = set(heads)
                self.last = {k: v for k, v in self.last.items() if k in live}
        return self.waiting.pop(chosen.queued.seq)


def flow_id(n: int) -> str:
    return HOT[n] if n < len(HOT) else f"tenant-{n}"


async def drive(fairness: str, ordering: str, ops: list[Op]) -> int:
    """Run `ops` on a real controller and the reference side by side; returns the dispatches
    compared."""
    clock = ManualClock()
    counters = FairnessCounters(max_users=24)
    free = dict.fromkeys(MODELS, 0)
    controller = FlowController(
        settings=FlowControlConfig(
            fairness=fairness, ordering=ordering, max_requests_per_band=100_000
        ),
        capacity=lambda m: Capacity(endpoints=1, free=free[m], saturation=1.0),
        tokens=counters.tokens,
        clock=clock.now,
    )
    counters.on_forget = controller.fairness_changed  # as the app wires them
    order: OrderingPolicy = Fcfs("fcfs") if ordering == "fcfs" else Deadline("edf")
    ref = Reference(fairness, order, counters.tokens)
    seq = itertools.count()
    started: list[str] = []  # users with a request in flight, for the counters' lifts
    compared = 0
    for kind, a, priority, flow, x in ops:
        if kind == "enqueue":
            request = FlowRequest(MODELS[a % 2], priority, flow, 10, ttl_s=x)
            task = asyncio.create_task(controller.admit(request))
            await asyncio.sleep(0)
            assert not task.done()
            now = clock.now()
            q = Queued(flow=flow, enqueued=now, expires=now + x, deadline=None, size=10,
                       seq=next(seq))  # fmt: skip
            ref.waiting[q.seq] = RefItem(task, request.model, priority, q, order.key(q))
        elif kind == "cancel" and ref.waiting:
            item = list(ref.waiting.values())[a % len(ref.waiting)]
            del ref.waiting[item.queued.seq]
            item.task.cancel()
            await asyncio.sleep(0)
            assert item.task.cancelled()
        elif kind == "expire":
            clock.advance(x)
            gone = ref.expire(clock.now())
            assert controller.dispatch() == 0
            await asyncio.sleep(0)
            for task in gone:
                assert isinstance(task.exception(), FlowRejected)
            assert controller.queued == len(ref.waiting)
        elif kind == "dispatch":
            model = MODELS[a % 2]
            expected = ref.pick(model)
            free[model] = 1
            try:
                sent = controller.dispatch()
            finally:
                free[model] = 0
            await asyncio.sleep(0)
            if expected is None:
                assert sent == 0
                continue
            assert sent == 1
            assert expected.task.done(), (
                f"expected flow {expected.queued.flow!r} (#{expected.queued.seq}) to go"
            )
            expected.task.result().release()
            compared += 1
        elif kind == "charge":
            counters.charge(flow, input_tokens=a, output_tokens=priority)
        elif kind == "start":
            counters.request_started(flow, a)
            started.append(flow)
        elif kind == "finish" and started:
            counters.request_finished(started.pop(a % len(started)), priority)
        assert controller.queued == len(ref.waiting)
    await controller.stop()
    return compared


ids = st.one_of(st.integers(0, len(HOT) - 1), st.integers(0, 9_999)).map(flow_id)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("enqueue"), st.integers(0, 1), st.integers(0, 2), ids,
                  st.sampled_from(TTLS)),
        st.tuples(st.just("enqueue"), st.integers(0, 1), st.integers(0, 2), ids,
                  st.sampled_from(TTLS)),
        st.tuples(st.just("dispatch"), st.integers(0, 1), st.just(0), st.just(""), st.just(0.0)),
        st.tuples(st.just("cancel"), st.integers(0, 10**6), st.just(0), st.just(""),
                  st.just(0.0)),
        st.tuples(st.just("expire"), st.just(0), st.just(0), st.just(""),
                  st.sampled_from([0.5, 1.0, 3.0])),
        st.tuples(st.sampled_from(["charge", "start"]), st.integers(0, 500), st.integers(0, 500),
                  ids, st.just(0.0)),
        st.tuples(st.just("finish"), st.integers(0, 10**6), st.integers(0, 500), st.just(""),
                  st.just(0.0)),
    ),
    max_size=300,
)  # fmt: skip


@pytest.mark.parametrize("ordering", ["fcfs", "edf"])
@pytest.mark.parametrize("fairness", FAIRNESS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops)
def test_the_index_picks_what_the_scan_picks(fairness: str, ordering: str, ops: list[Op]) -> None:
    asyncio.run(drive(fairness, ordering, ops))


def long_run(rng: random.Random, steps: int) -> list[Op]:
    """Thousands of flows waiting in one band at once, then drained: the index's rebuilds and
    the round-robin turns' pruning happen many times over."""
    out: list[Op] = []
    for step in range(steps):
        filling = step < steps // 2
        r = rng.random()
        n = rng.randrange(len(HOT)) if rng.random() < 0.1 else rng.randrange(20_000)
        model = 0 if rng.random() < 0.8 else 1
        if r < (0.8 if filling else 0.1):
            out.append(("enqueue", model, rng.choice([0, 0, 0, 1, 2]), flow_id(n),
                        rng.choice([30.0, 60.0, 600.0])))  # fmt: skip
        elif r < (0.85 if filling else 0.8):
            out.append(("dispatch", model, 0, "", 0.0))
        elif r < (0.9 if filling else 0.87):
            out.append(("cancel", rng.randrange(10**6), 0, "", 0.0))
        elif r < 0.88 and not filling:
            out.append(("expire", 0, 0, "", rng.choice([1.0, 10.0])))
        elif r < 0.96:
            out.append((rng.choice(["charge", "start"]), rng.randrange(500), rng.randrange(500),
                        flow_id(n), 0.0))  # fmt: skip
        else:
            out.append(("finish", rng.randrange(10**6), rng.randrange(500), "", 0.0))
    return out


@pytest.mark.parametrize("fairness", FAIRNESS)
def test_thousands_of_live_flows_pick_what_the_scan_picks(fairness: str) -> None:
    ops = long_run(random.Random(fairness), 16_000)
    compared = asyncio.run(drive(fairness, "edf", ops))
    assert compared > 2_500  # (with some 2,400 flows waiting in one band at the peak)
