"""Latency samples over the sync bus: Envoy sends a worker's access-log records to one process,
so each replica shares what it learnt and every replica's models learn every record, once,
including the records of a bus outage (kept in the outbox until a live peer can get them)."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from prometheus_client import CollectorRegistry

from extproc.accounting import FairnessCounters, InflightTracker
from extproc.accounting.latency_model import DecisionTag, LatencyModels
from extproc.config import SyncConfig
from extproc.routing.predicted import LatencyFeatures
from extproc.sync import MemoryNetwork, StateSync, SyncMetrics, state

SETTINGS = SyncConfig(tick_s=0.005, heartbeat_s=0.02, expire_s=0.2)
POD = "10.0.0.1:8000"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def replica(name: str, net: MemoryNetwork, clock: Clock) -> tuple[StateSync, LatencyModels]:
    models = LatencyModels(min_samples=3)
    sync = StateSync(
        replica=name, bus=net.bus(), inflight=InflightTracker(clock=clock),
        fairness=FairnessCounters(), approx=lambda _model: None,
        on_latency=models.observe_tagged, latency_rows=models.rows,
        on_latency_rows=models.adopt, settings=SETTINGS,
        metrics=SyncMetrics(CollectorRegistry()), clock=clock,
    )  # fmt: skip
    await sync._bus.start(sync.receive)
    return sync, models


async def tick(syncs: list[StateSync], clock: Clock) -> None:
    clock.now += SETTINGS.tick_s
    for s in syncs:
        await s.tick()
    await asyncio.sleep(0.003)


def carried(sync: StateSync, net: MemoryNetwork, key: str) -> list[int]:
    """How many rows under `key` each message the replica last joined to `net` gets."""
    counts: list[int] = []
    receive = sync.receive

    def count(data: bytes) -> None:
        counts.append(len(msgpack.unpackb(data).get(key, ())))
        receive(data)

    net._handlers[-1] = count
    return counts


def tags(n: int) -> list[tuple[str, float]]:
    return [
        (DecisionTag(LatencyFeatures(100 * i, i % 3, 0, 0.0, 1.0, 0.1)).encode(), 0.05 + 0.01 * i)
        for i in range(n)
    ]


async def test_every_replica_learns_every_sample_once() -> None:
    clock, net = Clock(), MemoryNetwork(duplicate=1.0)  # every message delivered twice
    (a, models_a), (b, models_b) = [await replica(n, net, clock) for n in ("r0", "r1")]
    await tick([a, b], clock)  # heartbeats: each knows the other is there
    for tag, ttft in tags(6):  # what r0's access-log stream taught it
        assert models_a.observe_tagged("qwen3", POD, tag, ttft, 0.01)
        a.note_latency("qwen3", POD, tag, ttft, 0.01)
    await tick([a, b], clock)
    assert models_b.state()["models"] == models_a.state()["models"]
    assert models_b.state()["models"]["qwen3"][POD]["ttft"]["samples"] == 6  # not 12
    probe = LatencyFeatures(250, 1, 0, 0.0, 1.0, 0.1)
    pa, pb = models_a.predict("qwen3", POD, probe), models_b.predict("qwen3", POD, probe)
    assert pa is not None and pb is not None
    assert (pa.ttft_s, pa.tpot_s, pa.samples) == (pb.ttft_s, pb.tpot_s, pb.samples)


def samples_of(models: LatencyModels) -> int:
    return sum(m["ttft"]["samples"] for m in models.state()["models"].get("qwen3", {}).values())


async def test_samples_learnt_while_the_bus_was_down_reach_the_peer_after_it() -> None:
    clock, net = Clock(), MemoryNetwork()
    (a, models_a), (b, models_b) = [await replica(n, net, clock) for n in ("r0", "r1")]
    await tick([a, b], clock)
    net.down = True
    for tag, ttft in tags(4):
        a.note_latency("qwen3", POD, tag, ttft, None)
        models_a.observe_tagged("qwen3", POD, tag, ttft, None)
    for _ in range(3):
        await tick([a, b], clock)  # publishes fail: the samples stay in the outbox
    assert samples_of(models_b) == 0
    clock.now += 1.0  # long enough for the peers' shares to expire
    await tick([a, b], clock)
    assert a.peers() == {} == b.peers()
    net.down = False
    await tick([a, b], clock)  # heartbeats: the peers are back (samples wait for them)
    await tick([a, b], clock)
    assert samples_of(models_b) == 4
    assert models_b.state()["models"] == models_a.state()["models"]
    await tick([a, b], clock)
    assert samples_of(models_b) == 4  # once


async def test_samples_wait_for_a_peer_and_the_newest_are_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(state, "MAX_PENDING_SAMPLES", 50)
    monkeypatch.setattr(state, "MAX_SAMPLES_PER_MESSAGE", 8)
    clock, net = Clock(), MemoryNetwork()
    a, _ = await replica("r0", net, clock)
    rows = tags(3)
    for i in range(60):  # more than the outbox keeps: the first 10 go to "old", then dropped
        tag, ttft = rows[i % 3]
        a.note_latency("qwen3", "old:8000" if i < 10 else f"10.0.0.{i % 5}:8000", tag, ttft, None)
    await tick([a], clock)  # alone: nobody to send them to
    b, models_b = await replica("r1", net, clock)
    sent = carried(b, net, "l")
    for _ in range(10):
        await tick([a, b], clock)
    assert max(sent) == 8 and sum(sent) == 50
    assert samples_of(models_b) == 50
    assert "old:8000" not in models_b.state()["models"]["qwen3"]


def test_a_malformed_sample_row_is_dropped() -> None:
    clock, net = Clock(), MemoryNetwork()
    b = StateSync(
        replica="r1", bus=net.bus(), inflight=InflightTracker(clock=clock),
        fairness=FairnessCounters(), approx=lambda _model: None,
        on_latency=(models_b := LatencyModels()).observe_tagged, settings=SETTINGS, clock=clock,
    )  # fmt: skip
    bad = {
        "v": 1,
        "r": "r9",
        "s": 1,
        "t": 0.0,
        "i": [],
        "l": [["qwen3", POD, "nonsense", 0.1, None]],
    }
    b.receive(msgpack.packb(bad))
    assert models_b.ignored == 1 and models_b.state()["models"] == {}


@pytest.mark.parametrize("value", [True, "0.1", None])
async def test_a_sample_value_that_is_not_a_number_teaches_nothing(value: object) -> None:
    sync, models = await replica("r1", MemoryNetwork(), Clock())
    tag = tags(1)[0][0]
    row = ["qwen3", POD, tag, value, value]
    sync.receive(msgpack.packb({"v": 1, "r": "r9", "s": 1, "t": 0.0, "i": [], "l": [row]}))
    assert models.state()["models"] == {} and models.ignored == 1


async def test_a_replica_that_joins_starts_from_its_peers_models_in_parts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(state, "MAX_MODELS_PER_MESSAGE", 2)  # five models: three messages
    pods = [f"10.0.0.{i}:8000" for i in range(1, 6)]
    clock, net = Clock(), MemoryNetwork()
    a, models_a = await replica("r0", net, clock)
    for n, pod in enumerate(pods):
        for tag, ttft in tags(4 + n):
            models_a.observe_tagged("qwen3", pod, tag, ttft * (1 + n), 0.01)
    await tick([a], clock)
    # A process that (re)started: nothing learned, it says hello.
    b, models_b = await replica("r1", net, clock)
    sent = carried(b, net, "lm")
    probe = LatencyFeatures(250, 1, 0, 0.0, 1.0, 0.1)
    assert models_b.predict("qwen3", pods[0], probe) is None
    for _ in range(6):
        await tick([a, b], clock)
    assert [c for c in sent if c] == [2, 2, 1]
    assert models_b.adopted == 5 and models_b.state()["models"] == models_a.state()["models"]
    # From there both learn every record alike: one sample r0's access log taught it.
    tag, ttft = tags(9)[8]
    models_a.observe_tagged("qwen3", pods[0], tag, ttft, 0.01)
    a.note_latency("qwen3", pods[0], tag, ttft, 0.01)
    await tick([a, b], clock)
    assert models_b.state()["models"] == models_a.state()["models"]
    pa, pb = models_a.predict("qwen3", pods[0], probe), models_b.predict("qwen3", pods[0], probe)
    assert pa is not None and pb is not None and (pa.ttft_s, pa.samples) == (pb.ttft_s, pb.samples)


async def test_the_samples_a_joiner_is_sent_are_not_learned_twice_with_the_models() -> None:
    """Samples r0 learned while nobody listened wait in its outbox; its models (which learned
    them) go out with or after them, and the joiner replaces what it learned from them."""
    clock, net = Clock(), MemoryNetwork()
    a, models_a = await replica("r0", net, clock)
    for tag, ttft in tags(5):
        models_a.observe_tagged("qwen3", POD, tag, ttft, 0.01)
        a.note_latency("qwen3", POD, tag, ttft, 0.01)
    await tick([a], clock)  # alone: they wait
    b, models_b = await replica("r1", net, clock)
    for _ in range(4):
        await tick([a, b], clock)
    assert samples_of(models_b) == 5
    assert models_b.state()["models"] == models_a.state()["models"]


def test_malformed_model_rows_are_dropped_never_raising() -> None:
    clock, net = Clock(), MemoryNetwork()
    models_b = LatencyModels()
    b = StateSync(
        replica="r1", bus=net.bus(), inflight=InflightTracker(clock=clock),
        fairness=FairnessCounters(), approx=lambda _model: None,
        on_latency_rows=models_b.adopt, settings=SETTINGS, clock=clock,
    )  # fmt: skip
    for seq, rows in enumerate(([["qwen3", POD, "junk"], [1, 2, 3], "x"], {"no": 1}, "x"), 1):
        b.receive(msgpack.packb({"v": 1, "r": "r9", "s": seq, "t": 0.0, "i": [], "lm": rows}))
    assert models_b.state()["models"] == {} and models_b.adopted == 0
    assert models_b.ignored == 3  # the rows of the list; the others are not lists of rows
