"""Filter plugins: narrow the candidate set. An emptied set is handled by the profile (kept all)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from extproc.routing import signals
from extproc.routing.base import (
    NO_CAPABILITIES,
    Capabilities,
    FilterResult,
    PodState,
    RoutingRequest,
)
from extproc.routing.framework import EmptyParams
from extproc.routing.saturation import SaturationConfig, has_headroom
from extproc.types import EndpointRole

__all__ = [
    "LoraAffinityFilter",
    "LowQueueFilter",
    "LowQueueParams",
    "RoleFilter",
    "RoleParams",
    "SaturationFilter",
    "SaturationParams",
]


# The filter's params are the saturation model's own thresholds (one set of defaults).
SaturationParams = SaturationConfig


class SaturationFilter:
    """GAIE utilization-detector as a filter: keep pods with headroom (`routing.saturation`)."""

    type_name: ClassVar[str] = "saturation"
    Params: ClassVar[type] = SaturationParams
    capabilities: ClassVar[Capabilities] = NO_CAPABILITIES

    def __init__(self, name: str, params: SaturationParams | None = None) -> None:
        self.name = name
        self.params = params or SaturationParams()

    def filter(self, req: RoutingRequest, pods: Sequence[PodState]) -> FilterResult:
        return [pod for pod in pods if has_headroom(pod, self.params)], None


@dataclass(frozen=True, slots=True)
class LowQueueParams:
    threshold: float = 128.0  # GAIE v0 QUEUING_THRESHOLD_LORA

    def __post_init__(self) -> None:
        if self.threshold <= 0:
            raise ValueError("threshold must be > 0")


class LowQueueFilter:
    """Keep pods whose waiting queue is below `threshold`; pods with unknown queue are kept."""

    type_name: ClassVar[str] = "low-queue"
    Params: ClassVar[type] = LowQueueParams
    capabilities: ClassVar[Capabilities] = NO_CAPABILITIES

    def __init__(self, name: str, params: LowQueueParams | None = None) -> None:
        self.name = name
        self.threshold = (params or LowQueueParams()).threshold

    def filter(self, req: RoutingRequest, pods: Sequence[PodState]) -> FilterResult:
        kept = []
        unknown = []
        for pod in pods:
            q = signals.waiting(pod)
            if q is None:
                unknown.append(pod.address)
                kept.append(pod)
            elif q < self.threshold:
                kept.append(pod)
        note = f"{self.name}: queue unknown on {','.join(unknown)} (kept)" if unknown else None
        return kept, note


class LoraAffinityFilter:
    """GAIE v0 LoRA affinity: pods running the adapter; else pods with a free LoRA slot; else all."""

    type_name: ClassVar[str] = "lora-affinity"
    Params: ClassVar[type] = EmptyParams
    capabilities: ClassVar[Capabilities] = NO_CAPABILITIES

    def __init__(self, name: str, params: object = None) -> None:
        self.name = name

    def filter(self, req: RoutingRequest, pods: Sequence[PodState]) -> FilterResult:
        if req.lora is None:
            return list(pods), None
        states = [(p, signals.lora_state(req, p)) for p in pods]
        active = [p for p, s in states if s == 1.0]
        if active:
            return active, None
        free = [p for p, s in states if s == 0.8]
        if free:
            return free, None
        return list(pods), f"{self.name}: no pod runs {req.lora!r} or has a free slot (kept all)"


@dataclass(frozen=True, slots=True)
class RoleParams:
    role: str = "decode"

    def __post_init__(self) -> None:
        if self.role not in {r.value for r in EndpointRole}:
            raise ValueError(f"role must be one of prefill, decode, both; got {self.role!r}")


class RoleFilter:
    """Keep pods that can act in `role`: the role itself or `both`."""

    type_name: ClassVar[str] = "role"
    Params: ClassVar[type] = RoleParams
    capabilities: ClassVar[Capabilities] = NO_CAPABILITIES

    def __init__(self, name: str, params: RoleParams | None = None) -> None:
        self.name = name
        self.role = EndpointRole((params or RoleParams()).role)

    def filter(self, req: RoutingRequest, pods: Sequence[PodState]) -> FilterResult:
        if self.role is EndpointRole.BOTH:
            return [p for p in pods if p.endpoint.role is EndpointRole.BOTH], None
        return [p for p in pods if p.endpoint.role in (self.role, EndpointRole.BOTH)], None
