"""EndpointStore: an engine's recent inter-token latency from consecutive scrapes of its
lifetime histogram (`EngineMetrics.itl_recent_s`, `itl_baseline_s`; read by kv-aware's `slow_after`)."""

from __future__ import annotations

import math

import pytest

from extproc.metrics.store import (
    ITL_BASELINE_TAU_S,
    ITL_RECENT_FOR_S,
    ITL_RECENT_TAU_S,
    EndpointStore,
    ReadyEndpoints,
)
from extproc.types import Endpoint, EngineMetrics

POD = Endpoint("127.0.0.1:1", "m", metrics_url="http://127.0.0.1:1/metrics")


def _scrape(at: float, total_s: float, count: float) -> EngineMetrics:
    """A scrape whose ITL histogram holds `count` gaps summing to `total_s`."""
    return EngineMetrics(
        updated_at=at, itl_avg_s=total_s / count if count else None, itl_count=count
    )


def _means(scrapes: list[tuple[float, float, float]]) -> list[tuple[float | None, float | None]]:
    """(`itl_recent_s`, `itl_baseline_s`) after each (time, lifetime sum, lifetime count)
    scrape."""
    store = EndpointStore(stale_after=1e9, clock=lambda: 0.0)
    store.set_endpoints({"m": [POD]})
    out = []
    for at, total, count in scrapes:
        store.record_success(POD, _scrape(at, total, count))
        state = store.state(POD)
        assert state is not None and state.metrics is not None
        out.append((state.metrics.itl_recent_s, state.metrics.itl_baseline_s))
    return out


def _w(tau: float, dt: float = 0.5) -> float:
    """A new value's weight `dt` after the last."""
    return 1.0 - math.exp(-dt / tau)


R, B = _w(ITL_RECENT_TAU_S), _w(ITL_BASELINE_TAU_S)
HEALTHY = [(0.0, 1.0, 100), (0.5, 1.5, 150)]  # 50 gaps of 10 ms


@pytest.mark.parametrize(
    ("scrapes", "expected"),
    [
        # The first scrape has nothing to compare with; the next says what the new gaps took.
        (HEALTHY, [(None, None), (0.01, 0.01)]),
        # The engine turns 10x slower (40 gaps of 100 ms): the recent mean moves much of the
        # way at once, the baseline a little.
        ([*HEALTHY, (1.0, 5.5, 190)], [(None, None), (0.01, 0.01),
                                      (0.01 + R * 0.09, 0.01 + B * 0.09)]),
        # One request held behind long prefills: one gap of 480 ms, too few to say anything
        # alone; the next scrapes add 40 gaps of 10 ms, and the 41 together make the mean.
        ([*HEALTHY, (1.0, 1.98, 151), (1.5, 2.38, 191)],
         [(None, None), (0.01, 0.01), (0.01, 0.01),
          (0.01 + _w(ITL_RECENT_TAU_S, 1.0) * (0.88 / 41 - 0.01),
           0.01 + _w(ITL_BASELINE_TAU_S, 1.0) * (0.88 / 41 - 0.01))]),
        # No new gaps: both stand ...
        ([*HEALTHY, (10.0, 1.5, 150)], [(None, None), (0.01, 0.01), (0.01, 0.01)]),
        # ... the recent one until ITL_RECENT_FOR_S after the last new gaps.
        ([*HEALTHY, (0.5 + ITL_RECENT_FOR_S + 1, 1.5, 150)],
         [(None, None), (0.01, 0.01), (None, 0.01)]),
        # After a long pause new gaps replace the recent value (it had stood for long).
        ([*HEALTHY, (20.0, 5.5, 190)],
         [(None, None), (0.01, 0.01), (0.1, 0.01 + _w(ITL_BASELINE_TAU_S, 19.5) * 0.09)]),
        # The engine restarted (its count went down): start over.
        ([*HEALTHY, (1.0, 0.2, 10)], [(None, None), (0.01, 0.01), (None, None)]),
    ],
)  # fmt: skip
def test_itl_means_from_consecutive_scrapes(
    scrapes: list[tuple[float, float, float]],
    expected: list[tuple[float | None, float | None]],
) -> None:
    got = _means(scrapes)
    assert got == [tuple(v if v is None else pytest.approx(v) for v in pair) for pair in expected]


def test_an_engine_without_an_itl_count_has_no_recent_value() -> None:
    store = EndpointStore(stale_after=1e9, clock=lambda: 0.0)
    store.set_endpoints({"m": [POD]})
    for at in (0.0, 0.5):
        store.record_success(POD, EngineMetrics(updated_at=at, itl_avg_s=0.01))
    state = store.state(POD)
    assert state is not None and state.metrics is not None
    assert state.metrics.itl_recent_s is None and state.metrics.itl_baseline_s is None


def _recent_column(store: EndpointStore) -> list[float]:
    ready = store.ready("m")
    assert isinstance(ready, ReadyEndpoints)
    values: list[float] = ready.columns.column("itl_recent_s").tolist()
    return values


def test_the_recent_value_is_a_column_and_forgotten_with_the_endpoint() -> None:
    store = EndpointStore(stale_after=1e9, clock=lambda: 1.0)
    store.set_endpoints({"m": [POD]})
    store.record_success(POD, _scrape(0.0, 1.0, 100))
    store.record_success(POD, _scrape(0.5, 1.5, 150))
    assert _recent_column(store) == [pytest.approx(0.01)]
    store.set_endpoints({"m": []})
    store.set_endpoints({"m": [POD]})
    store.record_success(POD, _scrape(1.0, 2.5, 160))  # no scrape before it any more
    assert math.isnan(_recent_column(store)[0])
