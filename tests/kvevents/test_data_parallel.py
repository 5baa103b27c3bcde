"""A data-parallel vLLM server (`--data-parallel-size N`): rank r publishes on the events and
replay ports + r. The router subscribes to every rank over real ZMQ and keeps one index entry
per pod, which holds a block while any rank does."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from extproc.kvcache import ExactIndex, block_hashes
from extproc.kvevents import BlockRemoved, KVEventManager
from extproc.kvevents.subscriber import rank_endpoint
from extproc.types import Endpoint
from tests.kvcache._engine import EngineCache

from ._publisher import TestPublisher
from .test_subscriber import BS, SETTINGS, sample, stored_event, until

POD = "10.0.0.9:8000"


def free_run(n: int) -> int:
    """A port p such that p..p+n-1 are free."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n >= 65535:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as t:
                try:
                    t.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port run")


@pytest.fixture
async def ctx(no_leaked_tasks: None) -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


def test_rank_ports() -> None:
    assert rank_endpoint("tcp://10.0.0.1:5557", 0) == "tcp://10.0.0.1:5557"
    assert rank_endpoint("tcp://10.0.0.1:5557", 3) == "tcp://10.0.0.1:5560"
    assert rank_endpoint("tcp://[fd00::1]:5557", 1) == "tcp://[fd00::1]:5558"
    assert rank_endpoint(None, 2) is None
    with pytest.raises(ValueError, match="port"):
        rank_endpoint("ipc:///tmp/kv", 1)


async def test_every_rank_feeds_the_pods_one_entry(ctx: zmq.asyncio.Context) -> None:
    pub_base, replay_base = free_run(2), free_run(2)
    registry = CollectorRegistry()
    index = ExactIndex(block_size=BS)
    manager = KVEventManager(
        indexes={"m": index}, settings=SETTINGS, context=ctx, registry=registry
    )
    async with (
        TestPublisher(ctx, pub_port=pub_base, replay_port=replay_base) as rank0,
        TestPublisher(ctx, pub_port=pub_base + 1, replay_port=replay_base + 1) as rank1,
    ):
        ep = Endpoint(
            POD, "m", kv_events_endpoint=f"tcp://127.0.0.1:{pub_base}",
            kv_replay_endpoint=f"tcp://127.0.0.1:{replay_base}", data_parallel_size=2,
        )  # fmt: skip
        try:
            await manager.set_endpoints([ep])
            assert sorted(manager.stats()) == [POD, f"{POD}/dp1"]
            await rank0.wait_subscribed()
            await rank1.wait_subscribed()
            e0, e1 = EngineCache(BS), EngineCache(BS)
            shared = list(range(1, 1 + 2 * BS))
            only1 = [*shared, *range(500, 500 + 2 * BS)]
            ev0 = e0.serve(shared)
            ev1 = e1.serve(only1)  # the same first two blocks (same hashes), then two more
            assert ev0 is not None and ev1 is not None
            await rank0.publish([stored_event(ev0)])
            await rank1.publish([stored_event(ev1)])
            await rank1.publish([stored_event(ev1)], drop=True)  # a gap on rank 1 only
            await rank1.publish([BlockRemoved((ev1.engine_hashes[-1],), "GPU")])
            stats = manager.stats
            await until(lambda: stats()[POD].last_seq == 0 and stats()[f"{POD}/dp1"].last_seq == 2)
            # One entry for the pod (no `/dp1` pod the router could pick), holding the union.
            assert index.pods() == [POD]
            assert index.longest_prefix(block_hashes(only1, BS)) == {POD: 3}
            assert sample(registry, "extproc_kv_events_replays_total", pod=f"{POD}/dp1",
                          outcome="complete") == 1  # fmt: skip
            assert manager.is_healthy(POD) and manager.is_healthy(f"{POD}/dp1")
            # Rank 0 evicts the shared blocks: rank 1 still holds them, so the pod does.
            await rank0.publish([BlockRemoved(tuple(ev0.engine_hashes), "GPU")])
            await until(lambda: stats()[POD].last_seq == 1)
            assert index.longest_prefix(block_hashes(only1, BS)) == {POD: 3}
            # Rank 1 evicts them too: now no rank holds anything.
            await rank1.publish([BlockRemoved(tuple(ev1.engine_hashes[:3]), "GPU")])
            await until(lambda: stats()[f"{POD}/dp1"].last_seq == 3)
            assert index.longest_prefix(block_hashes(only1, BS)) == {}
            # The pod leaves: every rank's subscriber stops, its series go.
            await manager.set_endpoints([])
            assert manager.stats() == {} and index.pods() == []
            assert sample(registry, "extproc_kv_events_healthy", pod=f"{POD}/dp1") is None
        finally:
            await manager.close()


async def test_a_rank_reset_keeps_the_other_ranks_blocks(ctx: zmq.asyncio.Context) -> None:
    pub_base = free_run(2)
    index = ExactIndex(block_size=BS)
    manager = KVEventManager(indexes={"m": index}, settings=SETTINGS, context=ctx)
    async with (
        TestPublisher(ctx, pub_port=pub_base, replay=False) as rank0,
        TestPublisher(ctx, pub_port=pub_base + 1, replay=False) as rank1,
    ):
        ep = Endpoint(
            POD, "m", kv_events_endpoint=f"tcp://127.0.0.1:{pub_base}", data_parallel_size=2
        )
        try:
            await manager.set_endpoints([ep])
            await rank0.wait_subscribed()
            await rank1.wait_subscribed()
            e0, e1 = EngineCache(BS), EngineCache(BS)
            a = list(range(1, 1 + 2 * BS))
            b = list(range(900, 900 + 2 * BS))
            ev_a, ev_b = e0.serve(a), e1.serve(b)
            assert ev_a is not None and ev_b is not None
            await rank0.publish([stored_event(ev_a)])
            await rank1.publish([stored_event(ev_b)])
            await until(lambda: index.pod_block_count(POD) == 4)
            # Rank 1 loses batches and cannot replay: it resets its own share only.
            await rank1.publish([stored_event(ev_b)], drop=True)
            await rank1.publish([stored_event(ev_b)])
            await until(lambda: manager.stats()[f"{POD}/dp1"].resets >= 1)
            assert index.longest_prefix(block_hashes(a, BS)) == {POD: 2}
        finally:
            await manager.close()
