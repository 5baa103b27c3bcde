"""Load-based strategies: random, round-robin, least-*, power-of-two, throughput, higress-gpu.

Each is a strategy plugin (type name, strict `Params`, declared capabilities) implementing
`Strategy` directly because its rule is an ordering, not a weighted sum. All of them rank every
candidate (the tail are Envoy retry fallbacks), break ties at random, and time themselves.
"""

from __future__ import annotations

import abc
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from extproc.routing.base import (
    NO_CAPABILITIES,
    Capabilities,
    Decision,
    PluginRef,
    ProfileResult,
    RoutingRequest,
    Snapshot,
)
from extproc.routing.columns import (
    FloatArray,
    IntArray,
    PodColumns,
    columns_of,
    predicted_latency_column,
    rank_order,
)
from extproc.routing.framework import EmptyParams, ScoreTable
from extproc.types import Endpoint

__all__ = [
    "HigressGpuParams",
    "HigressGpuStrategy",
    "LeastBusyTimeStrategy",
    "LeastKvCacheStrategy",
    "LeastLatencyStrategy",
    "LeastRequestStrategy",
    "LeastSignalStrategy",
    "PowerOfTwoStrategy",
    "RandomStrategy",
    "RoundRobinStrategy",
    "StrategyPlugin",
    "ThroughputStrategy",
    "all_but",
    "least_request",
    "least_request_at",
]


class StrategyPlugin:
    """Base of the built-in strategy plugins: `(name, params)`, and a timed `decision()`.

    A subclass sets `type_name`, `Params`, `capabilities` and implements `route`, calling
    `self.decision(started_ns, ...)` with `time.perf_counter_ns()` read when `route` began.
    Deriving from it is a convenience: the contract is the `Strategy` protocol.
    """

    type_name: ClassVar[str] = ""
    Params: ClassVar[type] = EmptyParams
    capabilities: ClassVar[Capabilities] = NO_CAPABILITIES

    def __init__(self, name: str = "", params: object = None) -> None:
        self.name = name or self.type_name
        self.ref = PluginRef("strategy", self.type_name, self.name)

    def decision(
        self,
        started_ns: int,
        ranked: tuple[Endpoint, ...],
        reason: str,
        scores: Mapping[str, Mapping[str, float]] | None = None,
        *,
        session_id: str | None = None,
        profiles: tuple[ProfileResult, ...] = (),
    ) -> Decision:
        """The decision ranking `ranked` (`PodColumns.endpoints_at`), timed from `started_ns`."""
        return Decision(
            ranked=ranked,
            strategy=self.name,
            scores=scores or {},
            reason=reason,
            session_id=session_id,
            profiles=profiles,
            timings=((self.ref, time.perf_counter_ns() - started_ns),),
        )


def least_request(cols: PodColumns, rng: random.Random) -> IntArray:
    """Every pod by fewest in-flight requests, ties at random."""
    return rank_order([cols.in_flight], rng)


def least_request_at(cols: PodColumns, at: IntArray, rng: random.Random) -> IntArray:
    """The pods at `at` (indices into `cols`) by fewest in-flight requests, ties at random."""
    return at[rank_order([cols.in_flight[at]], rng)]


def all_but(cols: PodColumns, taken: IntArray | list[int]) -> IntArray:
    """The indices of every pod but those in `taken`, in pod order."""
    free = np.ones(cols.n, dtype=np.bool_)
    free[taken] = False
    return free.nonzero()[0]


class RandomStrategy(StrategyPlugin):
    """AIBrix `random`: uniform order."""

    type_name = "random"

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        t0 = time.perf_counter_ns()
        order = list(range(len(snap.pods)))
        rng.shuffle(order)
        return self.decision(t0, columns_of(snap.pods).endpoints_at(order), "uniform random")


class RoundRobinStrategy(StrategyPlugin):
    """Dynamo/production-stack round robin over candidates sorted by address.

    The turn lives in the snapshot's `RoutingMemory` (explain gets a copy, so it does not
    advance the live turn); it is taken synchronously (no await inside `route`), so concurrent
    calls from one event loop never interleave.
    """

    type_name = "round-robin"

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        t0 = time.perf_counter_ns()
        cols = columns_of(snap.pods)
        k = snap.memory.turn(self.name) % cols.n
        order = cols.address_order()
        ranked = np.concatenate((order[k:], order[:k]))
        return self.decision(t0, cols.endpoints_at(ranked), f"turn {k} of {cols.n}")


