"""The pending overlay: blocks just routed to a pod with healthy KV events count as cached there
until its events could have confirmed them (`extproc/kvcache/pending.py`).

Each case is a history of routings (`PrefixIndex.record`), KV events (`ExactIndex`) and
event-stream health, then one query; the expected answer is per pod (tokens, exact?).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

from extproc.accounting import FairnessCounters, InflightTracker
from extproc.config import SyncConfig
from extproc.kvcache import ApproximateIndex, ExactIndex, IndexMode, PrefixIndex, block_hashes
from extproc.kvcache.pending import PendingOverlay
from extproc.sync import MemoryNetwork, StateSync, SyncMetrics

BS = 4
DOC = list(range(100, 164))  # 16 blocks
HASHES = block_hashes(DOC, BS)
A, B = "10.0.0.1:8000", "10.0.0.2:8000"
WINDOW = 2.0


def _engine(pod: str, n: int) -> list[int]:
    return [hash((pod, b)) & 0xFFFF_FFFF for b in range(n)]


@dataclass(frozen=True)
class Route:
    pod: str
    blocks: int
    at: float


@dataclass(frozen=True)
class Store:
    pod: str
    blocks: int


@dataclass(frozen=True)
class Remove:
    pod: str
    blocks: int  # the first `blocks` blocks


@dataclass(frozen=True)
class Unhealthy:
    pod: str


Event = Route | Store | Remove | Unhealthy

CASES: list[tuple[str, list[Event], float, dict[str, tuple[int, bool]]]] = [
    (
        "routed, not yet stored: counts on that pod only",
        [Route(A, 16, 0.0)],
        1.0,
        {A: (64, False), B: (0, True)},
    ),
    ("never stored: forgotten after the window", [Route(A, 16, 0.0)], 2.5, {A: (0, True)}),
    ("stored: the exact match answers", [Route(A, 16, 0.0), Store(A, 16)], 1.0, {A: (64, True)}),
    (
        "partly stored: the routed blocks count until the window ends",
        [Route(A, 16, 0.0), Store(A, 8)],
        1.0,
        {A: (64, False)},
    ),
    (
        "partly stored, after the window: what the events said",
        [Route(A, 16, 0.0), Store(A, 8)],
        2.5,
        {A: (32, True)},
    ),
    (
        "stored then evicted, after the window: the eviction counts",
        [Route(A, 16, 0.0), Store(A, 16), Remove(A, 16)],
        2.5,
        {A: (0, True)},
    ),
    (
        "evicted inside the window: still counted (at most the window long)",
        [Route(A, 16, 0.0), Store(A, 16), Remove(A, 16)],
        1.0,
        {A: (64, False)},
    ),
    (
        "routed again: the window starts again",
        [Route(A, 16, 0.0), Route(A, 16, 1.5)],
        3.0,
        {A: (64, False)},
    ),
    ("a shorter routed prefix: only as far as routed", [Route(A, 8, 0.0)], 1.0, {A: (32, False)}),
    (
        "both pods: each its own",
        [Route(A, 16, 0.0), Route(B, 4, 0.5), Store(B, 12)],
        1.0,
        {A: (64, False), B: (48, True)},
    ),
    (
        "events not flowing: the approximate index answers as before (its own TTL)",
        [Unhealthy(A), Route(A, 16, 0.0)],
        100.0,
        {A: (64, False)},
    ),
]


def _index(
    mode: IndexMode = IndexMode.AUTO, pending_s: float = WINDOW
) -> tuple[PrefixIndex, ExactIndex, set[str]]:
    exact = ExactIndex(block_size=BS)
    approx = ApproximateIndex(ttl_s=600.0, sweep_every_s=0.0)
    healthy = {A, B}
    index = PrefixIndex(
        mode=mode,
        block_size=BS,
        exact=exact,
        approximate=None if mode is IndexMode.EXACT else approx,
        events_healthy=healthy.__contains__,
        pending_s=pending_s,
    )
    return index, exact, healthy


def _apply(events: list[Event], index: PrefixIndex, exact: ExactIndex, healthy: set[str]) -> None:
    for ev in events:
        if isinstance(ev, Route):
            index.record(ev.pod, HASHES[: ev.blocks], ev.at)
        elif isinstance(ev, Store):
            exact.stored(ev.pod, _engine(ev.pod, ev.blocks), None, DOC[: ev.blocks * BS])
        elif isinstance(ev, Remove):
            exact.removed(ev.pod, _engine(ev.pod, ev.blocks))
        else:
            healthy.discard(ev.pod)


@pytest.mark.parametrize(
    ("events", "at", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_overlay(events: list[Event], at: float, want: dict[str, tuple[int, bool]]) -> None:
    index, exact, healthy = _index()
    _apply(events, index, exact, healthy)
    got = index.match([A, B], HASHES, at)
    arrays = index.lookup([A, B], HASHES, at)
    for i, pod in enumerate([A, B]):
        if pod in want:
            assert (got[pod].tokens, got[pod].exact) == want[pod], pod
        assert (int(arrays.tokens[i]), bool(arrays.exact[i])) == tuple(got[pod]), pod


@pytest.mark.parametrize(
    ("mode", "pending_s"), [(IndexMode.AUTO, 0.0), (IndexMode.EXACT, WINDOW)], ids=["off", "exact"]
)
def test_no_overlay_when_off_or_in_exact_mode(mode: IndexMode, pending_s: float) -> None:
    index, exact, healthy = _index(mode, pending_s)
    _apply([Route(A, 16, 0.0)], index, exact, healthy)
    assert index.match([A], HASHES, 0.5)[A] == (0, True)
    assert int(index.lookup([A], HASHES, 0.5).tokens[0]) == 0


def test_negative_window_is_refused() -> None:
    with pytest.raises(ValueError, match="window_s"):
        PendingOverlay(ApproximateIndex(), window_s=-1.0)


def test_peers_hear_of_every_routing_while_pending_is_on() -> None:
    """A routing to a pod with healthy events is published too: a peer's pending overlay needs it."""
    heard: list[tuple[str, int]] = []
    for pending_s in (WINDOW, 0.0):
        index = PrefixIndex(
            mode=IndexMode.AUTO,
            block_size=BS,
            exact=ExactIndex(block_size=BS),
            approximate=ApproximateIndex(),
            on_record=lambda pod, hashes: heard.append((pod, len(hashes))),
            pending_s=pending_s,
        )
        index.record(A, HASHES, 0.0)
    assert heard == [(A, 16)]  # once: with the overlay on, not with it off


