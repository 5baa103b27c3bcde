"""When the pool has room: the engines' running slots learned from their scrapes and filled
from the gateway's exact in-flight view (`slots`), or llm-d's queue rule (`queue`); scraped
queues bridged by the gateway's own dispatches between scrapes."""

from __future__ import annotations

import pytest

from extproc.config import SaturationConfig
from extproc.flowcontrol import PoolCapacity
from extproc.flowcontrol.capacity import PROBE_S
from extproc.types import Endpoint, EngineMetrics

A = Endpoint(address="10.0.0.1:8000", model="m")
B = Endpoint(address="10.0.0.2:8000", model="m")


class World:
    def __init__(self) -> None:
        self.metrics: dict[str, EngineMetrics] = {}
        self.flight: dict[str, int] = {}
        self.now = 100.0

    def ready(self, model: str) -> list[tuple[Endpoint, EngineMetrics]]:
        return [(ep, self.metrics[ep.address]) for ep in (A, B) if ep.address in self.metrics]

    def scrape(
        self, ep: Endpoint, at: float, waiting: float, kv: float = 0.1, running: float = 0.0
    ) -> None:
        self.metrics[ep.address] = EngineMetrics(
            updated_at=at, running=running, waiting=waiting, kv_cache_usage=kv
        )


def capacity(world: World, dispatch: str = "queue", **kw: float) -> PoolCapacity:
    return PoolCapacity(
        ready=world.ready,
        in_flight=lambda a: world.flight.get(a, 0),
        saturation=SaturationConfig(
            queue_threshold=kw.get("queue_threshold", 5.0), kv_threshold=kw.get("kv_threshold", 0.8)
        ),
        dispatch=dispatch,
        engine_queue=int(kw.get("engine_queue", 0)),
        max_concurrency=int(kw.get("max_concurrency", 0)),
        clock=lambda: world.now,
    )


def test_no_pod_is_no_room_and_full_saturation() -> None:
    cap = capacity(World())("m")
    assert (cap.endpoints, cap.free, cap.saturation, cap.pods) == (0, 0, 1.0, ())


def test_free_slots_are_what_fits_under_the_queue_threshold() -> None:
    w = World()
    w.scrape(A, 1.0, waiting=2)
    w.scrape(B, 1.0, waiting=0)
    cap = capacity(w)("m")
    assert cap.free == 3 + 5
    assert cap.saturation == (2 / 5 + 0.1 / 0.8) / 2
    assert cap.pods == (A.address, B.address)


def test_a_full_kv_cache_offers_nothing() -> None:
    w = World()
    w.scrape(A, 1.0, waiting=0, kv=0.85)
    w.scrape(B, 1.0, waiting=4)
    cap = capacity(w)("m")
    assert (cap.free, cap.pods) == (1, (B.address,))


def test_dispatches_since_the_scrape_count_until_the_next_one() -> None:
    w = World()
    w.scrape(A, 1.0, waiting=3)
    pool = capacity(w)
    w.flight[A.address] = 10
    assert pool("m").free == 2  # the baseline: in flight when the scrape was first seen
    w.flight[A.address] = 12  # two more sent since: the queue is estimated at 5
    assert pool("m").free == 0
    w.flight[A.address] = 11  # one finished
    assert pool("m").free == 1
    w.scrape(A, 1.5, waiting=0)  # a new scrape is the truth again
    assert pool("m").free == 5


@pytest.mark.parametrize("dispatch", ["queue", "slots"])
@pytest.mark.parametrize(
    ("running", "waiting", "kv", "room"),
    [
        pytest.param(0.0, None, None, True, id="running-only"),  # e.g. a minimal exporter
        pytest.param(None, None, 0.1, True, id="kv-only-below"),
        pytest.param(None, None, 0.95, False, id="kv-only-full"),
        pytest.param(None, 1.0, None, True, id="queue-only-below"),
        pytest.param(None, 9.0, None, False, id="queue-only-full"),
    ],
)
def test_a_missing_signal_never_holds_a_pod_back_forever(
    dispatch: str, running: float | None, waiting: float | None, kv: float | None, room: bool
) -> None:
    """An engine that reports only part of vLLM's families: the signal it reports says when it
    is full; with neither a queue nor a KV signal nothing can, and it is not held back (held,
    every request would wait out its TTL for a pod that may be idle)."""
    w = World()
    w.metrics[A.address] = EngineMetrics(
        updated_at=1.0, running=running, waiting=waiting, kv_cache_usage=kv
    )
    cap = capacity(w, dispatch)("m")
    assert (cap.free > 0, cap.pods == (A.address,)) == (room, room)


