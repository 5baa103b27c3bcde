"""KV-event ingestion cost per request: the simulator's real event stream through the real path.

The stream is what one simulator publishes while serving `bench.hop`'s workload (2k-token
single-turn prompts, 8 output tokens, a cache of `--gpu-blocks` blocks that fills and then
evicts): the simulator's own engine (`extproc.sim.engine.Engine`, zero step time) makes the
events and its own encoder (`extproc.sim.kvevents.encode_batch`) the bytes, in vLLM 0.33's
map form or the legacy array form.

Two measurements, CPU time of this process (all threads), per request and per block event:

* `direct`: `decode_message` + `apply_events` of every message in a loop (no sockets, no
  event loop);
* `zmq`: a publisher in a child process sends the messages over a real ZMQ PUB to a
  `KVEventSubscriber` on this process's uvloop, either `--pace-ms` apart (every message wakes
  the loop alone, as at one connection: `zmq-paced`) or all at once (`zmq-burst`, as at
  saturation).

It imports `extproc` from PYTHONPATH, so the same command measures another checkout:

    PYTHONPATH=$PWD .venv/bin/python -m bench.kvingest --reps 3
    PYTHONPATH=/tmp/kv-old .venv/bin/python bench/kvingest.py --reps 3   # the tree before
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

import extproc
from extproc.gctune import tune_gc
from extproc.kvcache import ExactIndex
from extproc.kvevents import (
    KVEventMetrics,
    KVEventSubscriber,
    SubscriberSettings,
    apply_events,
    decode_message,
)
from extproc.sim.config import EventEncoding, SimConfig, StepTimeModel
from extproc.sim.engine import Engine, Finished
from extproc.sim.kvevents import encode_batch

POD = "10.0.0.1:8000"
TOPIC = b"kv@bench"


async def _simulate(
    requests: int, prompt_tokens: int, gpu_blocks: int, encoding: EventEncoding, seed: int
) -> list[bytes]:
    """Payloads of every step the engine published while serving `requests` one at a time."""
    payloads: list[bytes] = []
    config = SimConfig(
        tokenizer_dir=Path("."),
        num_gpu_blocks=gpu_blocks,
        step=StepTimeModel(time_scale=0.0),
        kv_events_encoding=encoding,
    )

    def sink(events: list[Any]) -> None:
        payloads.append(encode_batch(events, ts=time.time(), encoding=encoding))

    engine = Engine(config, event_sink=sink)
    engine.start()
    rng = random.Random(seed)
    vocab = list(range(1000, 2000))
    try:
        for _ in range(requests):
            prompt = [rng.randrange(150_000) for _ in range(prompt_tokens)]
            req = engine.new_request(prompt, output_vocab=vocab, max_tokens=8, ignore_eos=True)
            await engine.submit(req)
            while not isinstance(await req.queue.get(), Finished):
                pass
    finally:
        await engine.stop()
    return payloads


def make_stream(
    requests: int, prompt_tokens: int, gpu_blocks: int, encoding: EventEncoding, seed: int = 1
) -> list[list[bytes]]:
    payloads = asyncio.run(_simulate(requests, prompt_tokens, gpu_blocks, encoding, seed))
    return [[TOPIC, seq.to_bytes(8, "big"), p] for seq, p in enumerate(payloads)]


def _block_events(messages: Sequence[list[bytes]]) -> tuple[int, int]:
    """(stored blocks, removed blocks) in the stream, counted by a fresh subscriber's stats."""
    import msgpack

    stored = removed = 0
    for frames in messages:
        for event in msgpack.unpackb(frames[2], strict_map_key=False)[1]:
            tag = event["type"] if isinstance(event, dict) else event[0]
            hashes = event["block_hashes"] if isinstance(event, dict) else event[1]
            if tag == "BlockStored":
                stored += len(hashes)
            elif tag == "BlockRemoved":
                removed += len(hashes)
    return stored, removed


def bench_direct(messages: Sequence[list[bytes]], gpu_blocks: int) -> float:
    """CPU seconds to decode and apply every message."""
    index = ExactIndex(block_size=16, max_blocks=4 * gpu_blocks)
    tune_gc()  # as the server runs: start-up frozen, young collections every 3,000
    t0 = time.process_time()
    for frames in messages:
        apply_events(index, POD, decode_message(frames).events)
    cpu = time.process_time() - t0
    assert index.pod_block_count(POD) <= gpu_blocks, index.stats()
    return cpu


def _publish(endpoint_file: str, pace_s: float) -> None:
    """Child process: bind a PUB, wait for one subscriber, send the stream (from stdin)."""
    messages: list[list[bytes]] = pickle.load(sys.stdin.buffer)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.setsockopt(zmq.LINGER, 2000)
    pub.bind("tcp://127.0.0.1:*")
    Path(endpoint_file).write_text(pub.getsockopt_string(zmq.LAST_ENDPOINT))
    pub.recv()  # the subscription
    time.sleep(0.2)
    start = time.monotonic()
    for i, frames in enumerate(messages):
        if pace_s:
            delay = start + i * pace_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        pub.send_multipart(frames)
    pub.close()
    ctx.term()


