"""What the admin server reads from the running app (the composition root implements it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from extproc.accounting.gateway_metrics import GatewayMetrics
from extproc.accounting.inflight import InflightTracker
from extproc.accounting.latency_model import LatencyModels
from extproc.admin.status import DecisionLog, ReloadStatus
from extproc.capture import CaptureStore
from extproc.config import Config
from extproc.director.director import Director
from extproc.kvcache.approx import ApproximateIndex
from extproc.kvcache.exact import ExactIndex
from extproc.kvevents.subscriber import KVEventManager
from extproc.metrics.store import EndpointStore
from extproc.sync import StateSync

__all__ = ["AdminSource"]


class AdminSource(Protocol):
    """The running app as the admin port sees it; properties read the live runtime, so a
    config reload shows at the next request."""

    replica: str  # host:pid of this process
    metrics: GatewayMetrics
    store: EndpointStore
    inflight: InflightTracker
    kv: KVEventManager
    sync: StateSync | None
    decisions: DecisionLog  # this process's recent decisions (the status page)
    reload_status: ReloadStatus
    latency: LatencyModels  # predicted-latency's per-pod models (/debug/latency-model)
    capture: CaptureStore | None  # the traffic capture's rings (/debug/capture), when enabled

    @property
    def config(self) -> Config: ...

    @property
    def director(self) -> Director: ...

    @property
    def exact_indexes(self) -> Mapping[str, ExactIndex]: ...

    @property
    def approx_indexes(self) -> Mapping[str, ApproximateIndex]: ...

    def is_ready(self) -> bool: ...
