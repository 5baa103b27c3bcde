"""EndpointStore: endpoint-set replacement, staleness and re-admission on a fake clock."""

from __future__ import annotations

import pytest

from extproc.metrics.store import EndpointStore
from extproc.types import Endpoint, EngineMetrics


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def ep(port: int, model: str = "m", metrics: bool = True) -> Endpoint:
    addr = f"127.0.0.1:{port}"
    return Endpoint(addr, model, metrics_url=f"http://{addr}/metrics" if metrics else None)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def addresses(store: EndpointStore, model: str = "m") -> list[str]:
    return [e.address for e, _ in store.ready(model)]


def test_never_scraped_is_not_ready(clock: FakeClock) -> None:
    store = EndpointStore(stale_after=3.0, clock=clock)
    store.set_endpoints({"m": [ep(1)]})
    assert store.ready("m") == ()
    assert not store.any_ready()


def test_stale_then_readmitted(clock: FakeClock) -> None:
    a, b = ep(1), ep(2)
    store = EndpointStore(stale_after=3.0, clock=clock)
    store.set_endpoints({"m": [a, b]})
    store.record_success(a, EngineMetrics(updated_at=clock.now, running=1))
    store.record_success(b, EngineMetrics(updated_at=clock.now, running=2))
    assert addresses(store) == [a.address, b.address]

    clock.now += 2.0
    store.record_failure(b, "timeout")  # one failure: still served from the last good value
    store.record_success(a, EngineMetrics(updated_at=clock.now, running=1))
    assert addresses(store) == [a.address, b.address]
    assert dict(store.ready("m"))[b].running == 2

    clock.now += 1.5  # b's last good scrape is now 3.5 s old
    assert addresses(store) == [a.address]
    assert store.state(b) is not None and store.state(b).failures == 1  # type: ignore[union-attr]

    store.record_success(b, EngineMetrics(updated_at=clock.now, running=5))
    assert addresses(store) == [a.address, b.address]
    state = store.state(b)
    assert state is not None and state.failures == 0 and state.last_error is None
    assert state.age(clock.now + 0.5) == pytest.approx(0.5)


def test_exactly_stale_after_is_still_fresh(clock: FakeClock) -> None:
    a = ep(1)
    store = EndpointStore(stale_after=3.0, clock=clock)
    store.set_endpoints({"m": [a]})
    store.record_success(a, EngineMetrics(updated_at=clock.now))
    assert addresses(store) == [a.address] and store.ready("m", clock.now + 3.0)
    assert store.ready("m", clock.now + 3.01) == ()


def test_unreachable_excluded_at_once_unless_disabled(clock: FakeClock) -> None:
    a = ep(1)
    for exclude, expected in ((True, []), (False, [a.address])):
        store = EndpointStore(stale_after=3.0, clock=clock, exclude_unreachable=exclude)
        store.set_endpoints({"m": [a]})
        store.record_success(a, EngineMetrics(updated_at=clock.now))
        store.record_failure(a, "unreachable", unreachable=True)
        assert addresses(store) == expected


def test_max_failures(clock: FakeClock) -> None:
    a = ep(1)
    store = EndpointStore(stale_after=60.0, clock=clock, max_failures=2)
    store.set_endpoints({"m": [a]})
    store.record_success(a, EngineMetrics(updated_at=clock.now))
    store.record_failure(a, "timeout")
    assert addresses(store) == [a.address]
    store.record_failure(a, "timeout")
    assert addresses(store) == []


@pytest.mark.parametrize("without_url_ready", [True, False])
def test_endpoints_without_metrics_url(clock: FakeClock, without_url_ready: bool) -> None:
    a = ep(1, metrics=False)
    store = EndpointStore(stale_after=3.0, clock=clock, ready_without_metrics_url=without_url_ready)
    store.set_endpoints({"m": [a]})
    ready = store.ready("m")
    if without_url_ready:
        ((endpoint, metrics),) = ready
        assert endpoint == a
        assert metrics.running is None and metrics.updated_at == clock.now
    else:
        assert ready == ()


