"""Latency samples over the sync bus: Envoy sends a worker's access-log records to one process,
so each replica shares what it learnt and every replica's models learn every record, once."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from prometheus_client import CollectorRegistry

from extproc.accounting import FairnessCounters, InflightTracker
from extproc.accounting.latency_model import DecisionTag, LatencyModels
from extproc.config import SyncConfig
from extproc.routing.predicted import LatencyFeatures
from extproc.sync import MemoryNetwork, StateSync, SyncMetrics

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
        on_latency=models.observe_tagged, settings=SETTINGS,
        metrics=SyncMetrics(CollectorRegistry()), clock=clock,
    )  # fmt: skip
    await sync._bus.start(sync.receive)
    return sync, models


async def tick(syncs: list[StateSync], clock: Clock) -> None:
    clock.now += SETTINGS.tick_s
    for s in syncs:
        await s.tick()
    await asyncio.sleep(0.003)


def tags(n: int) -> list[tuple[str, float]]:
    return [
        (DecisionTag(LatencyFeatures(100 * i, i % 3, 0, 0.0, 1.0, 0.1)).encode(), 0.05 + 0.01 * i)
        for i in range(n)
    ]


async def test_every_replica_learns_every_sample_once() -> None:
    clock, net = Clock(), MemoryNetwork(duplicate=1.0)  # every message delivered twice
    (a, models_a), (b, models_b) = [await replica(n, net, clock) for n in ("r0", "r1")]
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


async def test_samples_lost_with_the_bus_are_not_replayed_and_bad_rows_are_dropped() -> None:
    clock, net = Clock(), MemoryNetwork()
    (a, _), (b, models_b) = [await replica(n, net, clock) for n in ("r0", "r1")]
    net.down = True
    for tag, ttft in tags(4):
        a.note_latency("qwen3", POD, tag, ttft, None)
    await tick([a, b], clock)
    net.down = False
    await tick([a, b], clock)
    assert models_b.state()["models"] == {}  # the models forget old samples anyway
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
