"""Reading one signal off a pod, with the substitution used when the engine does not export it.

Every accessor returns `None` for "unknown" so callers choose (and report) the substitute.
The rules read the same signals as columns (`extproc.routing.columns`); filters read them here.
"""

from __future__ import annotations

from extproc.routing.base import PodState, RoutingRequest

__all__ = [
    "DEFAULT_OUTPUT_TOKENS",
    "expected_output_tokens",
    "kv_usage",
    "lora_set_state",
    "lora_state",
    "running",
    "waiting",
]

# AIBrix least-latency falls back to 100 generated tokens when it has no average.
DEFAULT_OUTPUT_TOKENS = 100


def waiting(pod: PodState) -> float | None:
    return None if pod.metrics is None else pod.metrics.waiting


def running(pod: PodState) -> float | None:
    return None if pod.metrics is None else pod.metrics.running


def kv_usage(pod: PodState) -> float | None:
    return None if pod.metrics is None else pod.metrics.kv_cache_usage


def expected_output_tokens(req: RoutingRequest) -> int:
    return (
        req.max_tokens
        if req.max_tokens is not None and req.max_tokens > 0
        else DEFAULT_OUTPUT_TOKENS
    )


def lora_set_state(
    lora: str, running: tuple[str, ...], waiting: tuple[str, ...], max_lora: int | None
) -> float:
    """GAIE lora-affinity tiers of one adapter set: 1 the adapter runs, 0.8 a free slot,
    0.6 the adapter waits, else 0."""
    if lora in running:
        return 1.0
    if max_lora is not None and len(set(running) | set(waiting)) < max_lora:
        return 0.8
    if lora in waiting:
        return 0.6
    return 0.0


def lora_state(req: RoutingRequest, pod: PodState) -> float | None:
    """`lora_set_state` of the pod's adapters; None without an adapter or metrics."""
    if req.lora is None or pod.metrics is None:
        return None
    m = pod.metrics
    return lora_set_state(req.lora, m.running_lora_adapters, m.waiting_lora_adapters, m.max_lora)