@pytest.mark.parametrize("dispatch", ["queue", "slots"])
def test_max_concurrency_caps_a_pod(dispatch: str) -> None:
    w = World()
    w.scrape(A, 1.0, waiting=0)
    w.flight[A.address] = 0
    pool = capacity(w, dispatch, max_concurrency=3)
    assert pool("m").free == 3
    w.flight[A.address] = 2
    assert pool("m").free == 1


# -- slots ----------------------------------------------------------------------------------


def teach(w: World, pool: PoolCapacity, *, running: int, waiting: int, at: float = 1.0) -> None:
    """Two scrapes in a row showing the engine full at `running` (what a limit needs), the
    gateway holding running + waiting in flight."""
    w.flight[A.address] = running + waiting
    for t in (at, at + 0.5):
        w.scrape(A, t, running=running, waiting=waiting)
        pool("m")


def test_slots_a_pod_seen_full_takes_only_what_its_running_slots_free() -> None:
    w = World()
    pool = capacity(w, "slots")
    teach(w, pool, running=4, waiting=2)  # full at 4 running
    cap = pool("m")
    assert pool.slots("m", A.address) == 4
    assert (cap.free, cap.pods) == (0, ())
    assert cap.saturation == pytest.approx(6 / 4)  # its load over its slots: over full
    w.flight[A.address] = 3  # three finished since (the access log says so at once)
    assert pool("m").free == 1  # no scrape needed: 4 slots, 3 in flight
    w.flight[A.address] = 4
    assert pool("m").free == 0


def test_slots_one_full_scrape_of_a_light_pod_does_not_cap_it() -> None:
    """A request caught between two engine steps waits for a moment in any engine: one scrape
    showing it is no limit; two in a row are."""
    w = World()
    pool = capacity(w, "slots")
    w.flight[A.address] = 2
    w.scrape(A, 1.0, running=1, waiting=1)  # a moment between two steps
    assert pool("m").free == 5 - 1  # still filled as under `queue`
    assert pool.slots("m", A.address) is None
    w.scrape(A, 1.5, running=2, waiting=0)  # it ran: nothing learned
    pool("m")
    w.scrape(A, 2.0, running=1, waiting=1)
    pool("m")
    assert pool.slots("m", A.address) is None
    w.scrape(A, 2.5, running=2, waiting=1)  # full twice in a row: the larger of the two
    pool("m")
    assert pool.slots("m", A.address) == 2


def test_slots_before_a_pod_shows_its_limit_it_is_filled_as_under_queue() -> None:
    w = World()
    pool = capacity(w, "slots")
    w.scrape(A, 1.0, running=2, waiting=0)
    w.flight[A.address] = 2
    assert pool.slots("m", A.address) is None
    assert pool("m").free == 5


def test_slots_nothing_waiting_and_more_running_raises_the_limit() -> None:
    w = World()
    pool = capacity(w, "slots")
    teach(w, pool, running=4, waiting=1)
    w.scrape(A, 3.0, running=6, waiting=0)  # the engine took more (freed KV, say)
    w.flight[A.address] = 6
    pool("m")
    assert pool.slots("m", A.address) == 6
    w.scrape(A, 3.5, running=7, waiting=1)  # and more again, full: believed at once
    w.flight[A.address] = 8
    pool("m")
    assert pool.slots("m", A.address) == 7


def test_slots_one_scrape_caught_between_engine_steps_does_not_lower_the_limit() -> None:
    """The limit goes down only when two scrapes in a row say so."""
    w = World()
    pool = capacity(w, "slots")
    teach(w, pool, running=4, waiting=1)
    w.scrape(A, 3.0, running=3, waiting=1)  # a moment between steps
    pool("m")
    assert pool.slots("m", A.address) == 4
    w.scrape(A, 3.5, running=3, waiting=2)  # again: the engine now holds only 3
    pool("m")
    assert pool.slots("m", A.address) == 3


def test_slots_a_full_kv_cache_teaches_nothing_and_offers_nothing() -> None:
    w = World()
    pool = capacity(w, "slots")
    for t in (1.0, 1.5):
        w.scrape(A, t, running=3, waiting=2, kv=0.9)
        cap = pool("m")
    assert pool.slots("m", A.address) is None
    assert cap.free == 0


def test_slots_traffic_the_gateway_does_not_see_counts_from_the_scrape() -> None:
    w = World()
    pool = capacity(w, "slots")
    teach(w, pool, running=4, waiting=1)
    w.flight[A.address] = 1
    w.scrape(A, 3.0, running=4, waiting=1)  # the engine holds 5; the gateway sent 1
    pool("m")
    w.flight[A.address] = 0  # ours finished: the engine still has the other 4
    assert pool("m").free == 0


