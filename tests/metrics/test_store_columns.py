"""The store's engine columns equal the per-object values, whatever happens to the endpoints.

A seeded random walk of scrapes (with fields missing and LoRA adapter sets changing),
failures, endpoint sets changing (joins, leaves, models with few and many endpoints) and
the clock moving past `stale_after`; after every step each model's `ready()` must equal the
definition (`is_ready` over its endpoints, in order), and where it carries columns, every
column must equal the field of each ready endpoint's metrics, by position. A ready list's
columns must also stay as they were when later scrapes land (copy on write).
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from extproc.metrics.store import (
    ENGINE_FIELDS,
    EndpointStore,
    ReadyEndpoints,
)
from extproc.types import Endpoint, EngineMetrics
from tests.metrics._ready import ready_by_definition

ADAPTERS = ["a", "b", "c", "d"]


def _metrics(rng: random.Random, now: float) -> EngineMetrics:
    def maybe(value: float) -> float | None:
        return None if rng.random() < 0.15 else value

    running = tuple(rng.sample(ADAPTERS, rng.randint(0, 2)))
    return EngineMetrics(
        updated_at=now - rng.uniform(0.0, 2.0),  # a scrape's own time, not always the latest
        waiting=maybe(float(rng.randint(0, 9))),
        running=maybe(float(rng.randint(0, 30))),
        kv_cache_usage=maybe(rng.random()),
        ttft_avg_s=maybe(rng.uniform(0.05, 0.5)),
        itl_avg_s=maybe(rng.uniform(0.01, 0.05)),
        running_lora_adapters=running,
        waiting_lora_adapters=tuple(rng.sample(ADAPTERS, rng.randint(0, 1))),
        max_lora=rng.choice([None, 2, 4]),
    )


def _check_columns(ready: ReadyEndpoints) -> None:
    cols = ready.columns
    assert cols.n == len(ready)
    assert cols.endpoints() == [ep for ep, _ in ready]
    assert cols.addresses() == [ep.address for ep, _ in ready]
    by_address = sorted(range(len(ready)), key=lambda i: ready[i][0].address)
    assert cols.address_order().tolist() == by_address
    for field in ENGINE_FIELDS:
        want = [math.nan if (v := getattr(m, field)) is None else v for _, m in ready]
        np.testing.assert_array_equal(cols.column(field), np.array(want, dtype=float), field)
    keys = [cols.lora_sets[i] for i in cols.lora_ids.tolist()]
    assert keys == [
        (m.running_lora_adapters, m.waiting_lora_adapters, m.max_lora) for _, m in ready
    ]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_columns_equal_the_metrics_after_random_events(seed: int) -> None:
    rng = random.Random(seed)
    clock = [100.0]
    store = EndpointStore(
        stale_after=5.0,
        clock=lambda: clock[0],
        exclude_unreachable=seed % 2 == 0,
        max_failures=None if seed % 3 else 2,
    )
    pool = [
        Endpoint(
            f"10.0.{i // 200}.{i % 200}:8000",
            "m",
            metrics_url=None if i % 31 == 0 else f"http://10.0.{i // 200}.{i % 200}:8000/metrics",
        )
        for i in range(1, 160)
    ]

    def some(n: int) -> list[Endpoint]:
        return rng.sample(pool, n)

    store.set_endpoints({"big": some(70), "small": some(8), "edge": some(32)})
    held: list[ReadyEndpoints] = []  # earlier ready lists, with what their columns read then
    snapshots: list[tuple[ReadyEndpoints, dict[str, np.ndarray]]] = []
    with_columns = 0
    for step in range(600):
        clock[0] += rng.uniform(0.0, 0.4)
        model = rng.choice(store.models())
        eps = store.endpoints(model)
        action = rng.random()
        if action < 0.6 and eps:
            for ep in rng.sample(eps, min(len(eps), rng.randint(1, 6))):
                # Some figures are trusted longer or shorter than `stale_after` (idle pods).
                trusted = rng.choice((None, None, rng.uniform(0.5, 12.0)))
                store.record_success(ep, _metrics(rng, clock[0]), trusted_for=trusted)
        elif action < 0.85 and eps:
            store.record_failure(rng.choice(eps), "boom", unreachable=rng.random() < 0.5)
        elif action < 0.93:  # a few pods leave and join (a model may cross the threshold)
            kept = list(eps[rng.randint(0, 3) :])
            joined = [ep for ep in some(rng.randint(0, 6)) if ep not in kept]
            store.set_endpoints(
                {**{m: store.endpoints(m) for m in store.models()}, model: kept + joined}
            )
        else:
            clock[0] += rng.uniform(0.0, 6.0)  # some pods go stale
        for m in store.models():
            ready = store.ready(m)
            got = [(ep.address, metrics.updated_at) for ep, metrics in ready]
            assert got == ready_by_definition(store, m, clock[0]), (step, m)
            # White-box: the soonest expiry `ready()` compares against (to skip the per-pod
            # age check) is unknown or exact, never merely a bound (each request would then
            # pay the mask).
            table = store._tables[m]
            timed = table.routable & table.aged
            assert table.soonest is None or table.soonest == (
                table.expires[timed].min() if timed.any() else math.inf
            )
            if ready:
                assert isinstance(ready, ReadyEndpoints)
                _check_columns(ready)
                with_columns += 1
                if step % 25 == 0:
                    cols = ready.columns
                    seen = {f: cols.column(f).copy() for f in ENGINE_FIELDS}
                    seen["lora"] = cols.lora_ids.copy()
                    snapshots.append((ready, seen))
                    held.append(ready)
    assert with_columns > 100
    for ready, seen in snapshots:  # what a decision was given never changed under it
        for f in ENGINE_FIELDS:
            np.testing.assert_array_equal(ready.columns.column(f), seen[f])
        np.testing.assert_array_equal(ready.columns.lora_ids, seen["lora"])
        _check_columns(ready)
    # Adapter sets are interned once per distinct set held, and released when no slot holds one.
    live = set()
    for m in store.models():
        for ep in store.endpoints(m):
            state = store.state(ep)
            assert state is not None
            metrics = state.metrics
            live.add(
                ((), (), None)
                if metrics is None
                else (
                    metrics.running_lora_adapters,
                    metrics.waiting_lora_adapters,
                    metrics.max_lora,
                )
            )
    assert store.adapter_sets() == len(live)


def test_a_subset_keeps_its_columns() -> None:
    store = EndpointStore(stale_after=5.0, clock=lambda: 10.0)
    eps = [Endpoint(f"10.0.0.{i}:8000", "m", metrics_url=f"http://x{i}/metrics") for i in range(40)]
    store.set_endpoints({"m": eps})
    rng = random.Random(3)
    for ep in eps:
        store.record_success(ep, _metrics(rng, 10.0))
    ready = store.ready("m")
    assert isinstance(ready, ReadyEndpoints) and ready.columns.n == 40
    mask = [i % 3 != 0 for i in range(40)]
    part = ready.keep(mask)
    assert [ep for ep, _ in part] == [ep for ep, keep in zip(eps, mask, strict=True) if keep]
    _check_columns(part)
    _check_columns(part.keep([i % 2 == 0 for i in range(len(part))]))


def test_arrays_handed_out_are_read_only() -> None:
    store = EndpointStore(stale_after=5.0, clock=lambda: 10.0)
    eps = [Endpoint(f"10.0.0.{i}:8000", "m", metrics_url=f"http://x{i}/metrics") for i in range(40)]
    store.set_endpoints({"m": eps})
    for ep in eps:
        store.record_success(ep, EngineMetrics(updated_at=10.0, waiting=1.0))
    ready = store.ready("m")
    assert isinstance(ready, ReadyEndpoints)
    with pytest.raises(ValueError, match="read-only"):
        ready.columns.column("waiting")[0] = 5.0
    store.record_success(eps[0], EngineMetrics(updated_at=10.0, waiting=7.0))
    assert ready.columns.column("waiting")[0] == 1.0
    assert store.ready("m").columns.column("waiting")[0] == 7.0  # type: ignore[attr-defined]


def test_no_metrics_url_endpoints_are_ready_with_empty_metrics() -> None:
    now = [10.0]
    store = EndpointStore(stale_after=5.0, clock=lambda: now[0])
    eps = [
        Endpoint(f"10.0.0.{i}:8000", "m", metrics_url=None if i % 4 == 0 else f"http://x{i}/m")
        for i in range(40)
    ]
    store.set_endpoints({"m": eps})
    for ep in eps[1::2]:
        store.record_success(ep, EngineMetrics(updated_at=10.0, running=2.0))
    now[0] = 12.0
    ready = store.ready("m")
    assert isinstance(ready, ReadyEndpoints)
    assert [ep for ep, _ in ready] == [ep for i, ep in enumerate(eps) if i % 4 == 0 or i % 2 == 1]
    assert all(m.updated_at == 12.0 for ep, m in ready if ep.metrics_url is None)
    _check_columns(ready)
