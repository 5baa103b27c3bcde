"""Reading one signal off a pod, with the substitution used when the engine does not export it.

Every accessor returns `None` for "unknown" so callers choose (and report) the substitute.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from extproc.routing.base import PodState, RoutingRequest

__all__ = [
    "DEFAULT_OUTPUT_TOKENS",
    "addresses",
    "expected_output_tokens",
    "kv_usage",
    "lora_state",
    "predicted_latency_s",
    "rank_by",
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


def predicted_latency_s(req: RoutingRequest, pod: PodState) -> tuple[float | None, str]:
    """ttft + tpot * expected output, preferring the gateway's recent EWMAs over engine lifetime means.

    Returns (seconds or None, which source was used).
    """
    out = expected_output_tokens(req)
    st = pod.stats
    if st.ttft_avg_s is not None and st.tpot_avg_s is not None:
        return st.ttft_avg_s + st.tpot_avg_s * out, "gateway"
    if st.latency_avg_s is not None:
        return st.latency_avg_s, "gateway-e2e"
    m = pod.metrics
    if m is not None and m.ttft_avg_s is not None and m.itl_avg_s is not None:
        return m.ttft_avg_s + m.itl_avg_s * out, "engine"
    return None, "none"


def lora_state(req: RoutingRequest, pod: PodState) -> float | None:
    """GAIE lora-affinity-scorer: 1 active, 0.8 free slot, 0.6 waiting, 0 otherwise; None unknown."""
    if req.lora is None or pod.metrics is None:
        return None
    m = pod.metrics
    if req.lora in m.running_lora_adapters:
        return 1.0
    active = len(set(m.running_lora_adapters) | set(m.waiting_lora_adapters))
    if m.max_lora is not None and active < m.max_lora:
        return 0.8
    if req.lora in m.waiting_lora_adapters:
        return 0.6
    return 0.0


def addresses(pods: Sequence[PodState]) -> str:
    return ",".join(p.address for p in pods)


def rank_by(
    pods: Sequence[PodState],
    key: Callable[[PodState], tuple[float, ...]],
    rng: random.Random,
) -> list[PodState]:
    """Sort ascending by `key`, equal keys in random order (no positional bias)."""
    keyed = [(key(p), rng.random(), i) for i, p in enumerate(pods)]
    keyed.sort()
    return [pods[i] for _, _, i in keyed]
