"""Fluent-ish builders for routing test inputs (constructed snapshots, no I/O)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import overload

from extproc.accounting.latency_model import LatencyModels
from extproc.routing.base import PodState, PodStats, RoutingRequest, Snapshot
from extproc.routing.columns import PodColumns, PodRows, PodTable
from extproc.routing.predicted import (
    LLMD_SLO_TPOT_HEADER,
    LLMD_SLO_TTFT_HEADER,
    SLO_TPOT_HEADER,
    SLO_TTFT_HEADER,
    LatencyFeatures,
    slo_ms,
)
from extproc.types import Endpoint, EndpointRole, EngineMetrics
from tests._clock import ManualClock

UNSET = object()


def pod(
    addr: str,
    *,
    running: float | None = None,
    waiting: float | None = None,
    kv: float | None = None,
    in_flight: int = 0,
    in_flight_tokens: int = 0,
    match: int = 0,
    role: EndpointRole = EndpointRole.BOTH,
    loras: tuple[str, ...] = (),
    waiting_loras: tuple[str, ...] = (),
    max_lora: int | None = None,
    ttft: float | None = None,
    itl: float | None = None,
    itl_recent: float | None = None,
    itl_baseline: float | None = None,
    stats: PodStats | None = None,
    cached_blocks: int = 0,
    prefill_tokens: int | None = None,
    no_metrics: bool = False,
    model: str = "m",
) -> PodState:
    metrics = None
    if not no_metrics:
        metrics = EngineMetrics(
            updated_at=100.0,
            running=running,
            waiting=waiting,
            kv_cache_usage=kv,
            ttft_avg_s=ttft,
            itl_avg_s=itl,
            itl_recent_s=itl_recent,
            itl_baseline_s=itl_baseline,
            running_lora_adapters=loras,
            waiting_lora_adapters=waiting_loras,
            max_lora=max_lora,
        )
    return PodState(
        endpoint=Endpoint(address=addr, model=model, role=role),
        metrics=metrics,
        in_flight=in_flight,
        in_flight_tokens=in_flight_tokens,
        prefix_match_tokens=match,
        cached_blocks=cached_blocks,
        stats=stats or PodStats(),
        prefill_tokens=prefill_tokens,
    )


def req(
    *,
    prompt_tokens: int = 0,
    request_id: str = "r1",
    user: str | None = None,
    session_id: str | None = None,
    lora: str | None = None,
    max_tokens: int | None = None,
    priority: int = 0,
    headers: dict[str, str] | None = None,
    block_size: int = 16,
) -> RoutingRequest:
    return RoutingRequest(
        request_id=request_id,
        model="m",
        prompt_tokens=prompt_tokens,
        user=user,
        session_id=session_id,
        lora=lora,
        max_tokens=max_tokens,
        priority=priority,
        headers=headers or {},
        block_size=block_size,
        # Its SLO headers, read as the director reads a request's attributes.
        slo_ttft_ms=slo_ms(headers or {}, SLO_TTFT_HEADER, LLMD_SLO_TTFT_HEADER),
        slo_tpot_ms=slo_ms(headers or {}, SLO_TPOT_HEADER, LLMD_SLO_TPOT_HEADER),
    )


@dataclass
class FakeFairness:
    """In-memory FairnessView: fixed counters per user and a fixed active minimum."""

    counters: dict[str, float] = field(default_factory=dict)
    minimum: float = 0.0

    def tokens(self, user: str) -> float:
        return self.counters.get(user, 0.0)

    def active_min(self) -> float:
        return self.minimum


def snap(*pods: PodState, fairness: FakeFairness | None = None) -> Snapshot:
    return Snapshot(now=200.0, pods=tuple(pods), fairness=fairness)


def addrs(n: int) -> list[str]:
    return [f"10.0.0.{i + 1}:8000" for i in range(n)]


class RowTable(PodTable):
    """A `PodTable` over ready rows that counts the rows read (the director's table builds a
    `PodState` per row read); its columns come from the rows without reading them here."""

    def __init__(self, pods: list[PodState]) -> None:
        self._pods = pods
        self._columns = PodColumns(PodRows(pods))
        self.read: set[int] = set()

    @property
    def columns(self) -> PodColumns:
        return self._columns

    def __len__(self) -> int:
        return len(self._pods)

    @overload
    def __getitem__(self, i: int) -> PodState: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[PodState]: ...

    def __getitem__(self, i: int | slice) -> PodState | Sequence[PodState]:
        if isinstance(i, slice):
            return [self[j] for j in range(len(self._pods))[i]]
        self.read.add(i % len(self._pods))
        return self._pods[i]


def random_pods(n: int, rng: random.Random, *, roles: bool, sparse: bool) -> list[PodState]:
    """`n` pods with small integer signals (many ties): P/D roles when `roles`, some engine
    signals, metrics and pod stats missing when `sparse`, LoRA adapter sets, measured and
    unmeasured TTFT."""
    out = []
    for i in range(n):
        missing = sparse and rng.random() < 0.25
        stats = (
            PodStats()
            if sparse and rng.random() < 0.3
            else PodStats(
                requests_total=rng.randint(0, 3),
                throughput_tokens_per_s=float(rng.randint(0, 4) * 100),
                busy_time_s=float(rng.randint(0, 3)),
                ttft_avg_s=rng.choice([None, 0.1, 0.2]),
                tpot_avg_s=rng.choice([None, 0.01, 0.02]),
                latency_avg_s=rng.choice([None, 1.0, 2.0]),
            )
        )
        in_flight_tokens = rng.randint(0, 5) * 500
        out.append(
            pod(
                f"10.0.{i // 200}.{i % 200 + 1}:8000",
                running=None if missing else float(rng.randint(0, 5)),
                waiting=None if missing else float(rng.randint(0, 6)),
                kv=None if missing else rng.choice([0.1, 0.5, 0.85, 0.9]),
                in_flight=rng.randint(0, 12),
                in_flight_tokens=in_flight_tokens,
                match=rng.choice([0, 0, 16, 64, 256]),
                role=rng.choice(list(EndpointRole)) if roles else EndpointRole.BOTH,
                loras=rng.choice([(), ("ad",), ("x", "y")]),
                waiting_loras=rng.choice([(), (), ("ad",)]),
                max_lora=rng.choice([None, 2]),
                ttft=rng.choice([None, 0.3]),
                itl=rng.choice([None, 0.03]),
                stats=stats,
                cached_blocks=rng.randint(0, 3) * 10,
                prefill_tokens=rng.choice([None, 0, in_flight_tokens // 2, in_flight_tokens]),
                no_metrics=sparse and rng.random() < 0.1,
            )
        )
    return out


def learned_models(
    pods: Sequence[PodState],
    rng: random.Random,
    clock: ManualClock,
    *,
    cold: Sequence[int] = (),
    tpot_cold: Sequence[int] = (),
) -> LatencyModels:
    """Latency models of `pods` (min_samples 4), warm but the pods at `cold` and without a
    TPOT model at `tpot_cold`: pods of different speeds that learned at different times (ages
    0-60 s), some routed to lately (so some are due a probe)."""
    models = LatencyModels(min_samples=4, clock=clock.now)
    for i, p in enumerate(pods):
        if i in cold:
            continue
        speed = rng.choice([1.0, 1.0, 2.0, 3.0])
        for _ in range(rng.randint(4, 9)):
            f = LatencyFeatures(rng.randrange(0, 3000), rng.randrange(0, 8), 0, 0.0, 1.0, 0.2)
            ttft = (0.03 + 0.04 * f.uncached_tokens / 1000 + 0.015 * f.in_flight) / speed
            tpot = None if i in tpot_cold else rng.uniform(0.005, 0.02) / speed
            models.observe("m", p.address, f, ttft_s=ttft * rng.uniform(0.8, 1.2), tpot_s=tpot)
        clock.advance(rng.choice([0.0, 0.0, 3.0, 20.0]))
        if rng.random() < 0.3:
            models.routed("m", p.address)
    clock.advance(5.0)
    return models
