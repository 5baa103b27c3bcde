"""The gateway's own accounting: in-flight leases, pod stats, VTC counters, metrics."""

from __future__ import annotations

from extproc.accounting.fairness import FairnessCounters
from extproc.accounting.gateway_metrics import DECISION_BUCKETS, GatewayMetrics
from extproc.accounting.inflight import InflightTracker, Lease, Load
from extproc.accounting.podstats import PodStatsTracker

__all__ = [
    "DECISION_BUCKETS",
    "FairnessCounters",
    "GatewayMetrics",
    "InflightTracker",
    "Lease",
    "Load",
    "PodStatsTracker",
]
