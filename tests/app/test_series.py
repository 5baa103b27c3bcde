"""The status page's per-pod samples (`PodSeries`) over a real in-flight tracker and pod
stats tracker: rates per interval, bounded rings, pods that leave are forgotten."""

from __future__ import annotations

from extproc.accounting.inflight import InflightTracker
from extproc.accounting.podstats import PodStatsTracker
from extproc.admin.series import PodSeries
from extproc.types import Endpoint


def served(stats: PodStatsTracker, address: str, n: int, now: float) -> None:
    for _ in range(n):
        stats.observe_response(
            address, now=now, latency_s=0.2, ttft_s=0.05, decode_s=0.15, tokens=10,
            completion_tokens=4,
        )  # fmt: skip


def test_rates_per_interval_in_flight_and_ttft() -> None:
    clock = [100.0]
    stats = PodStatsTracker()
    tracker = InflightTracker(clock=lambda: clock[0], stats=stats)
    series = PodSeries(size=5)
    a, b = "10.0.0.1:8000", "10.0.0.2:8000"
    series.sample([a, b], tracker, wall=1000.0)
    served(stats, a, 6, clock[0])
    tracker.pick_failed(b, clock[0])
    lease = tracker.start(Endpoint(a, "m"), tokens=10)
    series.sample([a, b], tracker, wall=1002.0)
    out_a, out_b = series.json(a), series.json(b)
    assert out_a is not None and out_b is not None
    assert out_a["requests_per_s"] == [None, 3.0] and out_a["errors_per_s"] == [None, 0.0]
    assert out_b["errors_per_s"] == [None, 0.5] and out_b["requests_per_s"] == [None, 0.0]
    assert out_a["in_flight"] == [0, 1]
    assert out_a["ttft_ms"][0] is None and abs(out_a["ttft_ms"][1] - 50.0) < 1e-6
    assert out_b["ttft_ms"] == [None, None]
    lease.finish()


def test_rings_are_bounded_and_gone_pods_forgotten() -> None:
    tracker = InflightTracker(stats=PodStatsTracker())
    series = PodSeries(size=3, max_pods=2)
    pods = ["p1:1", "p2:1", "p3:1"]
    for t in range(10):
        series.sample(pods, tracker, wall=float(t))
    kept = series.json("p1:1")
    assert kept is not None and kept["at"] == [7.0, 8.0, 9.0]
    assert series.json("p3:1") is None  # beyond max_pods
    series.sample(["p2:1"], tracker, wall=10.0)
    assert series.json("p1:1") is None and series.json("p2:1") is not None
