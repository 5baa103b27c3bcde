"""When the pool has room: scraped queues and KV usage, bridged by the gateway's own dispatches
between scrapes."""

from __future__ import annotations

from extproc.flowcontrol import PoolCapacity
from extproc.types import Endpoint, EngineMetrics

A = Endpoint(address="10.0.0.1:8000", model="m")
B = Endpoint(address="10.0.0.2:8000", model="m")


class World:
    def __init__(self) -> None:
        self.metrics: dict[str, EngineMetrics] = {}
        self.flight: dict[str, int] = {}

    def ready(self, model: str) -> list[tuple[Endpoint, EngineMetrics]]:
        return [(ep, self.metrics[ep.address]) for ep in (A, B) if ep.address in self.metrics]

    def scrape(self, ep: Endpoint, at: float, waiting: float, kv: float = 0.1) -> None:
        self.metrics[ep.address] = EngineMetrics(updated_at=at, waiting=waiting, kv_cache_usage=kv)


def capacity(world: World, **kw: float) -> PoolCapacity:
    return PoolCapacity(
        ready=world.ready,
        in_flight=lambda a: world.flight.get(a, 0),
        queue_threshold=kw.get("queue_threshold", 5.0),
        kv_threshold=kw.get("kv_threshold", 0.8),
        max_concurrency=int(kw.get("max_concurrency", 0)),
    )


def test_no_pod_is_no_room_and_full_saturation() -> None:
    cap = capacity(World())("m")
    assert (cap.endpoints, cap.free, cap.saturation) == (0, 0, 1.0)


def test_free_slots_are_what_fits_under_the_queue_threshold() -> None:
    w = World()
    w.scrape(A, 1.0, waiting=2)
    w.scrape(B, 1.0, waiting=0)
    cap = capacity(w)("m")
    assert cap.free == 3 + 5
    assert cap.saturation == (2 / 5 + 0.1 / 0.8) / 2


def test_a_full_kv_cache_offers_nothing() -> None:
    w = World()
    w.scrape(A, 1.0, waiting=0, kv=0.85)
    w.scrape(B, 1.0, waiting=4)
    assert capacity(w)("m").free == 1


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


def test_metrics_without_a_queue_signal_count_as_saturated() -> None:
    w = World()
    w.metrics[A.address] = EngineMetrics(updated_at=1.0, waiting=None, kv_cache_usage=0.1)
    cap = capacity(w)("m")
    assert (cap.free, cap.saturation) == (0, 1.0)


def test_max_concurrency_caps_a_pod() -> None:
    w = World()
    w.scrape(A, 1.0, waiting=0)
    w.flight[A.address] = 0
    pool = capacity(w, max_concurrency=3)
    assert pool("m").free == 3
    w.flight[A.address] = 2
    assert pool("m").free == 1