@pytest.mark.parametrize("seed", range(4))
def test_lookup_equals_match_with_the_overlay(seed: int) -> None:
    """Random routings and events over many pods: the array answer equals the per-pod one."""
    rng = random.Random(seed)
    pods = [f"10.0.1.{i}:8000" for i in range(70)]
    exact = ExactIndex(block_size=BS)
    approx = ApproximateIndex(ttl_s=50.0, sweep_every_s=0.0)
    healthy = set(rng.sample(pods, 50))
    index = PrefixIndex(
        mode=IndexMode.AUTO,
        block_size=BS,
        exact=exact,
        approximate=approx,
        events_healthy=healthy.__contains__,
        pending_s=WINDOW,
    )
    for step in range(400):
        pod, n = rng.choice(pods), rng.randint(1, 16)
        if rng.random() < 0.5:
            index.record(pod, HASHES[:n], step * 0.01)
        else:
            exact.stored(pod, _engine(pod, n), None, DOC[: n * BS])
    now = 400 * 0.01
    got = index.match(pods, HASHES, now)
    arrays = index.lookup(pods, HASHES, now)
    assert [tuple(got[p]) for p in pods] == [
        (int(t), bool(e)) for t, e in zip(arrays.tokens, arrays.exact, strict=True)
    ]
    assert any(not m.exact and p in healthy for p, m in got.items())  # the overlay took part


# -- two replicas: one routes, the other sees the blocks as pending ----------------------------

SYNC = SyncConfig(tick_s=0.005, heartbeat_s=0.02, expire_s=0.2)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _replica(name: str, net: MemoryNetwork, clock: Clock) -> tuple[StateSync, PrefixIndex]:
    approx = ApproximateIndex(ttl_s=600.0, sweep_every_s=0.0)
    sync = StateSync(
        replica=name,
        bus=net.bus(),
        inflight=InflightTracker(clock=clock),
        fairness=FairnessCounters(),
        approx=lambda model: approx if model == "m" else None,
        models=lambda: ["m"],
        settings=SYNC,
        metrics=SyncMetrics(CollectorRegistry()),
        clock=clock,
    )
    index = PrefixIndex(
        mode=IndexMode.AUTO,
        block_size=BS,
        exact=ExactIndex(block_size=BS),
        approximate=approx,
        on_record=lambda pod, hashes: sync.note_blocks("m", pod, hashes),
        pending_s=WINDOW,
    )
    return sync, index


async def test_a_peer_sees_blocks_routed_by_another_replica_as_pending() -> None:
    clock, net = Clock(), MemoryNetwork()
    replicas = [_replica(f"r{i}", net, clock) for i in range(2)]
    for sync, _ in replicas:
        await sync._bus.start(sync.receive)
    (_, i0), (_, i1) = replicas
    i0.record(A, HASHES, clock())
    for _ in range(3):
        clock.now += SYNC.tick_s
        for sync, _ in replicas:
            await sync.tick()
        await asyncio.sleep(0.003)
    assert i1.match([A, B], HASHES, clock()) == {A: (64, False), B: (0, True)}
    clock.now += WINDOW + 0.1  # no KV event confirmed it on the peer either: forgotten
    assert i1.match([A], HASHES, clock())[A] == (0, True)
    for sync, _ in replicas:
        await sync._bus.close()
