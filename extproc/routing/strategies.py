"""Load-based strategies: random, round-robin, least-*, power-of-two, throughput, higress-gpu.

Each is a strategy plugin (type name, strict `Params`, declared capabilities) implementing
`Strategy` directly because its rule is an ordering, not a weighted sum. All of them rank every
candidate (the tail are Envoy retry fallbacks), break ties at random, and time themselves.
"""

from __future__ import annotations

import abc
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from extproc.routing import signals
from extproc.routing.base import (
    NO_CAPABILITIES,
    Capabilities,
    Decision,
    PluginRef,
    PodState,
    ProfileResult,
    RoutingRequest,
    Snapshot,
)
from extproc.routing.columns import (
    FloatArray,
    IntArray,
    PodColumns,
    columns_of,
    is_table,
    predicted_latency_column,
    rank_order,
    vectorised,
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
        ranked: Sequence[PodState],
        reason: str,
        scores: Mapping[str, Mapping[str, float]] | None = None,
        *,
        session_id: str | None = None,
        profiles: tuple[ProfileResult, ...] = (),
    ) -> Decision:
        return self.decision_of(
            started_ns,
            tuple([p.endpoint for p in ranked]),
            reason,
            scores,
            session_id=session_id,
            profiles=profiles,
        )

    def decision_of(
        self,
        started_ns: int,
        ranked: tuple[Endpoint, ...],
        reason: str,
        scores: Mapping[str, Mapping[str, float]] | None = None,
        *,
        session_id: str | None = None,
        profiles: tuple[ProfileResult, ...] = (),
    ) -> Decision:
        """`decision` with the endpoints already ranked (a vectorised rule's `endpoints_at`)."""
        return Decision(
            ranked=ranked,
            strategy=self.name,
            scores=scores or {},
            reason=reason,
            session_id=session_id,
            profiles=profiles,
            timings=((self.ref, time.perf_counter_ns() - started_ns),),
        )


def _least_request_order(pods: Sequence[PodState], rng: random.Random) -> list[PodState]:
    return signals.rank_by(pods, lambda p: (float(p.in_flight),), rng)


def least_request_at(cols: PodColumns, at: IntArray, rng: random.Random) -> IntArray:
    """`_least_request_order` of the pods at `at` (indices into `cols`), as indices."""
    return at[rank_order([cols.in_flight[at]], rng)]


class RandomStrategy(StrategyPlugin):
    """AIBrix `random`: uniform order."""

    type_name = "random"

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        t0 = time.perf_counter_ns()
        if is_table(snap.pods):  # shuffle indices: the same draws, no row built
            order = list(range(len(snap.pods)))
            rng.shuffle(order)
            return self.decision_of(t0, snap.pods.columns.endpoints_at(order), "uniform random")
        pods = list(snap.pods)
        rng.shuffle(pods)
        return self.decision(t0, pods, "uniform random")


class RoundRobinStrategy(StrategyPlugin):
    """Dynamo/production-stack round robin over candidates sorted by address.

    The turn lives in the snapshot's `RoutingMemory` (explain gets a copy, so it does not
    advance the live turn); it is taken synchronously (no await inside `route`), so concurrent
    calls from one event loop never interleave.
    """

    type_name = "round-robin"

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        t0 = time.perf_counter_ns()
        n = len(snap.pods)
        k = snap.memory.turn(self.name) % n
        if is_table(snap.pods):  # sort indices by the address column: no row built
            cols = snap.pods.columns
            order = cols.address_order().tolist()
            return self.decision_of(
                t0, cols.endpoints_at(order[k:] + order[:k]), f"turn {k} of {n}"
            )
        pods = sorted(snap.pods, key=lambda p: p.address)
        ranked = pods[k:] + pods[:k]
        return self.decision(t0, ranked, f"turn {k} of {n}")