async def _subscribe(
    endpoint: str, last_seq: int, gpu_blocks: int, settings: SubscriberSettings
) -> tuple[float, float]:
    """(process CPU seconds, of which the event loop's thread) from before the first message
    to after the last."""
    ctx = zmq.asyncio.Context()
    index = ExactIndex(block_size=16, max_blocks=4 * gpu_blocks)
    sub = KVEventSubscriber(
        pod=POD,
        endpoint=endpoint,
        replay_endpoint=None,
        index=index,
        context=ctx,
        settings=settings,
        metrics=KVEventMetrics(CollectorRegistry()),  # the server counts every batch
    )
    tune_gc()
    sub.start()
    t0, t0_loop = time.process_time(), time.thread_time()  # before the first message lands
    while sub.stats.last_seq != last_seq:  # noqa: ASYNC110 - polling the subscriber's counters
        await asyncio.sleep(0.25)  # rarely: each wake-up costs CPU here too
    cpu, cpu_loop = time.process_time() - t0, time.thread_time() - t0_loop
    stats = sub.stats
    await sub.stop()
    ctx.term()
    assert stats.decode_errors == 0 and stats.gaps == 0 and stats.resets == 0, stats
    return cpu, cpu_loop


def bench_zmq(
    messages: Sequence[list[bytes]],
    pace_ms: float,
    gpu_blocks: int,
    settings: SubscriberSettings | None = None,
) -> tuple[float, float]:
    import uvloop

    endpoint_file = Path(f"/tmp/kvingest-{os.getpid()}.endpoint")
    endpoint_file.unlink(missing_ok=True)
    child = subprocess.Popen(
        [sys.executable, __file__, "--publisher", str(endpoint_file), "--pace-ms", str(pace_ms)],
        stdin=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert child.stdin is not None
    child.stdin.write(pickle.dumps(list(messages)))
    child.stdin.close()
    while not endpoint_file.exists() or not endpoint_file.read_text():
        time.sleep(0.01)
    endpoint = endpoint_file.read_text()
    endpoint_file.unlink()
    try:
        settings = settings or SubscriberSettings(rcvhwm=0)
        return uvloop.run(_subscribe(endpoint, len(messages) - 1, gpu_blocks, settings))
    finally:
        child.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--gpu-blocks", type=int, default=8192, help="the simulator's cache")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--pace-ms", type=float, default=None, help="zmq only, this pace")
    parser.add_argument("--modes", default="direct,zmq-paced,zmq-burst")
    parser.add_argument(
        "--drain-interval-ms", type=float, help="SubscriberSettings.drain_interval_s (new tree)"
    )
    parser.add_argument("--encodings", default="map,legacy")
    parser.add_argument("--out", help="write the JSON results here too")
    parser.add_argument("--publisher", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.publisher:
        _publish(args.publisher, (args.pace_ms or 0.0) / 1e3)
        return
    results: dict[str, Any] = {
        "extproc": str(Path(extproc.__file__).parent),
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "gpu_blocks": args.gpu_blocks,
    }
    modes = args.modes.split(",")
    paced = 5.0 if args.pace_ms is None else args.pace_ms
    settings = SubscriberSettings(rcvhwm=0)
    if args.drain_interval_ms is not None:
        settings = SubscriberSettings(rcvhwm=0, drain_interval_s=args.drain_interval_ms / 1e3)
        results["drain_interval_ms"] = args.drain_interval_ms
    for name in args.encodings.split(","):
        encoding = EventEncoding(name)
        messages = make_stream(args.requests, args.prompt_tokens, args.gpu_blocks, encoding)
        stored, removed = _block_events(messages)
        row: dict[str, Any] = {
            "messages": len(messages),
            "stored_blocks": stored,
            "removed_blocks": removed,
        }
        for mode in modes:
            cpus, loop_cpus = [], []
            for _ in range(args.reps):
                if mode == "direct":
                    cpu = bench_direct(messages, args.gpu_blocks)
                    cpus.append(cpu)
                    loop_cpus.append(cpu)
                elif mode in ("zmq-paced", "zmq-burst"):
                    pace = paced if mode == "zmq-paced" else 0.0
                    cpu, loop_cpu = bench_zmq(messages, pace, args.gpu_blocks, settings)
                    cpus.append(cpu)
                    loop_cpus.append(loop_cpu)
                else:
                    raise SystemExit(f"unknown mode {mode}")
            cpu, loop_cpu = statistics.median(cpus), statistics.median(loop_cpus)
            row[mode] = {
                "cpu_s": [round(c, 4) for c in cpus],
                "us_per_request": round(cpu / args.requests * 1e6, 1),
                "us_per_request_loop_thread": round(loop_cpu / args.requests * 1e6, 1),
                "us_per_message": round(cpu / len(messages) * 1e6, 1),
                "us_per_block_event": round(cpu / (stored + removed) * 1e6, 3),
            }
        results[name] = row
        print(json.dumps({name: row}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
