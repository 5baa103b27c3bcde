"""KVEventSubscriber / KVEventManager against real ZMQ sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from extproc.kvcache import ExactIndex, StoreResult, block_hashes
from extproc.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventEncoding,
    KVEventManager,
    KVEventMetrics,
    KVEventSubscriber,
    SubscriberSettings,
)
from extproc.types import Endpoint
from tests.kvcache._engine import EngineCache, Stored

from ._publisher import TestPublisher

BS = 16
POD = "10.0.0.1:8000"
# Replies come at once from a local ROUTER; the timeout only matters on a loaded machine.
SETTINGS = SubscriberSettings(replay_timeout_s=3.0, stall_after_s=5.0)
# For the tests that wait for a replay timeout on purpose.
SHORT_REPLAY = SubscriberSettings(replay_timeout_s=0.3, stall_after_s=5.0)


@pytest.fixture
async def ctx(no_leaked_tasks: None) -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


def stored_event(event: Stored) -> BlockStored:
    from array import array

    return BlockStored(
        tuple(event.engine_hashes),
        event.parent,
        array("I", event.token_ids),
        BS,
        None,
        "GPU",
        event.lora_name,
    )


async def until(cond: Callable[[], bool]) -> None:
    async with asyncio.timeout(15.0):
        while not cond():  # noqa: ASYNC110 - state changes inside the subscriber, no event to await
            await asyncio.sleep(0.005)


class Rig:
    """An engine cache, its publisher, an index and a subscriber, wired together."""

    def __init__(self, pub: TestPublisher, sub: KVEventSubscriber, index: ExactIndex) -> None:
        self.pub, self.sub, self.index = pub, sub, index
        self.engine = EngineCache(BS)
        self.rng = random.Random(7)

    async def serve(self, tokens: list[int], *, drop: bool = False, lora: str | None = None) -> int:
        event = self.engine.serve(tokens, lora)
        assert event is not None
        return await self.pub.publish([stored_event(event)], drop=drop)

    async def evict(self, n: int, *, drop: bool = False) -> int:
        return await self.pub.publish([BlockRemoved(tuple(self.engine.evict(n)), "GPU")], drop=drop)

    def doc(self, n_blocks: int) -> list[int]:
        return [self.rng.randrange(100_000) for _ in range(n_blocks * BS)]

    async def synced(self) -> None:
        await until(lambda: self.sub.stats.last_seq == self.pub.seq - 1)

    def agrees(self) -> bool:
        return self.index.blocks_of(POD) == set(self.engine.cached)


@contextlib.asynccontextmanager
async def rig(
    ctx: zmq.asyncio.Context, pub: TestPublisher, settings: SubscriberSettings = SETTINGS
) -> AsyncIterator[Rig]:
    index = ExactIndex(block_size=BS)
    sub = KVEventSubscriber(
        pod=POD,
        endpoint=pub.endpoint,
        replay_endpoint=pub.replay_endpoint,
        index=index,
        context=ctx,
        settings=settings,
    )
    sub.start()
    try:
        await pub.wait_subscribed()
        yield Rig(pub, sub, index)
    finally:
        await sub.stop()


@pytest.mark.parametrize("encoding", list(EventEncoding))
async def test_both_encodings_store_remove_clear(
    ctx: zmq.asyncio.Context, encoding: EventEncoding
) -> None:
    async with TestPublisher(ctx, encoding=encoding) as pub, rig(ctx, pub) as r:
        doc = r.doc(6)
        await r.serve(doc)
        await r.serve(doc[: 3 * BS] + r.doc(2))  # shares 3 blocks: the event has a parent
        await r.evict(2)
        await r.synced()
        assert r.agrees() and r.sub.stats.stored_blocks == 8 and r.sub.stats.removed_blocks == 2
        assert r.index.longest_prefix(block_hashes(doc, BS)) == {
            POD: r.engine.cached_prefix_blocks(doc)
        }
        await pub.publish([AllBlocksCleared()])
        r.engine.cached.clear()
        await r.synced()
        assert r.index.blocks_of(POD) == set() and r.sub.stats.cleared == 1
        assert r.sub.stats.gaps == 0 and r.sub.stats.resets == 0


@pytest.mark.parametrize("legacy_replay", [False, True], ids=["current", "legacy-2-frame"])
async def test_gap_is_repaired_by_replay(ctx: zmq.asyncio.Context, legacy_replay: bool) -> None:
    async with TestPublisher(ctx, legacy_replay=legacy_replay) as pub, rig(ctx, pub) as r:
        doc = r.doc(4)
        await r.serve(doc)
        await r.serve(doc + r.doc(2), drop=True)  # lost on the wire, kept in the buffer
        await r.evict(1, drop=True)
        await r.serve(r.doc(3))
        await r.synced()
        assert pub.replay_requests == [1]
        assert r.agrees()
        st = r.sub.stats
        assert (st.gaps, st.replays, st.replay_failures, st.resets, st.orphans) == (
            1,
            1,
            0,
            0,
            0,
        )


async def test_gap_beyond_the_replay_buffer_drops_and_rebuilds(ctx: zmq.asyncio.Context) -> None:
    async with TestPublisher(ctx, buffer_steps=2) as pub, rig(ctx, pub) as r:
        first = r.doc(3)
        await r.serve(first)
        await r.synced()
        for _ in range(4):  # more lost batches than the buffer holds
            await r.serve(r.doc(2), drop=True)
        fresh = r.doc(2)
        await r.serve(fresh)
        await r.synced()
        st = r.sub.stats
        assert (st.gaps, st.replays, st.resets, st.replay_failures) == (1, 1, 1, 1)
        # Rebuilt from what the buffer and live stream still carried: the old doc is gone.
        assert r.index.longest_prefix(block_hashes(first, BS)) == {}
        assert r.index.longest_prefix(block_hashes(fresh, BS)) == {POD: 2}
        assert r.index.blocks_of(POD) <= set(r.engine.cached)


@pytest.mark.parametrize("mode", ["no-replay-endpoint", "replay-times-out"])
async def test_unrepairable_gap_resets_the_pod(ctx: zmq.asyncio.Context, mode: str) -> None:
    async with TestPublisher(ctx, replay=mode != "no-replay-endpoint") as pub:
        pub.replay_silent = True
        async with rig(ctx, pub, SHORT_REPLAY) as r:
            first = r.doc(2)
            await r.serve(first)
            await r.synced()
            await r.serve(r.doc(2), drop=True)
            after = r.doc(1)
            await r.serve(after)
            await r.synced()
            assert r.sub.stats.resets == 1 and r.sub.stats.replay_failures == 1
            assert r.index.longest_prefix(block_hashes(first, BS)) == {}
            assert r.index.longest_prefix(block_hashes(after, BS)) == {POD: 1}


async def test_publisher_restart_clears_the_pod(ctx: zmq.asyncio.Context) -> None:
    async with TestPublisher(ctx) as pub, rig(ctx, pub) as r:
        before = r.doc(3)
        for _ in range(3):
            await r.serve(before + r.doc(1))
        await r.synced()
        pub.restart()
        r.engine.cached.clear()
        after = r.doc(2)
        await r.serve(after)
        await until(lambda: r.sub.stats.restarts == 1)
        await r.synced()
        assert r.agrees()
        assert r.index.longest_prefix(block_hashes(before, BS)) == {}
        assert r.index.longest_prefix(block_hashes(after, BS)) == {POD: 2}


async def test_joining_mid_stream_replays_from_zero(ctx: zmq.asyncio.Context) -> None:
    async with TestPublisher(ctx) as pub, rig(ctx, pub) as r:
        # The subscriber is connected, but pretend the first batches went out before it was.
        await r.serve(r.doc(3), drop=True)
        await r.serve(r.doc(2), drop=True)
        await r.serve(r.doc(1))
        await r.synced()
        assert pub.replay_requests == [0]
        assert r.agrees() and r.sub.stats.resets == 0 and r.sub.stats.gaps == 0


async def test_a_join_replay_waits_for_a_slow_engine_a_gap_replay_does_not(
    ctx: zmq.asyncio.Context,
) -> None:
    # A restarted process learns the cache its peers saw built from the join replay: a busy
    # engine answering it later than replay_timeout_s must not leave it knowing nothing older
    # than its first live batch. A gap repair still gives up at replay_timeout_s (0.3 s here).
    async with TestPublisher(ctx) as pub, rig(ctx, pub, SHORT_REPLAY) as r:
        pub.replay_delay_s = 0.6
        await r.serve(r.doc(3), drop=True)  # before this process was there
        await r.serve(r.doc(1))
        await r.synced()
        assert pub.replay_requests == [0]
        assert r.agrees() and r.sub.stats.resets == 0 and r.sub.stats.replay_failures == 0
        await r.serve(r.doc(2), drop=True)  # lost on the live socket
        await r.serve(r.doc(1))
        await until(lambda: r.sub.stats.replay_failures == 1)
        assert pub.replay_requests[-1] > 0


async def test_malformed_messages_are_counted_and_skipped(ctx: zmq.asyncio.Context) -> None:
    async with TestPublisher(ctx) as pub, rig(ctx, pub) as r:
        await r.serve(r.doc(2))
        await pub.send_raw([b"kv@test", pub.seq.to_bytes(8, "big"), b"\xc1 not msgpack"])
        pub.seq += 1
        await pub.send_raw([b"only one frame"])
        await r.serve(r.doc(2))
        await r.synced()
        st = r.sub.stats
        assert st.decode_errors == 2 and st.gaps == 0 and st.resets == 0
        assert r.agrees()


async def test_other_tiers_and_groups_are_not_indexed(ctx: zmq.asyncio.Context) -> None:
    from array import array

    async with TestPublisher(ctx) as pub, rig(ctx, pub) as r:
        toks = array("I", range(16))
        await pub.publish(
            [
                BlockStored((1,), None, toks, BS, None, "CPU", None),
                BlockStored((2,), None, toks, BS, None, "GPU", None, None, 1),
                BlockStored((3,), None, toks, BS, None, "GPU", None, None, 0),
            ]
        )
        await r.synced()
        assert r.index.blocks_of(POD) == {3} and r.sub.stats.skipped_events == 2


@contextlib.asynccontextmanager
async def clocked(
    ctx: zmq.asyncio.Context, pub: TestPublisher, now: list[float], *, replay: bool = True
) -> AsyncIterator[KVEventSubscriber]:
    """A subscriber on `pub` whose clock is `now[0]`, stall_after_s = 10."""
    sub = KVEventSubscriber(
        pod=POD,
        endpoint=pub.endpoint,
        replay_endpoint=pub.replay_endpoint if replay else None,
        index=ExactIndex(block_size=BS),
        context=ctx,
        settings=SubscriberSettings(replay_timeout_s=0.5, stall_after_s=10.0),
        clock=lambda: now[0],
    )
    sub.start()
    try:
        await pub.wait_subscribed()
        yield sub
    finally:
        await sub.stop()
    assert not sub.healthy()  # a stopped subscriber is never healthy


async def test_health_without_a_replay_socket_follows_owed_events(
    ctx: zmq.asyncio.Context,
) -> None:
    now = [100.0]
    async with TestPublisher(ctx, replay=False) as pub, clocked(ctx, pub, now, replay=False) as sub:
        assert not sub.healthy()  # nothing heard yet, and nothing to ask
        await pub.publish([AllBlocksCleared()])
        await until(lambda: sub.stats.batches == 1)
        assert sub.healthy()
        now[0] = 200.0  # idle for 100 s without traffic: still healthy
        assert sub.healthy()
        sub.note_traffic(200.0)  # the first request after the idle spell is not a stall
        assert sub.healthy()
        now[0] = 209.0
        sub.note_traffic(209.0)
        assert sub.healthy()
        now[0] = 211.0  # 11 s since a request that should have produced events
        assert not sub.healthy()
        await pub.publish([AllBlocksCleared()])
        await until(lambda: sub.stats.batches == 2)
        assert sub.healthy()


async def test_a_silent_idle_engine_is_healthy(ctx: zmq.asyncio.Context) -> None:
    """Prompts shorter than a block make the engine publish nothing; the replay socket
    shows nothing was missed, so the stream stays up (issue 27: it went down)."""
    now = [100.0]
    async with TestPublisher(ctx) as pub, clocked(ctx, pub, now) as sub:
        # A fresh engine that has published nothing: the probe's empty answer is enough.
        assert not sub.healthy()
        await until(lambda: sub.stats.last_probe == "idle")
        assert sub.healthy()
        await pub.publish([AllBlocksCleared()])
        await until(lambda: sub.stats.batches == 1)
        for _ in range(3):  # 30 s of traffic that produces no events
            sub.note_traffic(now[0])
            now[0] += 10.5
            probes = sub.stats.probes
            assert sub.healthy()  # overdue: asks, and keeps its standing meanwhile
            await until(lambda: sub.stats.probes > probes and sub.stats.last_probe == "idle")  # noqa: B023
            assert sub.healthy()
        assert pub.replay_requests == [0, 1, 1, 1]
        assert sub.stats.replays == 0 and sub.stats.gaps == 0  # probes are not repairs


@pytest.mark.parametrize("fault", ["live-socket-loses-batches", "replay-silent"])
async def test_owed_events_and_a_bad_probe_mean_down(ctx: zmq.asyncio.Context, fault: str) -> None:
    now = [100.0]
    async with TestPublisher(ctx) as pub, clocked(ctx, pub, now) as sub:
        await pub.publish([AllBlocksCleared()])
        await until(lambda: sub.stats.batches == 1)
        sub.note_traffic(now[0])
        if fault == "replay-silent":
            pub.replay_silent = True
        else:
            await pub.publish(
                [BlockStored((7,), None, list(range(BS)), BS, None, "GPU", None)], drop=True
            )
        now[0] += 11.0
        assert sub.healthy()  # the probe is under way
        want = "failed" if fault == "replay-silent" else "behind"
        await until(lambda: sub.stats.last_probe == want)
        assert not sub.healthy()
        if want == "behind":
            assert sub.index.blocks_of(POD) == {7}  # what the probe found is applied
        pub.replay_silent = False
        await pub.publish([AllBlocksCleared()])  # the live stream speaks again
        await until(lambda: sub.healthy())


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


async def test_manager_follows_endpoints_and_exports_metrics(ctx: zmq.asyncio.Context) -> None:
    registry = CollectorRegistry()
    index = ExactIndex(block_size=BS)
    manager = KVEventManager(
        indexes={"m": index}, settings=SETTINGS, context=ctx, registry=registry
    )
    async with (
        TestPublisher(ctx) as pub_a,
        TestPublisher(ctx, encoding=EventEncoding.ARRAY) as pub_b,
    ):
        a, b = "10.0.0.1:8000", "10.0.0.2:8000"
        eps = [
            Endpoint(
                a, "m", kv_events_endpoint=pub_a.endpoint, kv_replay_endpoint=pub_a.replay_endpoint
            ),
            Endpoint(
                b, "m", kv_events_endpoint=pub_b.endpoint, kv_replay_endpoint=pub_b.replay_endpoint
            ),
            Endpoint("10.0.0.3:8000", "m"),  # publishes no events
            Endpoint("10.0.0.4:8000", "other", kv_events_endpoint="tcp://127.0.0.1:1"),  # no index
        ]
        try:
            await manager.set_endpoints(eps)
            assert sorted(manager.stats()) == [a, b]
            await pub_a.wait_subscribed()
            await pub_b.wait_subscribed()
            eng_a, eng_b = EngineCache(BS), EngineCache(BS)
            doc = list(range(1, 1 + 4 * BS))
            ev_a = eng_a.serve(doc)
            ev_b = eng_b.serve(doc[: 2 * BS])
            assert ev_a and ev_b
            await pub_a.publish([stored_event(ev_a)])
            await pub_a.publish([stored_event(ev_a)], drop=True)  # a gap, repaired by replay
            await pub_a.publish([BlockRemoved((ev_a.engine_hashes[-1],), "GPU")])
            await pub_b.publish([stored_event(ev_b)])
            await until(
                lambda: manager.stats()[a].last_seq == 2 and manager.stats()[b].last_seq == 0
            )
            assert index.longest_prefix(block_hashes(doc, BS)) == {a: 3, b: 2}
            assert manager.is_healthy(a) and not manager.is_healthy("10.0.0.3:8000")
            assert sample(registry, "extproc_kv_events_total", pod=a, kind="stored_blocks") == 8
            assert sample(registry, "extproc_kv_events_total", pod=a, kind="removed_blocks") == 1
            assert sample(registry, "extproc_kv_events_gaps_total", pod=a) == 1
            assert (
                sample(registry, "extproc_kv_events_replays_total", pod=a, outcome="complete") == 1
            )
            assert sample(registry, "extproc_kv_index_pod_blocks", pod=a) == 3
            assert sample(registry, "extproc_kv_events_healthy", pod=a) == 1
            lag = sample(registry, "extproc_kv_events_lag_seconds", pod=b)
            assert lag is not None and 0 <= lag < 60
            # Pod b leaves the endpoint set: its subscriber stops and its entries go.
            await manager.set_endpoints(eps[:1])
            assert list(manager.stats()) == [a]
            assert index.longest_prefix(block_hashes(doc, BS)) == {a: 3}
            assert index.pods() == [a]
            assert sample(registry, "extproc_kv_index_pod_blocks", pod=b) is None
            # A changed publisher address restarts the pod's subscriber from scratch.
            moved = Endpoint(a, "m", kv_events_endpoint=pub_b.endpoint)
            await manager.set_endpoints([moved])
            assert index.pods() == [] and not manager.is_healthy(a)
        finally:
            await manager.close()
        assert manager.stats() == {}


class TickRecordingIndex(ExactIndex):
    """Notes, for every stored block, how many times the event loop ran another task."""

    def __init__(self, ticks: list[int]) -> None:
        super().__init__(block_size=BS)
        self.ticks = ticks
        self.blocks_per_tick: dict[int, int] = {}

    def stored(self, pod: str, engine_hashes: Any, *args: Any, **kwargs: Any) -> StoreResult:
        tick = self.ticks[0]
        self.blocks_per_tick[tick] = self.blocks_per_tick.get(tick, 0) + len(engine_hashes)
        return super().stored(pod, engine_hashes, *args, **kwargs)


async def test_a_burst_of_events_yields_to_the_event_loop(ctx: zmq.asyncio.Context) -> None:
    ticks = [0]

    async def ticker() -> None:
        while True:
            ticks[0] += 1
            await asyncio.sleep(0)

    settings = SubscriberSettings(replay_timeout_s=3.0, max_blocks_per_wake=64)
    async with TestPublisher(ctx) as pub:
        index = TickRecordingIndex(ticks)
        sub = KVEventSubscriber(
            pod=POD,
            endpoint=pub.endpoint,
            replay_endpoint=pub.replay_endpoint,
            index=index,
            context=ctx,
            settings=settings,
        )
        sub.start()
        tick_task = asyncio.create_task(ticker())
        try:
            await pub.wait_subscribed()
            engine = EngineCache(BS)
            rng = random.Random(3)
            events = []
            for _ in range(100):
                ev = engine.serve([rng.randrange(100_000) for _ in range(8 * BS)])
                assert ev is not None
                events.append(stored_event(ev))
            # 100 live batches of 8 blocks sent without yielding, so they queue up at the SUB.
            for event in events:
                await pub.publish([event])
            await until(lambda: sub.stats.last_seq == 99)
            assert sub.stats.stored_blocks == 800
            # Never more than one budget (plus the batch that crossed it) without a yield.
            assert max(index.blocks_per_tick.values()) <= 64 + 8
        finally:
            tick_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await tick_task
            await sub.stop()


async def test_metrics_survive_a_manager_replacement(ctx: zmq.asyncio.Context) -> None:
    registry = CollectorRegistry()
    metrics = KVEventMetrics(registry)
    with pytest.raises(ValueError):
        KVEventMetrics(registry)  # a registry takes each name once: reloads must reuse them
    index = ExactIndex(block_size=BS)
    async with TestPublisher(ctx) as pub:
        ep = Endpoint(
            POD, "m", kv_events_endpoint=pub.endpoint, kv_replay_endpoint=pub.replay_endpoint
        )
        for _ in range(2):
            manager = KVEventManager(
                indexes={"m": index}, settings=SETTINGS, context=ctx, metrics=metrics
            )
            try:
                await manager.set_endpoints([ep])
                await pub.wait_subscribed()
                await pub.publish([AllBlocksCleared()])

                def got_batch(m: KVEventManager = manager) -> bool:
                    return m.stats()[POD].batches == 1

                await until(got_batch)
                assert sample(registry, "extproc_kv_event_batches_total", pod=POD) == 1
            finally:
                await manager.close()
            assert sample(registry, "extproc_kv_event_batches_total", pod=POD) is None
            pub.restart()
