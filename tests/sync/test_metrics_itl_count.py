"""A scrape's inter-token gap count travels beside its row (message key "n"), so every replica
works out the pod's recent inter-token latency (kv-aware's `slow_after`) from the owner's scrapes;
a message from a replica that predates the key still reads."""

from __future__ import annotations

import msgpack
import pytest

from extproc.sync import MemoryNetwork
from extproc.types import EngineMetrics
from tests.sync._bus import PODS, Clock, make, tick_all


@pytest.mark.parametrize("count", [1234.0, None])
async def test_a_scrapes_itl_count_reaches_the_peers(count: float | None) -> None:
    clock, net = Clock(), MemoryNetwork()
    got: list[EngineMetrics] = []
    a, b = make("r0", net, clock), make("r1", net, clock)
    b.sync._on_metrics = lambda model, address, m: got.append(m)
    for r in (a, b):
        await r.sync._bus.start(r.sync.receive)
    scraped = EngineMetrics(updated_at=clock.now, running=2, itl_avg_s=0.01, itl_count=count)
    a.sync.note_metrics("m", PODS[0].address, scraped)
    await tick_all([a, b], clock)
    [metrics] = got
    assert metrics.itl_avg_s == pytest.approx(0.01)
    assert metrics.itl_count == count


async def test_rows_without_counts_from_an_older_replica_still_read() -> None:
    clock, net = Clock(), MemoryNetwork()
    got: list[EngineMetrics] = []
    a, b = make("r0", net, clock), make("r1", net, clock)
    b.sync._on_metrics = lambda model, address, m: got.append(m)
    await b.sync._bus.start(b.sync.receive)
    a.sync.note_metrics("m", PODS[0].address, EngineMetrics(updated_at=clock.now, running=2))
    rows = list(a.sync._scrapes.values())
    old = {"v": 1, "r": "old", "s": 1, "t": 0.0, "i": [], "m": rows}  # no "n"
    b.sync.receive(msgpack.packb(old))
    [metrics] = got
    assert metrics.running == 2 and metrics.itl_count is None
    assert b.sample("extproc_sync_dropped_total", reason="malformed") == 0