class PowerOfTwoStrategy(StrategyPlugin):
    """Two random candidates, the one with fewer in-flight requests (then fewer running) wins."""

    type_name = "power-of-two"

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        t0 = time.perf_counter_ns()
        if len(snap.pods) == 1:
            return self.decision(t0, snap.pods, "single candidate")
        if vectorised(snap.pods):
            return self._route_columns(snap.pods, rng, t0)
        pods = list(snap.pods)
        a, b = rng.sample(pods, 2)
        first, second, reason = self._pair(a, b, rng)
        rest = _least_request_order([p for p in pods if p is not a and p is not b], rng)
        return self.decision(t0, [first, second, *rest], reason)

    def _route_columns(self, pods: Sequence[PodState], rng: random.Random, t0: int) -> Decision:
        """`route` reading two rows: sampling indices draws as sampling the pods does."""
        ia, ib = rng.sample(range(len(pods)), 2)
        first, second, reason = self._pair(pods[ia], pods[ib], rng)
        cols = columns_of(pods)
        others = np.delete(np.arange(cols.n), (ia, ib))
        tail = cols.endpoints_at(least_request_at(cols, others, rng))
        return self.decision_of(t0, (first.endpoint, second.endpoint, *tail), reason)

    @staticmethod
    def _pair(a: PodState, b: PodState, rng: random.Random) -> tuple[PodState, PodState, str]:
        """The two sampled pods, the less loaded first, and the reason."""

        def load(p: PodState) -> tuple[float, float]:
            r = signals.running(p)
            return (float(p.in_flight), r if r is not None else 0.0)

        la, lb = load(a), load(b)
        first, second = (a, b) if la < lb or (la == lb and rng.random() < 0.5) else (b, a)
        reason = f"sampled {a.address} (in_flight {la[0]:g}) vs {b.address} (in_flight {lb[0]:g})"
        return first, second, reason


class LeastSignalStrategy(StrategyPlugin, abc.ABC):
    """Lowest value of one signal wins; ties go to fewer in-flight requests, then random.

    Pods lacking the signal rank after those that have it; if no pod has it, the order is
    least-request on the gateway's in-flight counts, and the reason says so. A subclass sets
    `label` and `signal` (and `no_data` when an all-zero signal means "nothing measured yet").
    """

    label: ClassVar[str] = ""

    @abc.abstractmethod
    def signal(self, req: RoutingRequest, p: PodState) -> float | None:
        """This pod's value of the signal, None where it is unknown."""

    @abc.abstractmethod
    def column(self, req: RoutingRequest, cols: PodColumns) -> FloatArray:
        """`signal` for every pod at once, NaN where it is None."""

    def no_data(self, pods: Sequence[PodState]) -> str | None:
        return None

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        t0 = time.perf_counter_ns()
        if vectorised(snap.pods):
            return self._route_columns(req, snap, rng, t0)
        label = self.label
        values = [(p, self.signal(req, p)) for p in snap.pods]
        known = [(p, v) for p, v in values if v is not None]
        unknown = [p for p, v in values if v is None]
        scores = {p.address: {label: v, "in_flight": float(p.in_flight)} for p, v in known}
        if not known:
            ranked = _least_request_order(snap.pods, rng)
            reason = f"{label} unknown on every pod; used least-request (gateway in-flight)"
            return self.decision(t0, ranked, reason)
        vmap = {id(p): v for p, v in known}
        head = signals.rank_by(
            [p for p, _ in known], lambda p: (vmap[id(p)], float(p.in_flight)), rng
        )
        ranked = head + _least_request_order(unknown, rng)
        reason = f"min {label}"
        if unknown:
            reason += f"; {label} unknown on {signals.addresses(unknown)} (ranked last)"
        if extra := self.no_data(snap.pods):
            reason += f"; {extra}"
        return self.decision(t0, ranked, reason, scores)

    def _route_columns(
        self, req: RoutingRequest, snap: Snapshot, rng: random.Random, t0: int
    ) -> Decision:
        label = self.label
        cols = columns_of(snap.pods)
        values = self.column(req, cols)
        unknown_mask = np.isnan(values)
        known = np.flatnonzero(~unknown_mask)
        if not len(known):
            ranked = least_request_at(cols, np.arange(cols.n), rng)
            reason = f"{label} unknown on every pod; used least-request (gateway in-flight)"
            return self.decision_of(t0, cols.endpoints_at(ranked), reason)
        unknown = np.flatnonzero(unknown_mask)
        vals, loads = values[known], cols.in_flight[known]
        head = known[rank_order([vals, loads], rng)]
        tail = least_request_at(cols, unknown, rng)
        reason = f"min {label}"
        if len(unknown):
            reason += f"; {label} unknown on {signals.addresses(cols.take(unknown))} (ranked last)"
        if extra := self.no_data_columns(cols):
            reason += f"; {extra}"
        scores = ScoreTable(cols.rows(known), (label, "in_flight"), (vals, loads))
        return self.decision_of(t0, cols.endpoints_at(np.concatenate((head, tail))), reason, scores)

    def no_data_columns(self, cols: PodColumns) -> str | None:
        """`no_data` read from the columns."""
        return None


