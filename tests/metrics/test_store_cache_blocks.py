"""EndpointStore.cache_blocks: what a pool's pods can cache together (sizes its indexes)."""

from __future__ import annotations

import pytest

from extproc.metrics.store import EndpointStore
from extproc.types import Endpoint, EngineMetrics


def ep(port: int, model: str) -> Endpoint:
    return Endpoint(f"127.0.0.1:{port}", model, metrics_url=f"http://127.0.0.1:{port}/metrics")


@pytest.mark.parametrize(
    ("reported", "expected"),
    [
        ((), 0),  # a pool with no pods
        ((None,), 100),  # never scraped: the stand-in
        ((8192, 8192), 16384),
        ((8192, None, 0), 8192 + 100 + 100),  # 0 is "not saying", as None
        ((1024, 2048, 4096), 7168),
    ],
)
def test_sums_what_each_pod_reports_and_a_stand_in_for_the_silent(
    reported: tuple[int | None, ...], expected: int
) -> None:
    store = EndpointStore(stale_after=3.0)
    pods = [ep(8000 + i, "a") for i in range(len(reported))]
    store.set_endpoints({"a": pods, "b": [ep(9000, "b")]})
    for pod, blocks in zip(pods, reported, strict=True):
        if blocks is not None:
            store.record_success(pod, EngineMetrics(updated_at=1.0, num_gpu_blocks=blocks))
    store.record_success(ep(9000, "b"), EngineMetrics(updated_at=1.0, num_gpu_blocks=999))
    assert store.cache_blocks("a", unknown=100) == expected
    assert store.cache_blocks("b", unknown=100) == 999  # other pools do not count
    assert store.cache_blocks("gone", unknown=100) == 0
