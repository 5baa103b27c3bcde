"""Scorer plugins: each returns one score in [0, 1] per pod, higher is better.

Where a pod lacks the signal (engine does not export it), it gets the neutral score 0.5 and
the scorer says so in its note, which the profile copies into Decision.reason.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np

from extproc.routing import signals
from extproc.routing.base import (
    NO_CAPABILITIES,
    Capabilities,
    PodState,
    RoutingRequest,
    ScoreResult,
)
from extproc.routing.columns import (
    PROFILE_RULE,
    FloatArray,
    PodColumns,
    columns_of,
    predicted_latency_column,
    vectorised,
)
from extproc.routing.framework import (
    EmptyParams,
    clamp01,
    minmax_lower_better,
)

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
    pods: Sequence[PodState],
    values: list[float | None],
    normalise: Callable[[Sequence[float]], list[float]],
    what: str,
) -> tuple[list[float], str | None]:
    known = [v for v in values if v is not None]
    normed = iter(normalise(known))
    scores = [NEUTRAL if v is None else next(normed) for v in values]
    missing = [p.address for p, v in zip(pods, values, strict=True) if v is None]
    if not missing:
        return scores, None
    if not known:
        return scores, f"{name}: {what} unknown on every pod (neutral {NEUTRAL}, no effect)"
    return scores, f"{name}: {what} unknown on {','.join(missing)} (neutral {NEUTRAL})"


def _minmax_lower_array(values: FloatArray) -> FloatArray:
    """`minmax_lower_better` on an array (the same float steps)."""
    if not len(values):
        return values
    lo, hi = values.min(), values.max()
    if hi == lo:
        return np.ones(len(values))
    out: FloatArray = (hi - values) / (hi - lo)
    return out


def _same(values: FloatArray) -> FloatArray:
    return values


def _kv_free_array(values: FloatArray) -> FloatArray:
    out: FloatArray = np.minimum(np.maximum(1.0 - values, 0.0), 1.0)  # np.clip, sans wrapper
    return out


def _with_unknown_columns(
    name: str,
    cols: PodColumns,
    values: FloatArray,
    normalise: Callable[[FloatArray], FloatArray],
    what: str,
) -> tuple[FloatArray, str | None]:
    """`_with_unknown` over a column whose unknown values are NaN."""
    unknown = np.isnan(values)
    if not unknown.any():
        return normalise(values), None
    scores = np.full(len(values), NEUTRAL)
    known = ~unknown
    if not known.any():
        return scores, f"{name}: {what} unknown on every pod (neutral {NEUTRAL}, no effect)"
    scores[known] = normalise(values[known])
    missing = ",".join([cols.addresses[i] for i in np.flatnonzero(unknown).tolist()])
    return scores, f"{name}: {what} unknown on {missing} (neutral {NEUTRAL})"


class _Base:
    """Scorers without params; a subclass sets `type_name`, `capabilities` and `score`."""

    type_name: ClassVar[str] = ""
    Params: ClassVar[type] = EmptyParams
    capabilities: ClassVar[Capabilities] = NO_CAPABILITIES  # most read load signals only

    def __init__(self, name: str, params: object = None) -> None:
        self.name = name


class QueueScorer(_Base):
    """GAIE queue-scorer: min-max over waiting requests, fewer is better."""

    type_name = "queue"

    def score(self, req: RoutingRequest, pods: Sequence[PodState]) -> ScoreResult:
        if vectorised(pods, PROFILE_RULE):
            cols = columns_of(pods)
            return _with_unknown_columns(
                self.name, cols, cols.waiting, _minmax_lower_array, "waiting"
            )
        return _with_unknown(
            self.name, pods, [signals.waiting(p) for p in pods], minmax_lower_better, "waiting"
        )


class KVCacheUtilizationScorer(_Base):
    """GAIE kv-cache-utilization-scorer: 1 - KV usage."""

    type_name = "kv-cache-utilization"

    def score(self, req: RoutingRequest, pods: Sequence[PodState]) -> ScoreResult:
        if vectorised(pods, PROFILE_RULE):
            cols = columns_of(pods)
            return _with_unknown_columns(
                self.name, cols, cols.kv_usage, _kv_free_array, "kv_cache_usage"
            )
        return _with_unknown(
            self.name,
            pods,
            [signals.kv_usage(p) for p in pods],
            lambda vs: [clamp01(1.0 - v) for v in vs],
            "kv_cache_usage",
        )


class PrefixScorer(_Base):
    """GAIE prefix-cache-scorer: matched / total prompt tokens (exact or approximate index)."""

    type_name = "prefix"
    capabilities = Capabilities(prompt_tokens=True, prefix_matches=True)

    def score(self, req: RoutingRequest, pods: Sequence[PodState]) -> ScoreResult:
        if req.prompt_tokens <= 0:
            return [0.0] * len(pods), f"{self.name}: request has no prompt tokens (0 for all)"
        if vectorised(pods, PROFILE_RULE):
            ratio = columns_of(pods).prefix_match_tokens / req.prompt_tokens
            return np.minimum(np.maximum(ratio, 0.0), 1.0), None  # np.clip, sans wrapper
        return [clamp01(p.prefix_match_tokens / req.prompt_tokens) for p in pods], None


class LeastRequestScorer(_Base):
    """Min-max over the gateway's own in-flight count (always known, unlike engine metrics)."""

    type_name = "least-request"

    def score(self, req: RoutingRequest, pods: Sequence[PodState]) -> ScoreResult:
        if vectorised(pods, PROFILE_RULE):
            return _minmax_lower_array(columns_of(pods).in_flight), None
        return minmax_lower_better([float(p.in_flight) for p in pods]), None