_NO_ACCOUNTING = "no request finished yet on any pod: all equal, tie broken by in-flight"


def _no_accounting(pods: Sequence[PodState]) -> str | None:
    if all(p.stats.requests_total == 0 for p in pods):
        return _NO_ACCOUNTING
    return None


def _no_accounting_columns(cols: PodColumns) -> str | None:
    return _NO_ACCOUNTING if not cols.requests_total.any() else None


class LeastRequestStrategy(LeastSignalStrategy):
    """AIBrix least-request: min gateway in-flight count, random tie-break."""

    type_name = "least-request"
    label = "in_flight"

    def signal(self, req: RoutingRequest, p: PodState) -> float | None:
        return float(p.in_flight)

    def column(self, req: RoutingRequest, cols: PodColumns) -> FloatArray:
        return cols.in_flight


class LeastKvCacheStrategy(LeastSignalStrategy):
    """AIBrix least-kv-cache: min KV usage (vLLM exports no separate CPU cache usage in V1)."""

    type_name = "least-kv-cache"
    label = "kv_cache_usage"

    def signal(self, req: RoutingRequest, p: PodState) -> float | None:
        return signals.kv_usage(p)

    def column(self, req: RoutingRequest, cols: PodColumns) -> FloatArray:
        return cols.kv_usage


class LeastBusyTimeStrategy(LeastSignalStrategy):
    """AIBrix least-busy-time, with busy time measured by our accounting (vLLM has no metric)."""

    type_name = "least-busy-time"
    label = "busy_time_s"
    capabilities = Capabilities(accounting=True)

    def signal(self, req: RoutingRequest, p: PodState) -> float | None:
        return p.stats.busy_time_s

    def column(self, req: RoutingRequest, cols: PodColumns) -> FloatArray:
        return cols.busy_time

    def no_data(self, pods: Sequence[PodState]) -> str | None:
        return _no_accounting(pods)

    def no_data_columns(self, cols: PodColumns) -> str | None:
        return _no_accounting_columns(cols)


class ThroughputStrategy(LeastSignalStrategy):
    """AIBrix throughput: least token work, from our accounting's tokens/s EWMA (no PromQL)."""

    type_name = "throughput"
    label = "throughput_tokens_per_s"
    capabilities = Capabilities(accounting=True)

    def signal(self, req: RoutingRequest, p: PodState) -> float | None:
        return p.stats.throughput_tokens_per_s

    def column(self, req: RoutingRequest, cols: PodColumns) -> FloatArray:
        return cols.throughput

    def no_data(self, pods: Sequence[PodState]) -> str | None:
        return _no_accounting(pods)

    def no_data_columns(self, cols: PodColumns) -> str | None:
        return _no_accounting_columns(cols)


