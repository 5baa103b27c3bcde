"""The routing contract: what a strategy sees and what it answers.

Routing is a function of (RoutingRequest, Snapshot) -> Decision. It never does I/O.
The director (one layer up) builds the snapshot from the metrics store, the gateway's
own accounting and the KV-cache indexes, then asks a strategy for a Decision.

Building blocks (GAIE style): filters narrow the candidates, scorers return one score in
[0, 1] per candidate, a profile sums `weight * clamp(score)`, and a picker chooses (max with
random tie-break, or softmax with temperature). Named strategies are built from these or
implement `Strategy` directly when their rule is not a weighted sum. Every plugin kind has one
method that returns its values together with a note (the signal it missed, or None), and
declares in `capabilities` which inputs it reads. See docs/architecture.md, "Extension points".
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from extproc.types import EMPTY_LABELS, Endpoint, EngineMetrics, RequestKind

__all__ = [
    "DECODE_PROFILE",
    "NO_CAPABILITIES",
    "PREFILL_PROFILE",
    "Capabilities",
    "Decision",
    "FairnessView",
    "Filter",
    "FilterResult",
    "Picker",
    "PluginRef",
    "PluginTiming",
    "PodState",
    "PodStats",
    "ProfileResult",
    "RoutingMemory",
    "RoutingRequest",
    "ScoreResult",
    "ScoreValues",
    "Scorer",
    "Snapshot",
    "Strategy",
    "uses_prompt_tokens",
]

PREFILL_PROFILE = "prefill"
DECODE_PROFILE = "decode"


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a plugin reads beyond the candidates' load signals; the director prepares only that.

    The contract test (tests/routing/test_contract.py) checks each declaration: a plugin that
    does not declare an input decides the same when that input changes.
    """

    prompt_tokens: bool = False  # the exact prompt length or token ids (else a chars/4 estimate)
    prefix_matches: bool = False  # PodState.prefix_match_tokens / prefix_exact / cached_blocks
    accounting: bool = False  # PodState.stats: what the gateway measured per pod
    fairness: bool = False  # Snapshot.fairness: per-user token counters
    disaggregated: bool = False  # answers with a prefill and a decode profile (P/D)

    @property
    def needs_tokens(self) -> bool:
        """Whether the director must tokenize the prompt (prefix matches need its block hashes)."""
        return self.prompt_tokens or self.prefix_matches

    def __or__(self, other: Capabilities) -> Capabilities:
        return Capabilities(
            prompt_tokens=self.prompt_tokens or other.prompt_tokens,
            prefix_matches=self.prefix_matches or other.prefix_matches,
            accounting=self.accounting or other.accounting,
            fairness=self.fairness or other.fairness,
            disaggregated=self.disaggregated or other.disaggregated,
        )


NO_CAPABILITIES = Capabilities()


@dataclass(frozen=True, slots=True)
class PluginRef:
    """One plugin instance as metrics and explain name it: kind and type (bounded), and name."""

    kind: str  # filter, scorer, picker or strategy
    type_name: str
    name: str


PluginTiming = tuple[PluginRef, int]  # (plugin, nanoseconds it took in this decision)


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
    # Of in_flight_tokens, those routed within the pod's TTFT EWMA (stats.ttft_avg_s): still
    # expected to be queued or in prefill. None where TTFT is not measured (or not read).
    prefill_tokens: int | None = None

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
    # The candidate the request's session sticks to (SessionTokens.resolve: the pod its token
    # names, or the rendezvous pick for an id the client made up); None without a session id.
    session_id: str | None = None
    lora: str | None = None  # adapter name when `model` names a LoRA adapter
    priority: int = 0  # < 0 marks the request sheddable
    # Its latency targets in ms (read once with its other attributes, from its SLO headers).
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    headers: Mapping[str, str] = field(default_factory=lambda: EMPTY_LABELS)


class RoutingMemory:
    """Everything a rule carries from one decision to the next (round-robin's turn), keyed by
    the plugin's name. Plugins keep no such state themselves: the director owns one memory,
    hands it in every `Snapshot`, and hands `explain` a copy (as it does its random state), so
    explaining changes no later decision. A rule that needs more than a turn counter adds
    its kind of entry here, with `copy` copying it."""

    __slots__ = ("_turns",)

    def __init__(self) -> None:
        self._turns: dict[str, int] = {}

    def turn(self, key: str) -> int:
        """This decision's turn for `key` (0, 1, 2, ...), and advance it."""
        k = self._turns.get(key, 0)
        self._turns[key] = k + 1
        return k

    def copy(self) -> RoutingMemory:
        out = RoutingMemory()
        out._turns = dict(self._turns)
        return out