class PowerOfTwoStrategy(StrategyPlugin):
    """Two random candidates, the one with fewer in-flight requests (then fewer running) wins."""

    type_name = "power-of-two"

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        t0 = time.perf_counter_ns()
        cols = columns_of(snap.pods)
        if cols.n == 1:
            return self.decision(t0, cols.endpoints_at([0]), "single candidate")
        a, b = rng.sample(range(cols.n), 2)
        la, lb = self._load(cols, a), self._load(cols, b)
        first, second = (a, b) if la < lb or (la == lb and rng.random() < 0.5) else (b, a)
        reason = (
            f"sampled {cols.address(a)} (in_flight {la[0]:g}) "
            f"vs {cols.address(b)} (in_flight {lb[0]:g})"
        )
        others = all_but(cols, [a, b])
        ranked = np.concatenate(((first, second), least_request_at(cols, others, rng)))
        return self.decision(t0, cols.endpoints_at(ranked), reason)

    @staticmethod
    def _load(cols: PodColumns, i: int) -> tuple[float, float]:
        """(in-flight, running) of the pod at `i`; running 0 where unknown."""
        running = float(cols.running[i])
        return float(cols.in_flight[i]), running if running == running else 0.0


class LeastSignalStrategy(StrategyPlugin, abc.ABC):
    """Lowest value of one signal wins; ties go to fewer in-flight requests, then random.

    Pods lacking the signal rank after those that have it; if no pod has it, the order is
    least-request on the gateway's in-flight counts, and the reason says so. A subclass sets
    `label` and `column` (and `no_data` when an all-zero signal means "nothing measured yet").
    """

    label: ClassVar[str] = ""

    @abc.abstractmethod
    def column(self, req: RoutingRequest, cols: PodColumns) -> FloatArray:
        """The signal of every pod, NaN where it is unknown."""

    def no_data(self, cols: PodColumns) -> str | None:
        return None

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        t0 = time.perf_counter_ns()
        label = self.label
        cols = columns_of(snap.pods)
        values, loads = self.column(req, cols), cols.in_flight
        unknown_mask = values != values  # NaN
        unknown_count = np.count_nonzero(unknown_mask)
        if unknown_count == cols.n:
            reason = f"{label} unknown on every pod; used least-request (gateway in-flight)"
            return self.decision(t0, cols.endpoints_at(least_request(cols, rng)), reason)
        reason = f"min {label}"
        if unknown_count:
            known = (~unknown_mask).nonzero()[0]
            unknown = unknown_mask.nonzero()[0]
            values, loads = values[known], loads[known]
            ranked = np.concatenate(
                (known[rank_order([values, loads], rng)], least_request_at(cols, unknown, rng))
            )
            reason += f"; {label} unknown on {cols.addresses_text(unknown)} (ranked last)"
            scores = ScoreTable(cols.addresses, (label, "in_flight"), (values, loads), at=known)
        else:
            ranked = rank_order([values, loads], rng)
            scores = ScoreTable(cols.addresses, (label, "in_flight"), (values, loads))
        if extra := self.no_data(cols):
            reason += f"; {extra}"
        return self.decision(t0, cols.endpoints_at(ranked), reason, scores)


def _no_accounting(cols: PodColumns) -> str | None:
    if not np.count_nonzero(cols.requests_total):
        return "no request finished yet on any pod: all equal, tie broken by in-flight"
    return None


class LeastRequestStrategy(LeastSignalStrategy):
    """AIBrix least-request: min gateway in-flight count, random tie-break."""

    type_name = "least-request"
    label = "in_flight"

    def column(self, req: RoutingRequest, cols: PodColumns) -> FloatArray:
        return cols.in_flight


class LeastKvCacheStrategy(LeastSignalStrategy):
    """AIBrix least-kv-cache: min KV usage (vLLM exports no separate CPU cache usage in V1)."""

    type_name = "least-kv-cache"
    label = "kv_cache_usage"

    def column(self, req: RoutingRequest, cols: PodColumns) -> FloatArray:
        return cols.kv_usage


class LeastBusyTimeStrategy(LeastSignalStrategy):
    """AIBrix least-busy-time, with busy time measured by our accounting (vLLM has no metric)."""

    type_name = "least-busy-time"
    label = "busy_time_s"
    capabilities = Capabilities(accounting=True)

    def column(self, req: RoutingRequest, cols: PodColumns) -> FloatArray:
        return cols.busy_time

    def no_data(self, cols: PodColumns) -> str | None:
        return _no_accounting(cols)


class ThroughputStrategy(LeastSignalStrategy):
    """AIBrix throughput: least token work, from our accounting's tokens/s EWMA (no PromQL)."""

    type_name = "throughput"
    label = "throughput_tokens_per_s"
    capabilities = Capabilities(accounting=True)

    def column(self, req: RoutingRequest, cols: PodColumns) -> FloatArray:
        return cols.throughput

    def no_data(self, cols: PodColumns) -> str | None:
        return _no_accounting(cols)


