"""bench.faults.bucket_quantile: a quantile between two cumulative histogram snapshots, as
Prometheus' histogram_quantile interpolates it."""

from __future__ import annotations

import math

import pytest

from bench.faults import bucket_quantile

INF = math.inf


@pytest.mark.parametrize(
    ("before", "after", "q", "expected_ms"),
    [
        # 10 observations all in (0.5 ms, 1 ms]: the median is halfway through that bucket.
        ({0.0005: 0, 0.001: 0, INF: 0}, {0.0005: 0, 0.001: 10, INF: 10}, 0.5, 0.75),
        # Only the difference counts: 100 earlier observations below 0.5 ms are not in it.
        ({0.0005: 100, 0.001: 100, INF: 100}, {0.0005: 100, 0.001: 110, INF: 110}, 0.5, 0.75),
        # p99 of 90 fast + 10 slow lands in the slow bucket.
        ({}, {0.0005: 90, 0.002: 100, INF: 100}, 0.99, 1.85),
        # Everything in the first bucket interpolates from zero.
        ({}, {0.001: 4, INF: 4}, 0.5, 0.5),
        # Beyond the last finite bound: the bound is the answer (Prometheus does the same).
        ({}, {0.001: 0, INF: 3}, 0.5, 1.0),
    ],
)
def test_quantile_between_snapshots(
    before: dict[float, float], after: dict[float, float], q: float, expected_ms: float
) -> None:
    assert bucket_quantile(before, after, q) == pytest.approx(expected_ms)


def test_no_observations_between_snapshots_has_no_quantile() -> None:
    same = {0.001: 5, INF: 5}
    assert bucket_quantile(same, same, 0.99) is None
