"""Saturation detection for admission (GAIE utilization-detector semantics).

A pod has headroom when its waiting queue is below `queue_threshold` and its KV usage is below
`kv_threshold`. Missing metrics count as saturated, as GAIE counts stale metrics as 1.0.
The director sheds sheddable requests (priority < 0) with 429 when `is_saturated` is true.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.routing.base import PodState

__all__ = [
    "DEFAULT_KV_THRESHOLD",
    "DEFAULT_QUEUE_THRESHOLD",
    "has_headroom",
    "is_saturated",
    "saturation",
]

DEFAULT_QUEUE_THRESHOLD = 5.0  # GAIE queueDepthThreshold
DEFAULT_KV_THRESHOLD = 0.8  # GAIE kvCacheUtilThreshold


def has_headroom(
    pod: PodState,
    queue_threshold: float = DEFAULT_QUEUE_THRESHOLD,
    kv_threshold: float = DEFAULT_KV_THRESHOLD,
    headroom: float = 0.0,
) -> bool:
    m = pod.metrics
    if m is None or m.waiting is None or m.kv_cache_usage is None:
        return False
    return m.waiting < queue_threshold * (1 + headroom) and m.kv_cache_usage < kv_threshold * (
        1 + headroom
    )


def is_saturated(
    pods: Sequence[PodState],
    queue_threshold: float = DEFAULT_QUEUE_THRESHOLD,
    kv_threshold: float = DEFAULT_KV_THRESHOLD,
) -> bool:
    """True when no pod has headroom (also true for no pods at all)."""
    return not any(has_headroom(p, queue_threshold, kv_threshold) for p in pods)


def saturation(
    pods: Sequence[PodState],
    queue_threshold: float = DEFAULT_QUEUE_THRESHOLD,
    kv_threshold: float = DEFAULT_KV_THRESHOLD,
) -> float:
    """GAIE's pool saturation: mean of max(q/qt, kv/kvt) per pod, unknown = 1.0 (for metrics)."""
    if not pods:
        return 1.0
    total = 0.0
    for p in pods:
        m = p.metrics
        if m is None or m.waiting is None or m.kv_cache_usage is None:
            total += 1.0
        else:
            total += max(m.waiting / queue_threshold, m.kv_cache_usage / kv_threshold)
    return total / len(pods)