class LeastLatencyStrategy(LeastSignalStrategy):
    """AIBrix least-latency: min predicted ttft + tpot * expected output tokens."""

    type_name = "least-latency"
    label = "predicted_latency_s"
    capabilities = Capabilities(accounting=True)

    def column(self, req: RoutingRequest, cols: PodColumns) -> FloatArray:
        return predicted_latency_column(req, cols)


# ---------------------------------------------------------------- higress


@dataclass(frozen=True, slots=True)
class HigressGpuParams:
    kv_cache_threshold: float = 0.8
    queue_threshold_critical: float = 5.0
    queueing_threshold_lora: float = 50.0


class HigressGpuStrategy(StrategyPlugin):
    """Higress `endpoint_metrics` default policy: the GAIE v0.x filter tree, then a random pick.

    Critical requests: low queue (< queueing_threshold_lora) -> LoRA affinity -> least queue ->
    least KV; if no pod has a low queue: least queue -> LoRA affinity -> least KV. Sheddable
    requests (priority < 0) first need queue <= critical threshold and KV <= kv threshold.
    "least" keeps pods within min + (max - min) / n of the best value, as GAIE v0 does.
    """

    type_name = "higress-gpu"
    Params: ClassVar[type] = HigressGpuParams

    def __init__(self, name: str = "", params: HigressGpuParams | None = None) -> None:
        super().__init__(name, params)
        self.params = params or HigressGpuParams()

    @staticmethod
    def _least(at: IntArray, values: FloatArray) -> IntArray:
        """The pods at `at` whose value is within min + (max - min) / n of the least."""
        vals = values[at]
        lo, hi = vals.min(), vals.max()
        bound = lo + (hi - lo) / len(at)
        kept: IntArray = at[vals <= bound]
        return kept

    @staticmethod
    def _lora(req: RoutingRequest, cols: PodColumns, at: IntArray) -> IntArray:
        """The pods at `at` running the adapter, else those with a free slot, else all."""
        if req.lora is None:
            return at
        states = cols.lora_states(req.lora)[at]
        for wanted in (1.0, 0.8):
            hit: IntArray = at[states == wanted]
            if len(hit):
                return hit
        return at

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        t0 = time.perf_counter_ns()
        prm = self.params
        cols = columns_of(snap.pods)
        waiting, kv_usage = cols.waiting, cols.kv_usage
        unknown_mask = (waiting != waiting) | (kv_usage != kv_usage)  # NaN: not exported
        unknown_count = np.count_nonzero(unknown_mask)
        if unknown_count == cols.n:
            return self.decision(
                t0,
                cols.endpoints_at(least_request(cols, rng)),
                "queue/KV metrics unknown on every pod; used least-request",
            )
        known = (~unknown_mask).nonzero()[0] if unknown_count else np.arange(cols.n)
        notes = []
        pool = known
        if req.priority < 0:
            ok = known[
                (waiting[known] <= prm.queue_threshold_critical)
                & (kv_usage[known] <= prm.kv_cache_threshold)
            ]
            if len(ok):
                pool = ok
            else:
                notes.append(
                    "sheddable request and every pod over thresholds (admission should shed)"
                )
        low = pool[waiting[pool] < prm.queueing_threshold_lora]
        if len(low):
            chosen = self._least(self._least(self._lora(req, cols, low), waiting), kv_usage)
            notes.insert(0, "low-queue branch")
        else:
            chosen = self._least(self._lora(req, cols, self._least(pool, waiting)), kv_usage)
            notes.insert(0, "all queues high: least-queue branch")
        head = chosen.tolist()
        rng.shuffle(head)
        free = ~unknown_mask
        free[chosen] = False
        others = free.nonzero()[0]
        parts = [
            np.array(head, dtype=np.intp),
            others[rank_order([waiting[others], kv_usage[others]], rng)],
        ]
        if unknown_count:
            unknown = unknown_mask.nonzero()[0]
            parts.append(least_request_at(cols, unknown, rng))
            notes.append(f"metrics unknown on {cols.addresses_text(unknown)} (ranked last)")
            scores = ScoreTable(
                cols.addresses,
                ("waiting", "kv_cache_usage"),
                (waiting[known], kv_usage[known]),
                at=known,
            )
        else:
            scores = ScoreTable(cols.addresses, ("waiting", "kv_cache_usage"), (waiting, kv_usage))
        return self.decision(t0, cols.endpoints_at(np.concatenate(parts)), "; ".join(notes), scores)
