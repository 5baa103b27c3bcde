"""EndpointStore.ready() keeps a per-model list up to date on each scrape instead of checking
every endpoint's state per request: it must always equal the definition (`is_ready` over the
model's endpoints, in order), whatever the sequence of scrapes, failures and set changes."""

from __future__ import annotations

import random

import pytest

from extproc.metrics.store import EndpointStore
from extproc.types import Endpoint, EngineMetrics
from tests.metrics._ready import ready_by_definition


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_failures", [None, 2])
def test_ready_equals_is_ready_over_random_events(seed: int, max_failures: int | None) -> None:
    rng = random.Random(seed)
    clock = [100.0]
    store = EndpointStore(
        stale_after=5.0,
        clock=lambda: clock[0],
        ready_without_metrics_url=bool(seed % 2),
        exclude_unreachable=seed % 3 != 0,
        max_failures=max_failures,
    )

    def endpoints(model: str, n: int) -> list[Endpoint]:
        return [
            Endpoint(
                f"10.0.0.{i}:8000",
                model,
                metrics_url=None if i % 7 == 0 else f"http://10.0.0.{i}:8000/metrics",
            )
            for i in rng.sample(range(1, 40), n)
        ]

    store.set_endpoints({"a": endpoints("a", 12), "b": endpoints("b", 6)})
    seen_ready = 0
    for _ in range(400):
        clock[0] += rng.uniform(0.0, 1.5)
        model = rng.choice(["a", "b"])
        eps = store.endpoints(model)
        action = rng.random()
        if action < 0.5 and eps:
            # A scrape of now or a peer's older one, trusted for stale_after or an idle pod's
            # longer (or shorter) window.
            taken = clock[0] - rng.choice([0.0, 0.0, rng.uniform(0.0, 6.0)])
            store.record_success(
                rng.choice(eps),
                EngineMetrics(updated_at=taken, waiting=1.0),
                trusted_for=rng.choice([None, None, 1.0, 12.0]),
            )
        elif action < 0.8 and eps:
            store.record_failure(rng.choice(eps), "boom", unreachable=rng.random() < 0.5)
        elif action < 0.85:
            kept = list(eps[: rng.randint(0, len(eps))])
            store.set_endpoints(
                {
                    **{m: store.endpoints(m) for m in store.models()},
                    model: kept + endpoints(model, 3),
                }
            )
        for m in store.models():
            got = [(e.address, metrics.updated_at) for e, metrics in store.ready(m)]
            assert got == ready_by_definition(store, m, clock[0])
            seen_ready += len(got)
    assert seen_ready > 0  # the walk did reach ready endpoints
