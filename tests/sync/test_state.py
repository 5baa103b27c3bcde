"""Replica state sync over an injected bus: lag, loss, duplicates, reordering, a bus that goes
away, a replica that dies. The invariant: every replica's view of in-flight load equals the
truth once messages get through, whatever was lost before."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import msgpack
import pytest

from extproc.accounting import Lease, Load
from extproc.config import SyncConfig as SyncSettings
from extproc.sync import MemoryNetwork
from extproc.sync.state import owner
from extproc.types import EngineMetrics
from tests.sync._bus import PODS, SETTINGS, Clock, Replica, make, started, tick_all


@pytest.fixture
def clock() -> Clock:
    return Clock()


def truth(replicas: list[Replica]) -> dict[str, Load]:
    out: dict[str, Load] = {}
    for r in replicas:
        for address, load in r.inflight.snapshot().items():
            cur = out.get(address, Load())
            out[address] = Load(cur.requests + load.requests, cur.tokens + load.tokens)
    return out


def views_match_truth(replicas: list[Replica]) -> bool:
    want = truth(replicas)
    return all(
        r.inflight.load(p.address) == want.get(p.address, Load()) for r in replicas for p in PODS
    )


def churn(replicas: list[Replica], leases: list[list[Lease]], rng: random.Random) -> None:
    """Random starts and finishes on random replicas (the decisions of some moment)."""
    for i, r in enumerate(replicas):
        for _ in range(rng.randint(0, 3)):
            leases[i].append(r.inflight.start(rng.choice(PODS), rng.randint(1, 500)))
        for _ in range(rng.randint(0, 2)):
            if leases[i]:
                leases[i].pop(rng.randrange(len(leases[i]))).finish()


async def test_without_loss_every_view_is_the_truth_after_each_tick(clock: Clock) -> None:
    net = MemoryNetwork()
    replicas = await started(net, clock, 3)
    rng = random.Random(1)
    leases: list[list[Lease]] = [[] for _ in replicas]
    for _ in range(40):
        churn(replicas, leases, rng)
        await tick_all(replicas, clock)
        assert views_match_truth(replicas)
    assert all(r.sample("extproc_sync_peers") == 2 for r in replicas)


@pytest.mark.parametrize("seed", [2, 3, 4])
async def test_with_loss_duplicates_and_reordering_views_converge_within_a_tick(
    clock: Clock, seed: int
) -> None:
    net = MemoryNetwork(lag_s=0.001, loss=0.3, duplicate=0.3, reorder=True, seed=seed)
    replicas = await started(net, clock, 3)
    rng = random.Random(seed)
    leases: list[list[Lease]] = [[] for _ in replicas]
    for _ in range(30):
        churn(replicas, leases, rng)
        await tick_all(replicas, clock)
    net.loss = net.duplicate = 0.0
    net.reorder = False
    churn(replicas, leases, rng)
    await tick_all(replicas, clock)  # one tick after the faults stop
    assert views_match_truth(replicas)
    assert net.dropped > 0
    assert sum(r.sample("extproc_sync_dropped_total", reason="duplicate") for r in replicas) > 0


async def test_an_older_message_never_replaces_a_newer_count(clock: Clock) -> None:
    net = MemoryNetwork()
    a, b = await started(net, clock, 2)
    first = a.inflight.start(PODS[0], 10)
    await a.sync.tick()
    old = {"v": 1, "r": "r0", "s": 1, "t": 0.0, "i": [[PODS[0].address, 1, 10]]}
    first.finish()
    clock.now += 1
    await tick_all([a, b], clock)
    assert b.inflight.load(PODS[0].address) == Load()
    b.sync.receive(msgpack.packb({**old, "s": 0}))  # arrives late, older than what b has
    assert b.inflight.load(PODS[0].address) == Load()


async def test_charges_are_applied_once_and_kept_while_the_bus_is_down(clock: Clock) -> None:
    net = MemoryNetwork(duplicate=1.0)  # every message twice
    a, b = await started(net, clock, 2)
    a.fairness.charge("alice", output_tokens=10)  # 2 per output token
    await tick_all([a, b], clock)
    assert b.fairness.tokens("alice") == pytest.approx(20)
    net.down = True
    a.fairness.charge("alice", input_tokens=5)
    await tick_all([a, b], clock, rounds=3)
    assert b.fairness.tokens("alice") == pytest.approx(20)
    assert a.sample("extproc_sync_dropped_total", reason="bus_down") >= 1
    net.down = False
    await tick_all([a, b], clock)
    assert b.fairness.tokens("alice") == pytest.approx(25)  # delivered once it could be


async def test_a_silent_replica_share_expires_and_comes_back(clock: Clock) -> None:
    net = MemoryNetwork()
    a, b = await started(net, clock, 2)
    a.inflight.start(PODS[1], 7)
    await tick_all([a, b], clock)
    assert b.inflight.load(PODS[1].address) == Load(1, 7)
    await a.sync._bus.close()  # a dies (or is partitioned away)
    clock.now += SETTINGS.expire_s + 0.01
    await tick_all([b], clock)
    assert b.inflight.load(PODS[1].address) == Load()
    assert b.sample("extproc_sync_stale_total") == 1
    assert b.sync.members() == ["r1"]
    await a.sync._bus.start(a.sync.receive)  # back: its next heartbeat restores the share
    clock.now += SETTINGS.heartbeat_s
    await tick_all([a, b], clock)
    assert b.inflight.load(PODS[1].address) == Load(1, 7)
    assert b.sync.members() == ["r0", "r1"]


async def test_approximate_blocks_reach_the_peers_index(clock: Clock) -> None:
    net = MemoryNetwork()
    a, b = await started(net, clock, 2)
    a.sync.note_blocks("m", PODS[2].address, [11, 22, 33])
    a.sync.note_blocks("other-model", PODS[2].address, [44])  # a model b does not serve
    await tick_all([a, b], clock)
    found = b.approx.longest_prefix([11, 22, 33, 99], clock.now, [p.address for p in PODS])
    assert found.get(PODS[2].address) == 3


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"v": 1}), msgpack.packb({"v": 99})],
)
async def test_a_bad_message_is_dropped_and_counted(clock: Clock, data: bytes) -> None:
    net = MemoryNetwork()
    [a] = await started(net, clock, 1)
    a.sync.receive(data)
    dropped = a.sample("extproc_sync_dropped_total", reason="malformed") + a.sample(
        "extproc_sync_dropped_total", reason="version"
    )
    assert dropped == 1
    assert a.inflight.remote_replicas() == []


@pytest.fixture
async def running(clock: Clock) -> AsyncIterator[list[Replica]]:
    net = MemoryNetwork(lag_s=0.001)
    replicas = [make(f"r{i}", net, clock) for i in range(2)]
    for r in replicas:
        await r.sync.start()
    yield replicas
    for r in replicas:
        await r.sync.stop()


async def test_the_background_loop_publishes_and_stops_cleanly(running: list[Replica]) -> None:
    a, b = running
    a.inflight.start(PODS[3], 3)
    for _ in range(200):
        if b.inflight.load(PODS[3].address) == Load(1, 3):
            break
        await asyncio.sleep(0.005)
    assert b.inflight.load(PODS[3].address) == Load(1, 3)
    assert a.sample("extproc_sync_messages_total", direction="sent") >= 1


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        SyncSettings(tick_s=0.2, heartbeat_s=0.1)
    with pytest.raises(ValueError):
        SyncSettings(heartbeat_s=1.0, expire_s=0.5)


def test_rendezvous_owner_spreads_keys_and_moves_only_a_leavers() -> None:
    keys = [f"http://10.0.{i // 200}.{i % 200}:8000/metrics" for i in range(600)]
    three = {k: owner(k, ["a", "b", "c"]) for k in keys}
    counts = {m: sum(1 for o in three.values() if o == m) for m in "abc"}
    assert all(150 <= n <= 250 for n in counts.values()), counts
    two = {k: owner(k, ["a", "b"]) for k in keys}
    moved = [k for k in keys if three[k] != two[k]]
    assert moved and all(three[k] == "c" for k in moved)  # only c's keys moved


async def test_each_pod_is_owned_by_exactly_one_live_replica(clock: Clock) -> None:
    net = MemoryNetwork()
    replicas = await started(net, clock, 3)
    assert all(r.sync.owns("x") for r in replicas)  # alone at first: each scrapes everything
    await tick_all(replicas, clock)
    urls = [f"http://10.0.0.{i}:8000/metrics" for i in range(50)]
    for url in urls:
        assert sum(r.sync.owns(url) for r in replicas) == 1


async def test_a_scrape_reaches_the_peers_with_its_age(clock: Clock) -> None:
    net = MemoryNetwork()
    got: list[tuple[str, str, EngineMetrics]] = []
    a = make("r0", net, clock)
    b = make("r1", net, clock)
    b.sync._on_metrics = lambda model, address, m: got.append((model, address, m))
    for r in (a, b):
        await r.sync._bus.start(r.sync.receive)
    scraped = EngineMetrics(
        updated_at=clock.now - 0.25, running=3, waiting=1, kv_cache_usage=0.4,
        prefix_cache_hits=100, prefix_cache_queries=200, ttft_avg_s=0.05,
        running_lora_adapters=("sql",), max_lora=4, num_gpu_blocks=1000,
    )  # fmt: skip
    a.sync.note_metrics("m", PODS[0].address, scraped)
    await tick_all([a, b], clock)
    [(model, address, metrics)] = got
    assert (model, address) == ("m", PODS[0].address)
    assert metrics.running == 3 and metrics.kv_cache_usage == pytest.approx(0.4)
    assert metrics.running_lora_adapters == ("sql",) and metrics.max_lora == 4
    assert metrics.itl_avg_s is None  # unknown stays unknown
    # Rebased to b's clock: about as old as it was when a published it (ticks add a little).
    assert clock.now - metrics.updated_at == pytest.approx(0.25 + SETTINGS.tick_s, abs=0.05)


async def test_a_replica_that_joins_late_gets_a_snapshot_of_the_approximate_index(
    clock: Clock,
) -> None:
    net = MemoryNetwork()
    a = make("r0", net, clock)
    await a.sync._bus.start(a.sync.receive)
    a.approx.record(PODS[0].address, [1, 2, 3, 4], clock.now)  # learnt before b existed
    await tick_all([a], clock, rounds=3)
    b = make("r1", net, clock)
    await b.sync._bus.start(b.sync.receive)
    assert b.approx.longest_prefix([1, 2, 3, 4], clock.now) == {}
    clock.now += SETTINGS.heartbeat_s  # b says hello; a answers with its index
    await tick_all([a, b], clock, rounds=2)
    found = b.approx.longest_prefix([1, 2, 3, 4], clock.now, [PODS[0].address])
    assert found == {PODS[0].address: 4}
    sent_before = a.sample("extproc_sync_messages_total", direction="sent")
    a.approx.record(PODS[1].address, [9], clock.now)
    clock.now += SETTINGS.heartbeat_s
    await tick_all([a, b], clock, rounds=3)  # heartbeats, but no hello since: no snapshot
    assert b.approx.longest_prefix([9], clock.now) == {}
    assert a.sample("extproc_sync_messages_total", direction="sent") > sent_before