class LoraAffinityScorer(_Base):
    """GAIE lora-affinity-scorer: 1 adapter active, 0.8 free slot, 0.6 adapter waiting, else 0."""

    type_name = "lora-affinity"

    def score(self, req: RoutingRequest, pods: Sequence[PodState]) -> ScoreResult:
        if req.lora is None:
            return [1.0] * len(pods), None  # base-model request: every pod is equally fit
        if vectorised(pods, PROFILE_RULE):
            cols = columns_of(pods)
            return _with_unknown_columns(
                self.name, cols, cols.lora_states(req.lora), _same, "lora info"
            )
        return _with_unknown(
            self.name, pods, [signals.lora_state(req, p) for p in pods], list, "lora info"
        )


class LatencyScorer(_Base):
    """Min-max over predicted latency ttft + tpot * expected output tokens."""

    type_name = "latency"
    capabilities = Capabilities(accounting=True)

    def score(self, req: RoutingRequest, pods: Sequence[PodState]) -> ScoreResult:
        if vectorised(pods, PROFILE_RULE):
            cols = columns_of(pods)
            return _with_unknown_columns(
                self.name,
                cols,
                predicted_latency_column(req, cols),
                _minmax_lower_array,
                "latency averages",
            )
        values = [signals.predicted_latency_s(req, p)[0] for p in pods]
        return _with_unknown(self.name, pods, values, minmax_lower_better, "latency averages")


class ThroughputScorer(_Base):
    """Min-max over the gateway-measured token throughput: less token work in progress is better."""

    type_name = "throughput"
    capabilities = Capabilities(accounting=True)

    def score(self, req: RoutingRequest, pods: Sequence[PodState]) -> ScoreResult:
        if vectorised(pods, PROFILE_RULE):
            return _minmax_lower_array(columns_of(pods).throughput), None
        return minmax_lower_better([p.stats.throughput_tokens_per_s for p in pods]), None


class BusyTimeScorer(_Base):
    """Min-max over the gateway-measured busy time (AIBrix reads a GPU busy ratio vLLM lacks)."""

    type_name = "busy-time"
    capabilities = Capabilities(accounting=True)

    def score(self, req: RoutingRequest, pods: Sequence[PodState]) -> ScoreResult:
        if vectorised(pods, PROFILE_RULE):
            return _minmax_lower_array(columns_of(pods).busy_time), None
        return minmax_lower_better([p.stats.busy_time_s for p in pods]), None


class RandomScorer(_Base):
    """Uniform score per (request, pod), derived from the request id so it needs no shared RNG."""

    type_name = "random"

    def score(self, req: RoutingRequest, pods: Sequence[PodState]) -> ScoreResult:
        out = []
        for p in pods:
            digest = hashlib.blake2b(
                f"{req.request_id}|{p.address}".encode(), digest_size=8
            ).digest()
            out.append(int.from_bytes(digest, "big") / 2.0**64)
        return out, None


class SessionAffinityScorer(_Base):
    """AIBrix multi-strategy session-affinity: the pod named by the session gets 1, others 0."""

    type_name = "session-affinity"

    def score(self, req: RoutingRequest, pods: Sequence[PodState]) -> ScoreResult:
        if req.session_id is None:
            return [0.0] * len(pods), None
        return [1.0 if p.address == req.session_id else 0.0 for p in pods], None
