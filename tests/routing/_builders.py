"""Fluent-ish builders for routing test inputs (constructed snapshots, no I/O)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import overload

from extproc.routing.base import PodState, PodStats, RoutingRequest, Snapshot
from extproc.routing.columns import PodColumns, PodRows, PodTable
from extproc.types import Endpoint, EndpointRole, EngineMetrics

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
