"""The simulator's KV-event publisher (extproc.sim) feeding our subscriber, both encodings."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest
import zmq.asyncio

from extproc.kvcache import ExactIndex, block_hashes
from extproc.kvevents import KVEventSubscriber, SubscriberSettings
from extproc.sim.config import EventEncoding as SimEncoding
from extproc.sim.kvevents import BlockRemoved, BlockStored, KVEventPublisher
from tests.kvcache._engine import EngineCache

BS = 16
POD = "127.0.0.1:8000"


@pytest.fixture
async def ctx(no_leaked_tasks: None) -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


@pytest.mark.parametrize("encoding", list(SimEncoding))
async def test_index_tracks_the_simulator_publisher(
    ctx: zmq.asyncio.Context, encoding: SimEncoding
) -> None:
    pub = KVEventPublisher(
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        topic="kv@sim",
        encoding=encoding,
    )
    index = ExactIndex(block_size=BS)
    sub = KVEventSubscriber(
        pod=POD,
        endpoint=pub.endpoint,
        replay_endpoint=pub.replay_endpoint,
        index=index,
        context=ctx,
        settings=SubscriberSettings(replay_timeout_s=3.0),
    )
    engine = EngineCache(BS)
    rng = random.Random(11)
    shared = [rng.randrange(150_000) for _ in range(4 * BS)]
    try:
        sub.start()  # no wait for the subscription: batches lost to the slow joiner get replayed
        for step in range(40):
            tokens = shared + [rng.randrange(150_000) for _ in range(rng.randint(0, 5) * BS)]
            ev = engine.serve(tokens)
            events: list[BlockStored | BlockRemoved] = []
            if ev is not None:
                events.append(
                    BlockStored(
                        tuple(ev.engine_hashes),
                        ev.parent,
                        tuple(ev.token_ids),
                        BS,
                        None,
                        "GPU",
                        None,
                    )
                )
            if len(engine.cached) > 30:
                events.append(BlockRemoved(tuple(engine.evict(len(engine.cached) - 30)), "GPU"))
            if step == 25:
                pub.drop_next(2)  # a gap in the middle, repaired from the replay buffer
            pub.publish(list(events))
            await asyncio.sleep(0.002)
        async with asyncio.timeout(5):
            while sub.stats.last_seq != pub.next_seq - 1:  # noqa: ASYNC110 - polling counters
                await asyncio.sleep(0.005)
        assert index.blocks_of(POD) == set(engine.cached)
        held = engine.cached_prefix_blocks(shared)
        assert index.longest_prefix(block_hashes(shared, BS)) == ({POD: held} if held else {})
        assert sub.stats.resets == 0 and sub.stats.decode_errors == 0
    finally:
        await sub.stop()
        await pub.close()