def test_set_endpoints_replaces_wholesale_and_keeps_surviving_state(clock: FakeClock) -> None:
    a, b, c = ep(1), ep(2), ep(3, model="other")
    store = EndpointStore(stale_after=3.0, clock=clock)
    store.set_endpoints({"m": [a, b]})
    v0 = store.version
    store.record_success(a, EngineMetrics(updated_at=clock.now, running=4))
    store.record_success(b, EngineMetrics(updated_at=clock.now))
    store.set_endpoints({"m": [a], "other": [c]})
    assert store.version == v0 + 1
    assert addresses(store) == [a.address]  # a kept its last good scrape
    assert store.state(b) is None
    store.record_success(b, EngineMetrics(updated_at=clock.now))  # a late result for b
    assert store.state(b) is None
    assert set(store.endpoints()) == {a, c}
    assert store.models() == ("m", "other")
    assert store.ready("unknown-model") == ()


def test_ready_is_an_immutable_snapshot(clock: FakeClock) -> None:
    a = ep(1)
    store = EndpointStore(stale_after=3.0, clock=clock)
    store.set_endpoints({"m": [a]})
    store.record_success(a, EngineMetrics(updated_at=clock.now, running=1))
    before = store.ready("m")
    store.record_success(a, EngineMetrics(updated_at=clock.now, running=9))
    assert before[0][1].running == 1
    assert store.ready("m")[0][1].running == 9
    assert isinstance(before, tuple)


def test_rejects_non_positive_stale_after() -> None:
    with pytest.raises(ValueError):
        EndpointStore(stale_after=0)


def _scrape(at: float, **figures: float) -> EngineMetrics:
    base = {"prompt_tokens_total": 100.0, "generation_tokens_total": 50.0, "running": 1.0}
    return EngineMetrics(updated_at=at, **{**base, **figures})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "moved"),
    [
        ({}, False),  # the same figures, scraped again: no progress
        ({"generation_tokens_total": 51.0}, True),  # a decode step
        ({"prompt_tokens_total": 900.0}, True),  # a prefill finished
        ({"running": 2.0}, True),  # a request got in
        ({"waiting": 1.0}, True),
        ({"kv_cache_usage": 0.3}, True),  # a prefill chunk took blocks
        ({"ttft_avg_s": 0.5}, False),  # not a figure of work done
    ],
)
def test_progressed_at_is_the_last_scrape_whose_work_figures_moved(
    clock: FakeClock, change: dict[str, float], moved: bool
) -> None:
    a = ep(1)
    store = EndpointStore(stale_after=3.0, clock=clock)
    store.set_endpoints({"m": [a]})
    assert store.progressed_at(a.address) is None  # never scraped: cannot tell
    store.record_success(a, _scrape(10.0))
    assert store.progressed_at(a.address) == 10.0  # the first scrape is a change
    store.record_success(a, _scrape(11.0, **change))
    assert store.progressed_at(a.address) == (11.0 if moved else 10.0)


def test_progress_never_moves_back_to_an_older_scrape(clock: FakeClock) -> None:
    """A peer's scrape (shared over the bus, dated by its age) may be older than this process's
    last and still show other figures: the engine was seen moving at the later time all the
    same (the stall rule's times only move forward)."""
    a = ep(1)
    store = EndpointStore(stale_after=3.0, clock=clock)
    store.set_endpoints({"m": [a]})
    store.record_success(a, _scrape(10.0))
    store.record_success(a, _scrape(12.0, running=2.0))
    store.record_success(a, _scrape(11.5, running=3.0))  # a peer's, half a second older
    assert store.progressed_at(a.address) == 12.0
    store.record_success(a, _scrape(12.5, running=4.0))
    assert store.progressed_at(a.address) == 12.5


def test_progress_is_per_address_and_forgotten_with_the_endpoint(clock: FakeClock) -> None:
    a, a_lora, b = ep(1), ep(1, model="lora"), ep(2)
    store = EndpointStore(stale_after=3.0, clock=clock)
    store.set_endpoints({"m": [a, b], "lora": [a_lora]})
    store.record_success(a, _scrape(10.0))
    store.record_success(a_lora, _scrape(12.0, running=3.0))  # one server, two models
    assert store.progressed_at(a.address) == 12.0
    store.record_success(b, EngineMetrics(updated_at=10.0))  # exports none of the figures
    assert store.progressed_at(b.address) is None
    store.set_endpoints({"m": [b]})
    assert store.progressed_at(a.address) is None
