"""When a pod is full: the one saturation model every part uses (llm-d's utilization detector).

A pod's saturation is max(waiting / queue_threshold, KV usage / kv_threshold), 1.0 when its
metrics lack either signal (stale or missing metrics count as full, as llm-d's detector fails
closed); it has headroom below 1 (stretched by `headroom`). The pool's saturation is the mean
over its pods, 1.0 with none. The thresholds are `SaturationConfig` (config key `saturation`,
llm-d's defaults 5 and 0.8), read by:

- the shedding admit step: a sheddable request (priority < 0) is refused when no candidate
  has headroom (`is_saturated`);
- the `saturation` filter: keeps the candidates with headroom (its params are the same
  dataclass, so the same defaults);
- flow control (`extproc.flowcontrol.capacity`): a pod at the KV threshold takes nothing, the
  `queue` dispatch rule fills each pod's queue up to the queue threshold, and the pool
  saturation it exports is this mean, with a pod's in-flight load over its learned running
  slots as a third term (the engines' queues stay empty when the gateway holds the queue).
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.config import SaturationConfig
from extproc.routing.base import PodState
from extproc.types import EngineMetrics

__all__ = [
    "DEFAULT_SATURATION",
    "SaturationConfig",
    "has_headroom",
    "is_saturated",
    "pod_saturation",
    "saturation",
]

DEFAULT_SATURATION = SaturationConfig()


def _over(value: float, threshold: float) -> float:
    return value / threshold if threshold > 0 else 1.0 + value  # a zero threshold: always full


def pod_saturation(metrics: EngineMetrics | None, cfg: SaturationConfig) -> float:
    """max(waiting / queue threshold, KV / KV threshold); 1.0 without both signals."""
    if metrics is None or metrics.waiting is None or metrics.kv_cache_usage is None:
        return 1.0
    return max(
        _over(metrics.waiting, cfg.queue_threshold), _over(metrics.kv_cache_usage, cfg.kv_threshold)
    )


def has_headroom(pod: PodState, cfg: SaturationConfig = DEFAULT_SATURATION) -> bool:
    m = pod.metrics
    if m is None or m.waiting is None or m.kv_cache_usage is None:
        return False
    stretch = 1.0 + cfg.headroom
    return (
        m.waiting < cfg.queue_threshold * stretch and m.kv_cache_usage < cfg.kv_threshold * stretch
    )


def is_saturated(pods: Sequence[PodState], cfg: SaturationConfig = DEFAULT_SATURATION) -> bool:
    """True when no pod has headroom (also true for no pods at all)."""
    return not any(has_headroom(p, cfg) for p in pods)


def saturation(pods: Sequence[PodState], cfg: SaturationConfig = DEFAULT_SATURATION) -> float:
    """The pool's saturation: the mean of its pods', 1.0 with none."""
    if not pods:
        return 1.0
    return sum(pod_saturation(p.metrics, cfg) for p in pods) / len(pods)
