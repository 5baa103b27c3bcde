"""KV-event ingestion and prefix-index benchmark.

Measures, on one core (CPU time of this process, not wall time):
  * ingestion: decode + apply of pre-encoded vLLM KV-event messages (both encodings), in
    block events per CPU second (stored + removed blocks), directly and through a real
    ZMQ PUB -> KVEventSubscriber on 127.0.0.1;
  * index memory per million blocks (tracemalloc), against `stats().bytes_estimate`;
  * router block hashing of 2k/8k/32k-token prompts, and one longest-prefix lookup.

Run: .venv/bin/python bench/kvevents_bench.py [--blocks 1000000] [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import time
import tracemalloc
from array import array
from collections import deque
from collections.abc import Callable
from itertools import islice
from typing import Any

import zmq
import zmq.asyncio

from extproc.kvcache import ExactIndex, block_hashes
from extproc.kvevents import (
    BlockRemoved,
    BlockStored,
    EventEncoding,
    KVEvent,
    KVEventSubscriber,
    SubscriberSettings,
    decode_message,
    encode_message,
    encode_payload,
)
from extproc.kvevents.subscriber import SubscriberStats, apply_events

BS = 16
POD = "10.0.0.1:8000"


def make_stream(
    n_batches: int, rng: random.Random, capacity: int, encoding: EventEncoding
) -> tuple[list[list[bytes]], int]:
    """Encoded messages of an engine serving multi-turn sessions with an LRU cache.

    Each batch stores 1-32 new blocks chained onto a random earlier block (or a new root)
    and, once the cache is full, removes as many of the oldest blocks. Returns the
    messages and the number of block events in them.
    """
    cached: dict[int, None] = {}
    recent: deque[int] = deque(maxlen=256)
    next_hash = 1
    messages: list[list[bytes]] = []
    block_events = 0
    for seq in range(n_batches):
        n_new = rng.randint(1, 32)
        parent: int | None = None
        if recent and rng.random() < 0.8:
            parent = rng.choice(recent)  # recent blocks: sessions continue
            if parent not in cached:
                parent = None
        hashes = tuple(range(next_hash, next_hash + n_new))
        next_hash += n_new
        tokens = array("I", (rng.randrange(150_000) for _ in range(n_new * BS)))
        events: list[KVEvent] = [BlockStored(hashes, parent, tokens, BS, None, "GPU", None)]
        for h in hashes:
            cached[h] = None
        recent.extend(hashes)
        block_events += n_new
        excess = len(cached) - capacity
        if excess > 0:
            victims = list(islice(cached, excess))
            for h in victims:
                del cached[h]
            events.append(BlockRemoved(tuple(victims), "GPU"))
            block_events += excess
        messages.append(
            encode_message(b"kv", seq, encode_payload(time.time(), events, 0, encoding))
        )
    return messages, block_events


def bench_ingestion_direct(messages: list[list[bytes]], block_events: int) -> dict[str, float]:
    index = ExactIndex(block_size=BS)
    gc.collect()
    t0 = time.process_time()
    for frames in messages:
        apply_events(index, POD, decode_message(frames).events)
    cpu = time.process_time() - t0
    stats = index.stats()
    return {
        "block_events": block_events,
        "cpu_s": round(cpu, 3),
        "block_events_per_cpu_s": round(block_events / cpu),
        "orphans": stats.orphans,
        "final_blocks": stats.entries,
    }


async def _ingest_over_zmq(messages: list[list[bytes]]) -> tuple[float, SubscriberStats]:
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # never drop: we measure ingestion, not the HWM
    pub.bind("tcp://127.0.0.1:*")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    index = ExactIndex(block_size=BS)
    sub = KVEventSubscriber(
        pod=POD,
        endpoint=endpoint,
        replay_endpoint=None,
        index=index,
        context=ctx,
        settings=SubscriberSettings(rcvhwm=0),
    )
    sub.start()
    await pub.recv()  # subscription arrived
    t0 = time.process_time()
    for frames in messages:
        await pub.send_multipart(frames)
    while sub.stats.last_seq != len(messages) - 1:  # noqa: ASYNC110 - polling the subscriber's counters
        await asyncio.sleep(0.001)
    cpu = time.process_time() - t0
    stats = sub.stats
    await sub.stop()
    pub.close(linger=0)
    ctx.term()
    return cpu, stats


def bench_ingestion_zmq(messages: list[list[bytes]], block_events: int) -> dict[str, float]:
    # The publisher runs in this process too, so the rate includes its sending cost:
    # a lower bound on what the subscriber alone sustains.
    cpu, stats = asyncio.run(_ingest_over_zmq(messages))
    return {
        "cpu_s_incl_publisher": round(cpu, 3),
        "block_events_per_cpu_s": round(block_events / cpu),
        "decode_errors": stats.decode_errors,
        "gaps": stats.gaps,
    }


def bench_memory(n_blocks: int, pods: int, shared: bool) -> dict[str, float]:
    """Bytes per (pod, block) entry after storing `n_blocks` per pod."""
    rng = random.Random(3)
    per_event = 32
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = ExactIndex(block_size=BS, max_blocks=2 * n_blocks * pods)
    tokens = array("I", (rng.randrange(150_000) for _ in range(per_event * BS)))
    for p in range(pods):
        pod = f"10.0.0.{p}:8000"
        for start in range(0, n_blocks, per_event):
            # Distinct content per event (a different first token) unless pods share blocks.
            tokens[0] = start if shared else start * pods + p
            hashes = range(start + 1, start + 1 + per_event)
            index.stored(pod, hashes, None, tokens)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    stats = index.stats()
    return {
        "pods": pods,
        "entries": stats.entries,
        "distinct_blocks": stats.blocks,
        "traced_bytes": used,
        "bytes_per_entry": round(used / stats.entries, 1),
        "bytes_per_million_entries_mb": round(used / stats.entries * 1e6 / 2**20, 1),
        "estimate_bytes": stats.bytes_estimate,
    }


def _cpu_per_call(fn: Callable[[], Any], repeat: int) -> float:
    fn()
    t0 = time.process_time()
    for _ in range(repeat):
        fn()
    return (time.process_time() - t0) / repeat


def bench_hashing() -> dict[str, float]:
    rng = random.Random(5)
    out: dict[str, float] = {}
    for n in (2048, 8192, 32768):
        tokens = [rng.randrange(150_000) for _ in range(n)]

        def run(t: list[int] = tokens) -> object:
            return block_hashes(t, BS)

        out[f"hash_{n}_tokens_us"] = round(_cpu_per_call(run, 200) * 1e6, 1)
    return out


def bench_lookup() -> dict[str, float]:
    rng = random.Random(6)
    index = ExactIndex(block_size=BS)
    doc = [rng.randrange(150_000) for _ in range(8192)]
    hashes = block_hashes(doc, BS)
    for p in range(8):  # pod p holds the first p/8 of the document, plus unrelated blocks
        keep = len(hashes) * p // 8
        if keep:
            index.stored(f"pod{p}", range(1, keep + 1), None, doc[: keep * BS])
        index.stored(f"pod{p}", range(10_000, 10_064), None, [p] * (64 * BS))
    found = index.longest_prefix(hashes)
    assert found == {f"pod{p}": len(hashes) * p // 8 for p in range(1, 8)}, found
    return {
        "lookup_8k_tokens_8_pods_us": round(
            _cpu_per_call(lambda: index.longest_prefix(hashes), 2000) * 1e6, 1
        )
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--blocks", type=int, default=1_000_000, help="blocks for the memory test")
    parser.add_argument("--out", help="write the JSON results here too")
    args = parser.parse_args()
    rng = random.Random(1)
    results: dict[str, Any] = {"block_size": BS}
    for encoding in EventEncoding:
        messages, block_events = make_stream(args.batches, rng, capacity=50_000, encoding=encoding)
        results[f"ingest_direct_{encoding}"] = bench_ingestion_direct(messages, block_events)
        results[f"ingest_zmq_{encoding}"] = bench_ingestion_zmq(messages, block_events)
    results["memory_1_pod"] = bench_memory(args.blocks, 1, shared=False)
    results["memory_4_pods_shared"] = bench_memory(args.blocks // 4, 4, shared=True)
    results.update(bench_hashing())
    results.update(bench_lookup())
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
