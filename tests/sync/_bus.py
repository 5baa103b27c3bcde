"""Shared by the replica-sync tests: fast sync settings, a clock a test sets, and replicas
joined by a `MemoryNetwork` whose ticks the test drives."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from extproc.accounting import FairnessCounters, InflightTracker
from extproc.config import SyncConfig as SyncSettings
from extproc.kvcache.approx import ApproximateIndex
from extproc.sync import MemoryNetwork, StateSync, SyncMetrics
from extproc.types import Endpoint

SETTINGS = SyncSettings(tick_s=0.005, heartbeat_s=0.02, expire_s=0.2)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


PODS = [Endpoint(f"10.0.0.{i}:8000", "m") for i in range(1, 5)]


@dataclass
class Replica:
    sync: StateSync
    inflight: InflightTracker
    fairness: FairnessCounters
    approx: ApproximateIndex
    registry: CollectorRegistry

    def sample(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


def make(name: str, net: MemoryNetwork, clock: Clock) -> Replica:
    inflight, fairness = InflightTracker(clock=clock), FairnessCounters()
    approx = ApproximateIndex(ttl_s=600)
    registry = CollectorRegistry()
    sync = StateSync(
        replica=name, bus=net.bus(), inflight=inflight, fairness=fairness,
        approx=lambda model: approx if model == "m" else None, models=lambda: ["m"],
        settings=SETTINGS,
        metrics=SyncMetrics(registry), clock=clock,
    )  # fmt: skip
    fairness.on_charge = sync.note_charge
    return Replica(sync, inflight, fairness, approx, registry)


async def started(net: MemoryNetwork, clock: Clock, n: int) -> list[Replica]:
    replicas = [make(f"r{i}", net, clock) for i in range(n)]
    for r in replicas:
        await r.sync._bus.start(r.sync.receive)  # ticks are driven by the test
    return replicas


async def tick_all(replicas: list[Replica], clock: Clock, rounds: int = 1) -> None:
    for _ in range(rounds):
        clock.now += SETTINGS.tick_s
        for r in replicas:
            await r.sync.tick()
        await asyncio.sleep(0.003)  # deliveries (lag is a few ms at most here)
