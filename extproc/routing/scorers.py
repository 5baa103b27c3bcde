"""Scorer plugins: each returns one score in [0, 1] per pod, higher is better.

Where a pod lacks the signal (engine does not export it), it gets the neutral score 0.5 and
the scorer says so in its note, which the profile copies into Decision.reason.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np

from extproc.routing.base import (
    NO_CAPABILITIES,
    Capabilities,
    PodState,
    RoutingRequest,
    ScoreResult,
)
from extproc.routing.columns import (
    FloatArray,
    PodColumns,
    columns_of,
    predicted_latency_column,
)
from extproc.routing.framework import EmptyParams, minmax_lower_better

__all__ = [
    "BusyTimeScorer",
    "KVCacheUtilizationScorer",
    "LatencyScorer",
    "LeastRequestScorer",
    "LoraAffinityScorer",
    "PrefixScorer",
    "QueueScorer",
    "RandomScorer",
    "SessionAffinityScorer",
    "ThroughputScorer",
]

NEUTRAL = 0.5


def _with_unknown(
    name: str,
    cols: PodColumns,
    values: FloatArray,
    normalise: Callable[[FloatArray], FloatArray],
    what: str,
) -> tuple[FloatArray, str | None]:
    """`normalise` over the pods that have the signal; NEUTRAL where it is unknown (NaN), and
    a note naming those pods."""
    unknown = values != values  # NaN
    unknown_count = np.count_nonzero(unknown)
    if not unknown_count:
        return normalise(values), None
    scores = np.full(len(values), NEUTRAL)
    if unknown_count == len(values):
        return scores, f"{name}: {what} unknown on every pod (neutral {NEUTRAL}, no effect)"
    known = ~unknown
    scores[known] = normalise(values[known])
    missing = cols.addresses_text(unknown.nonzero()[0])
    return scores, f"{name}: {what} unknown on {missing} (neutral {NEUTRAL})"


def _same(values: FloatArray) -> FloatArray:
    return values


def _kv_free(values: FloatArray) -> FloatArray:
    out: FloatArray = np.minimum(np.maximum(1.0 - values, 0.0), 1.0)  # np.clip, sans wrapper
    return out


class _Base:
    """Scorers without params; a subclass sets `type_name`, `capabilities` and `score`, and
    `bounded` when its scores are finite and in [0, 1] whatever the inputs (the profile then
    skips its clamp)."""

    type_name: ClassVar[str] = ""
    Params: ClassVar[type] = EmptyParams
    capabilities: ClassVar[Capabilities] = NO_CAPABILITIES  # most read load signals only
    bounded: ClassVar[bool] = False

    def __init__(self, name: str, params: object = None) -> None:
        self.name = name


class QueueScorer(_Base):
    """GAIE queue-scorer: min-max over waiting requests, fewer is better."""

    type_name = "queue"

    def score(self, req: RoutingRequest, pods: Sequence[PodState]) -> ScoreResult:
        cols = columns_of(pods)
        return _with_unknown(self.name, cols, cols.waiting, minmax_lower_better, "waiting")


class KVCacheUtilizationScorer(_Base):
    """GAIE kv-cache-utilization-scorer: 1 - KV usage."""

    type_name = "kv-cache-utilization"
    bounded = True

    def score(self, req: RoutingRequest, pods: Sequence[PodState]) -> ScoreResult:
        cols = columns_of(pods)
        return _with_unknown(self.name, cols, cols.kv_usage, _kv_free, "kv_cache_usage")


class PrefixScorer(_Base):
    """GAIE prefix-cache-scorer: matched / total prompt tokens (exact or approximate index)."""

    type_name = "prefix"
    bounded = True
    capabilities = Capabilities(prompt_tokens=True, prefix_matches=True)

    def score(self, req: RoutingRequest, pods: Sequence[PodState]) -> ScoreResult:
        if req.prompt_tokens <= 0:
            return np.zeros(len(pods)), f"{self.name}: request has no prompt tokens (0 for all)"
        ratio = columns_of(pods).prefix_match_tokens / req.prompt_tokens
        return np.minimum(np.maximum(ratio, 0.0), 1.0), None  # np.clip, sans wrapper


class LeastRequestScorer(_Base):
    """Min-max over the gateway's own in-flight count (always known, unlike engine metrics)."""

    type_name = "least-request"
    bounded = True

    def score(self, req: RoutingRequest, pods: Sequence[PodState]) -> ScoreResult:
        return minmax_lower_better(columns_of(pods).in_flight), None


class LoraAffinityScorer(_Base):
    """GAIE lora-affinity-scorer: 1 adapter active, 0.8 free slot, 0.6 adapter waiting, else 0."""

    type_name = "lora-affinity"
    bounded = True

    def score(self, req: RoutingRequest, pods: Sequence[PodState]) -> ScoreResult:
        if req.lora is None:
            return np.ones(len(pods)), None  # base-model request: every pod is equally fit
        cols = columns_of(pods)
        return _with_unknown(self.name, cols, cols.lora_states(req.lora), _same, "lora info")


class LatencyScorer(_Base):
    """Min-max over predicted latency ttft + tpot * expected output tokens."""

    type_name = "latency"
    capabilities = Capabilities(accounting=True)

    def score(self, req: RoutingRequest, pods: Sequence[PodState]) -> ScoreResult:
        cols = columns_of(pods)
        return _with_unknown(
            self.name,
            cols,
            predicted_latency_column(req, cols),
            minmax_lower_better,
            "latency averages",
        )


class ThroughputScorer(_Base):
    """Min-max over the gateway-measured token throughput: less token work in progress is better."""

    type_name = "throughput"
    capabilities = Capabilities(accounting=True)

    def score(self, req: RoutingRequest, pods: Sequence[PodState]) -> ScoreResult:
        return minmax_lower_better(columns_of(pods).throughput), None


class BusyTimeScorer(_Base):
    """Min-max over the gateway-measured busy time (AIBrix reads a GPU busy ratio vLLM lacks)."""

    type_name = "busy-time"
    capabilities = Capabilities(accounting=True)

    def score(self, req: RoutingRequest, pods: Sequence[PodState]) -> ScoreResult:
        return minmax_lower_better(columns_of(pods).busy_time), None


class RandomScorer(_Base):
    """Uniform score per (request, pod), derived from the request id so it needs no shared RNG."""

    type_name = "random"
    bounded = True

    def score(self, req: RoutingRequest, pods: Sequence[PodState]) -> ScoreResult:
        prefix = f"{req.request_id}|"
        out = [
            int.from_bytes(
                hashlib.blake2b(f"{prefix}{address}".encode(), digest_size=8).digest(), "big"
            )
            / 2.0**64
            for address in columns_of(pods).addresses
        ]
        return np.array(out), None


class SessionAffinityScorer(_Base):
    """AIBrix multi-strategy session-affinity: the pod named by the session gets 1, others 0."""

    type_name = "session-affinity"
    bounded = True

    def score(self, req: RoutingRequest, pods: Sequence[PodState]) -> ScoreResult:
        if req.session_id is None:
            return np.zeros(len(pods)), None
        addresses = columns_of(pods).addresses
        return np.fromiter(map(req.session_id.__eq__, addresses), np.float64, len(addresses)), None
