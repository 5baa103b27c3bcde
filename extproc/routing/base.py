"""The routing contract: what a strategy sees and what it answers.

Routing is a function of (RoutingRequest, Snapshot) -> Decision. It never does I/O.
The director (one layer up) builds the snapshot from the metrics store, the gateway's
own accounting and the KV-cache indexes, then asks a strategy for a Decision.

Building blocks (GAIE style): filters narrow the candidates, scorers return one score in
[0, 1] per candidate, a profile sums `weight * clamp(score)`, and a picker chooses (max with
random tie-break, or softmax with temperature). Named strategies are built from these or
implement `Strategy` directly when their rule is not a weighted sum.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from extproc.types import EMPTY_LABELS, Endpoint, EngineMetrics, RequestKind

__all__ = [
    "Decision",
    "FairnessView",
    "Filter",
    "Picker",
    "PodState",
    "PodStats",
    "RoutingRequest",
    "Scorer",
    "Snapshot",
    "Strategy",
    "uses_prompt_tokens",
]


@dataclass(frozen=True, slots=True)
class PodStats:
    """What the gateway itself measured for a pod (not scraped from the engine)."""

    requests_total: int = 0
    throughput_tokens_per_s: float = 0.0  # EWMA of prompt+completion tokens/s finished here
    busy_time_s: float = 0.0  # EWMA-decayed seconds with >=1 request in flight
    ttft_avg_s: float | None = None  # EWMA of time to first byte seen by the gateway
    tpot_avg_s: float | None = None  # EWMA of time per output token seen by the gateway
    latency_avg_s: float | None = None  # EWMA of end-to-end latency


@dataclass(frozen=True, slots=True)
class PodState:
    """One candidate pod as one decision sees it."""

    endpoint: Endpoint
    metrics: EngineMetrics | None
    in_flight: int = 0  # requests the gateway has sent and not yet seen finish
    in_flight_tokens: int = 0  # prompt + max_tokens estimate of those requests
    prefix_match_tokens: int = 0  # longest cached prefix of this request on this pod, in tokens
    prefix_exact: bool = False  # True when prefix_match_tokens comes from KV events
    cached_blocks: int = 0  # size of this pod's known cache (blocks), 0 if unknown
    stats: PodStats = field(default_factory=PodStats)

    @property
    def address(self) -> str:
        return self.endpoint.address


class FairnessView(Protocol):
    """Per-user virtual token counters (VTC), fed by response accounting."""

    def tokens(self, user: str) -> float: ...

    def active_min(self) -> float:
        """Smallest counter among users with requests in flight (VTC's counter lift)."""
        ...


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    request_id: str
    model: str
    kind: RequestKind = RequestKind.CHAT
    prompt_tokens: int = 0  # exact when tokenized, estimated otherwise
    tokens_estimated: bool = False
    token_ids: Sequence[int] | None = None
    block_hashes: tuple[int, ...] = ()  # router chained hashes of the prompt's full blocks
    block_size: int = 16
    max_tokens: int | None = None
    user: str | None = None
    session_id: str | None = None  # decoded, validated session hint (address), if any
    lora: str | None = None  # adapter name when `model` names a LoRA adapter
    priority: int = 0  # < 0 marks the request sheddable
    headers: Mapping[str, str] = field(default_factory=lambda: EMPTY_LABELS)


@dataclass(frozen=True, slots=True)
class Snapshot:
    now: float
    pods: tuple[PodState, ...]  # ready, fresh candidates for this request's model
    fairness: FairnessView | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """Ranked endpoints: the first is the pick, the rest are retry fallbacks."""

    ranked: tuple[Endpoint, ...]
    strategy: str
    scores: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    reason: str = ""
    prefill: Endpoint | None = None  # set by `pd`: run the prefill here first
    session_id: str | None = None  # set by `session-affinity`: returned to the client

    @property
    def endpoint(self) -> Endpoint:
        return self.ranked[0]


class Filter(Protocol):
    name: str

    def filter(self, req: RoutingRequest, pods: Sequence[PodState]) -> Sequence[PodState]: ...


class Scorer(Protocol):
    name: str

    def score(self, req: RoutingRequest, pods: Sequence[PodState]) -> Sequence[float]:
        """One score per pod, each in [0, 1]; higher is better."""
        ...


class Picker(Protocol):
    name: str

    def rank(
        self, pods: Sequence[PodState], totals: Sequence[float], rng: random.Random
    ) -> list[PodState]:
        """Order all pods best first (the tail gives retry fallbacks)."""
        ...


class Strategy(Protocol):
    """A named routing rule.

    A strategy may set a class attribute `uses_prompt_tokens = False` when its rule reads no
    token ids, prefix matches or exact prompt lengths: the director then skips tokenization
    for it (a chars/4 estimate fills `prompt_tokens`, labelled `tokens_estimated`).
    """

    name: str

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        """Pick for `req` among `snap.pods` (never empty: the director checks)."""
        ...


def uses_prompt_tokens(strategy: object) -> bool:
    """Whether `strategy` needs exact prompt tokens (True unless it says otherwise)."""
    return bool(getattr(strategy, "uses_prompt_tokens", True))