class LeastLatencyStrategy(LeastSignalStrategy):
    """AIBrix least-latency: min predicted ttft + tpot * expected output tokens."""

    type_name = "least-latency"
    label = "predicted_latency_s"
    capabilities = Capabilities(accounting=True)

    def signal(self, req: RoutingRequest, p: PodState) -> float | None:
        return signals.predicted_latency_s(req, p)[0]

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
    def _least(pods: list[PodState], get: Callable[[PodState], float]) -> list[PodState]:
        vals = [get(p) for p in pods]
        lo, hi = min(vals), max(vals)
        bound = lo + (hi - lo) / len(pods)
        return [p for p, v in zip(pods, vals, strict=True) if v <= bound]

    @staticmethod
    def _lora(req: RoutingRequest, pods: list[PodState]) -> list[PodState]:
        if req.lora is None:
            return pods
        states = [(p, signals.lora_state(req, p)) for p in pods]
        for wanted in (1.0, 0.8):
            hit = [p for p, s in states if s == wanted]
            if hit:
                return hit
        return pods

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        t0 = time.perf_counter_ns()
        if vectorised(snap.pods):
            return self._route_columns(req, snap, rng, t0)
        prm = self.params
        known = [
            p
            for p in snap.pods
            if signals.waiting(p) is not None and signals.kv_usage(p) is not None
        ]
        known_ids = {id(p) for p in known}
        unknown = [p for p in snap.pods if id(p) not in known_ids]
        if not known:
            ranked = _least_request_order(snap.pods, rng)
            return self.decision(
                t0, ranked, "queue/KV metrics unknown on every pod; used least-request"
            )

        def q(p: PodState) -> float:
            return signals.waiting(p) or 0.0

        def kv(p: PodState) -> float:
            return signals.kv_usage(p) or 0.0

        notes = []
        pool = known
        if req.priority < 0:
            ok = [
                p
                for p in known
                if q(p) <= prm.queue_threshold_critical and kv(p) <= prm.kv_cache_threshold
            ]
            if ok:
                pool = ok
            else:
                notes.append(
                    "sheddable request and every pod over thresholds (admission should shed)"
                )
        low = [p for p in pool if q(p) < prm.queueing_threshold_lora]
        if low:
            chosen = self._least(self._least(self._lora(req, low), q), kv)
            notes.insert(0, "low-queue branch")
        else:
            chosen = self._least(self._lora(req, self._least(pool, q)), kv)
            notes.insert(0, "all queues high: least-queue branch")
        head = list(chosen)
        rng.shuffle(head)
        chosen_ids = {id(p) for p in chosen}
        rest = signals.rank_by(
            [p for p in known if id(p) not in chosen_ids], lambda p: (q(p), kv(p)), rng
        )
        rest += _least_request_order(unknown, rng)
        if unknown:
            notes.append(f"metrics unknown on {signals.addresses(unknown)} (ranked last)")
        scores = {p.address: {"waiting": q(p), "kv_cache_usage": kv(p)} for p in known}
        return self.decision(t0, head + rest, "; ".join(notes), scores)

    @staticmethod
    def _least_at(at: IntArray, values: FloatArray) -> IntArray:
        """`_least` on the pods at `at`, as indices."""
        vals = values[at]
        lo, hi = vals.min(), vals.max()
        bound = lo + (hi - lo) / len(at)
        kept: IntArray = at[vals <= bound]
        return kept

    @staticmethod
    def _lora_at(req: RoutingRequest, cols: PodColumns, at: IntArray) -> IntArray:
        if req.lora is None:
            return at
        states = cols.lora_states(req.lora)[at]
        for wanted in (1.0, 0.8):
            hit: IntArray = at[states == wanted]
            if len(hit):
                return hit
        return at

    def _route_columns(
        self, req: RoutingRequest, snap: Snapshot, rng: random.Random, t0: int
    ) -> Decision:
        prm = self.params
        cols = columns_of(snap.pods)
        waiting, kv_usage = cols.waiting, cols.kv_usage
        known_mask = ~np.isnan(waiting) & ~np.isnan(kv_usage)
        known = np.flatnonzero(known_mask)
        unknown = np.flatnonzero(~known_mask)
        if not len(known):
            ranked = least_request_at(cols, np.arange(cols.n), rng)
            return self.decision_of(
                t0,
                cols.endpoints_at(ranked),
                "queue/KV metrics unknown on every pod; used least-request",
            )
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
            chosen = self._least_at(
                self._least_at(self._lora_at(req, cols, low), waiting), kv_usage
            )
            notes.insert(0, "low-queue branch")
        else:
            chosen = self._least_at(
                self._lora_at(req, cols, self._least_at(pool, waiting)), kv_usage
            )
            notes.insert(0, "all queues high: least-queue branch")
        head = chosen.tolist()
        rng.shuffle(head)
        taken = np.zeros(cols.n, dtype=bool)
        taken[chosen] = True
        others = known[~taken[known]]
        rest = others[rank_order([waiting[others], kv_usage[others]], rng)]
        tail = least_request_at(cols, unknown, rng)
        if len(unknown):
            notes.append(
                f"metrics unknown on {signals.addresses(cols.take(unknown))} (ranked last)"
            )
        scores = ScoreTable(
            cols.rows(known), ("waiting", "kv_cache_usage"), (waiting[known], kv_usage[known])
        )
        ranked = np.concatenate((np.array(head, dtype=np.intp), rest, tail))
        return self.decision_of(t0, cols.endpoints_at(ranked), "; ".join(notes), scores)