@dataclass(frozen=True, slots=True)
class Snapshot:
    now: float
    pods: Sequence[PodState]  # ready, fresh candidates for this request's model
    fairness: FairnessView | None = None
    # What decisions may change (RoutingMemory); a fresh one when not given (tests, one-offs).
    memory: RoutingMemory = field(default_factory=RoutingMemory)


class ProfileResult(NamedTuple):
    """One profile's ranking inside a decision that ran several (GAIE `ProfileRunResult`).

    A NamedTuple, not a frozen dataclass: it is built per decision, and builds 4x faster."""

    name: str  # PREFILL_PROFILE or DECODE_PROFILE for P/D
    ranked: tuple[Endpoint, ...]  # best first; empty when no candidate could serve the profile


@dataclass(frozen=True, slots=True)
class Decision:
    """Ranked endpoints: the first is the pick, the rest are retry fallbacks.

    A strategy that runs more than one profile (P/D: prefill and decode) lists each profile's
    ranking in `profiles`; `ranked` is then the primary (decode) profile's, plus fallbacks.
    """

    ranked: tuple[Endpoint, ...]
    strategy: str
    scores: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    reason: str = ""
    # Set by a session rule (`session-affinity`) to the pick's address: the client gets back
    # the pod's opaque token (SessionTokens), never the address.
    session_id: str | None = None
    profiles: tuple[ProfileResult, ...] = ()
    timings: tuple[PluginTiming, ...] = ()  # per plugin, in the order they ran

    @property
    def endpoint(self) -> Endpoint:
        return self.ranked[0]

    def profile(self, name: str) -> ProfileResult | None:
        return next((p for p in self.profiles if p.name == name), None)

    @property
    def disaggregated(self) -> bool:
        """True when the strategy split prefill from decode (whether or not a prefill pod was found)."""
        return self.profile(PREFILL_PROFILE) is not None

    @property
    def prefill(self) -> Endpoint | None:
        """Where to run the prefill first (P/D), or None: the pick does the whole request."""
        found = self.profile(PREFILL_PROFILE)
        return found.ranked[0] if found is not None and found.ranked else None


FilterResult = tuple[Sequence[PodState], str | None]  # kept pods, note (what it could not read)
# One value per pod: a float64 array (what the built-ins answer with), or a list.
ScoreValues = Sequence[float] | npt.NDArray[np.float64]
ScoreResult = tuple[ScoreValues, str | None]  # one score per pod in [0, 1], note


class Filter(Protocol):
    type_name: ClassVar[str]
    name: str

    @property
    def capabilities(self) -> Capabilities: ...

    def filter(self, req: RoutingRequest, pods: Sequence[PodState]) -> FilterResult:
        """The pods to keep (a subset of `pods`, in order), and a note or None."""
        ...


class Scorer(Protocol):
    type_name: ClassVar[str]
    name: str

    @property
    def capabilities(self) -> Capabilities: ...

    def score(self, req: RoutingRequest, pods: Sequence[PodState]) -> ScoreResult:
        """One score per pod, each in [0, 1] (higher is better), and a note or None.

        The note says which signal was missing and what was used instead; the profile copies
        it into `Decision.reason`.
        """
        ...


class Picker(Protocol):
    type_name: ClassVar[str]
    name: str

    @property
    def capabilities(self) -> Capabilities: ...

    def rank(self, totals: npt.NDArray[np.float64], rng: random.Random) -> npt.NDArray[np.intp]:
        """The positions of all pods by their `totals`, best first (the tail gives retry
        fallbacks)."""
        ...


class Strategy(Protocol):
    """A named routing rule: a registered strategy plugin or a profile.

    `capabilities` says what it reads: without `needs_tokens` the director skips tokenization
    (a chars/4 estimate fills `prompt_tokens`, labelled `tokens_estimated`).
    """

    name: str

    @property
    def capabilities(self) -> Capabilities: ...

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        """Pick for `req` among `snap.pods` (never empty: the director checks).

        The decision's `timings` should say how long each plugin took (`time.perf_counter_ns`).
        """
        ...


def uses_prompt_tokens(strategy: Strategy) -> bool:
    """Whether the director must tokenize the prompt for `strategy`."""
    return strategy.capabilities.needs_tokens