def test_slots_a_pod_at_its_limit_probes_one_more_now_and_then() -> None:
    w = World()
    pool = capacity(w, "slots")
    teach(w, pool, running=4, waiting=1)  # limit 4, seen now
    w.flight[A.address] = 4  # one finished
    assert pool("m").free == 0
    w.now += PROBE_S  # not seen full since: one more may go
    assert pool("m").free == 1
    w.flight[A.address] = 5
    w.scrape(A, 3.0, running=5, waiting=0)  # it ran 5: the limit was too low
    assert pool("m").free == 1  # 5 slots, and probing on
    w.flight[A.address] = 6
    w.scrape(A, 3.5, running=5, waiting=1)  # full at 5: confirmed, the probe stops
    pool("m")
    w.flight[A.address] = 5
    assert (pool("m").free, pool.slots("m", A.address)) == (0, 5)


def test_slots_stale_scrapes_leave_the_in_flight_view_in_charge() -> None:
    """No new scrape for a while (not yet stale): the learned limit and the exact in-flight
    count still say when a slot is free."""
    w = World()
    pool = capacity(w, "slots")
    teach(w, pool, running=4, waiting=1)
    w.now += 2.0
    for flight, free in ((4, 0), (2, 2), (3, 1)):
        w.flight[A.address] = flight
        assert pool("m").free == free


def test_queue_rule_never_learns_slots() -> None:
    w = World()
    pool = capacity(w, "queue")
    w.flight[A.address] = 6
    w.scrape(A, 1.0, running=4, waiting=2)
    assert pool("m").free == 3  # 5 - 2 waiting, whatever the running slots
    assert pool("m").saturation == pytest.approx(2 / 5)


def test_slots_ends_not_heard_yet_are_learned_from_the_scrapes() -> None:
    """Access-log records arrive late: the gateway counts 2 more in flight than the engine holds
    at every scrape. It learns that overcount and fills the slots it hides."""
    w = World()
    pool = capacity(w, "slots")
    teach(w, pool, running=4, waiting=1)  # 4 slots, learned
    assert pool("m").free == 0
    for i in range(20):  # the engine runs 4, the gateway still counts 6
        w.flight[A.address] = 6
        w.scrape(A, 3.0 + i, running=4, waiting=0)
        pool("m")
    assert pool("m").free == 0  # 6 - 2 = 4: full, and not over-filled
    w.flight[A.address] = 5  # one really ended (its record is in): one slot free
    assert pool("m").free == 1
    w.scrape(A, 30.0, running=4, waiting=2)  # the engine shows its queue: the truth again
    w.flight[A.address] = 6
    assert pool("m").free == 0


def test_slots_an_engine_queue_keeps_the_next_request_in_the_engine() -> None:
    w = World()
    pool = capacity(w, "slots", engine_queue=1)
    teach(w, pool, running=4, waiting=1)  # 4 slots, and its one place in the queue taken
    cap = pool("m")
    assert (cap.free, cap.pods, cap.line) == (0, (), (A.address,))
    w.flight[A.address] = 4  # one ended: the waiting one runs, its place is free
    assert pool("m").free == 1
    w.now += PROBE_S  # with a queue allowed, no probe: the scrapes show a higher limit
    w.flight[A.address] = 5
    assert pool("m").free == 0


def test_slots_free_running_slots_are_told_apart_from_places_in_the_engine_queue() -> None:
    w = World()
    pool = capacity(w, "slots", engine_queue=1)
    teach(w, pool, running=4, waiting=1)
    w.scrape(B, 1.0, running=0, waiting=0)  # B's limit is not known: its room counts as slots
    # (in flight on A, its free running slots, its places the queue holds beyond them)
    for flight, running, queued in [(2, 2, 0), (4, 0, 1), (5, 0, 0)]:
        w.flight[A.address] = flight
        cap = pool("m")
        room_a = 5 - flight  # 4 slots and 1 place in its queue
        assert cap.free == room_a + 5  # B: under the queue threshold (5, nothing waiting)
        pods = (A.address,) if running else ()
        assert (cap.running, cap.running_pods) == (running + 5, (*pods, B.address))
        assert cap.queued == queued  # a place behind a free slot is not counted there
        assert cap.queued_pods == ((A.address,) if queued else ())
        assert cap.slots == 4  # learned on A only


@pytest.mark.parametrize("dispatch", ["queue", "slots"])
def test_a_pod_without_any_metrics_is_not_held_back(dispatch: str) -> None:
    """No metrics URL: the store offers it with nothing known. Flow control cannot tell it is
    full, so it does not hold requests for it; only max_concurrency caps it."""
    w = World()
    w.metrics[A.address] = EngineMetrics(updated_at=1.0)
    cap = capacity(w, dispatch)("m")
    assert cap.free > 1000 and cap.pods == (A.address,)
    w.flight[A.address] = 2
    capped = capacity(w, dispatch, max_concurrency=3)("m")
    assert (capped.free, capped.pods) == (1, (A.address,))
