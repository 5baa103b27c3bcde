"""Load-based strategies: random, round-robin, least-*, power-of-two, throughput, higress-gpu.

Each implements `Strategy` directly because its rule is an ordering, not a weighted sum.
All of them rank every candidate (the tail are Envoy retry fallbacks) and break ties at random.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from extproc.routing import signals
from extproc.routing.base import Decision, PodState, RoutingRequest, Snapshot

__all__ = [
    "HigressGpuParams",
    "HigressGpuStrategy",
    "LeastSignalStrategy",
    "PowerOfTwoStrategy",
    "RandomStrategy",
    "RoundRobinStrategy",
    "decision",
    "least_busy_time",
    "least_kv_cache",
    "least_latency",
    "least_request",
    "throughput",
]


def decision(
    name: str,
    ranked: Sequence[PodState],
    reason: str,
    scores: dict[str, dict[str, float]] | None = None,
) -> Decision:
    return Decision(
        ranked=tuple(p.endpoint for p in ranked),
        strategy=name,
        scores=scores or {},
        reason=reason,
    )


def _least_request_order(pods: Sequence[PodState], rng: random.Random) -> list[PodState]:
    return signals.rank_by(pods, lambda p: (float(p.in_flight),), rng)


class RandomStrategy:
    """AIBrix `random`: uniform order."""

    uses_prompt_tokens = False  # reads load signals only

    def __init__(self, name: str = "random") -> None:
        self.name = name

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        pods = list(snap.pods)
        rng.shuffle(pods)
        return decision(self.name, pods, "uniform random")


class RoundRobinStrategy:
    """Dynamo/production-stack round robin over candidates sorted by address.

    The counter is advanced synchronously (no await inside `route`), so concurrent calls from
    one event loop never interleave.
    """

    uses_prompt_tokens = False  # reads load signals only

    def __init__(self, name: str = "round-robin") -> None:
        self.name = name
        self._counter = itertools.count()

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        pods = sorted(snap.pods, key=lambda p: p.address)
        k = next(self._counter) % len(pods)
        ranked = pods[k:] + pods[:k]
        return decision(self.name, ranked, f"turn {k} of {len(pods)}")


class PowerOfTwoStrategy:
    """Two random candidates, the one with fewer in-flight requests (then fewer running) wins."""

    uses_prompt_tokens = False  # reads load signals only

    def __init__(self, name: str = "power-of-two") -> None:
        self.name = name

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        pods = list(snap.pods)
        if len(pods) == 1:
            return decision(self.name, pods, "single candidate")
        a, b = rng.sample(pods, 2)

        def load(p: PodState) -> tuple[float, float]:
            r = signals.running(p)
            return (float(p.in_flight), r if r is not None else 0.0)

        la, lb = load(a), load(b)
        first, second = (a, b) if la < lb or (la == lb and rng.random() < 0.5) else (b, a)
        rest = _least_request_order([p for p in pods if p is not a and p is not b], rng)
        reason = f"sampled {a.address} (in_flight {la[0]:g}) vs {b.address} (in_flight {lb[0]:g})"
        return decision(self.name, [first, second, *rest], reason)


Signal = Callable[[RoutingRequest, PodState], float | None]


class LeastSignalStrategy:
    """Lowest value of one signal wins; ties go to fewer in-flight requests, then random.

    Pods lacking the signal rank after those that have it; if no pod has it, the order is
    least-request on the gateway's in-flight counts, and the reason says so.
    """

    uses_prompt_tokens = False  # reads load signals only

    def __init__(
        self,
        name: str,
        signal: Signal,
        label: str,
        no_data: Callable[[Sequence[PodState]], str | None] | None = None,
    ) -> None:
        self.name = name
        self._signal = signal
        self._label = label
        self._no_data = no_data

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        values = [(p, self._signal(req, p)) for p in snap.pods]
        known = [(p, v) for p, v in values if v is not None]
        unknown = [p for p, v in values if v is None]
        scores = {p.address: {self._label: v, "in_flight": float(p.in_flight)} for p, v in known}
        if not known:
            ranked = _least_request_order(snap.pods, rng)
            reason = f"{self._label} unknown on every pod; used least-request (gateway in-flight)"
            return decision(self.name, ranked, reason)
        vmap = {id(p): v for p, v in known}
        head = signals.rank_by(
            [p for p, _ in known], lambda p: (vmap[id(p)], float(p.in_flight)), rng
        )
        ranked = head + _least_request_order(unknown, rng)
        reason = f"min {self._label}"
        if unknown:
            reason += f"; {self._label} unknown on {signals.addresses(unknown)} (ranked last)"
        if self._no_data is not None and (extra := self._no_data(snap.pods)):
            reason += f"; {extra}"
        return decision(self.name, ranked, reason, scores)


def _kv(req: RoutingRequest, p: PodState) -> float | None:
    return signals.kv_usage(p)


def _busy(req: RoutingRequest, p: PodState) -> float | None:
    return p.stats.busy_time_s


def _tput(req: RoutingRequest, p: PodState) -> float | None:
    return p.stats.throughput_tokens_per_s


def _latency(req: RoutingRequest, p: PodState) -> float | None:
    return signals.predicted_latency_s(req, p)[0]


def _in_flight(req: RoutingRequest, p: PodState) -> float | None:
    return float(p.in_flight)


def _no_accounting(pods: Sequence[PodState]) -> str | None:
    if all(p.stats.requests_total == 0 for p in pods):
        return "no request finished yet on any pod: all equal, tie broken by in-flight"
    return None


def least_request(name: str = "least-request") -> LeastSignalStrategy:
    """AIBrix least-request: min gateway in-flight count, random tie-break."""
    return LeastSignalStrategy(name, _in_flight, "in_flight")


def least_kv_cache(name: str = "least-kv-cache") -> LeastSignalStrategy:
    """AIBrix least-kv-cache: min KV usage (vLLM exports no separate CPU cache usage in V1)."""
    return LeastSignalStrategy(name, _kv, "kv_cache_usage")


def least_busy_time(name: str = "least-busy-time") -> LeastSignalStrategy:
    """AIBrix least-busy-time, with busy time measured by our accounting (vLLM has no metric)."""
    return LeastSignalStrategy(name, _busy, "busy_time_s", _no_accounting)


def throughput(name: str = "throughput") -> LeastSignalStrategy:
    """AIBrix throughput: least token work, from our accounting's tokens/s EWMA (no PromQL)."""
    return LeastSignalStrategy(name, _tput, "throughput_tokens_per_s", _no_accounting)


def least_latency(name: str = "least-latency") -> LeastSignalStrategy:
    """AIBrix least-latency: min predicted ttft + tpot * expected output tokens."""
    return LeastSignalStrategy(name, _latency, "predicted_latency_s")


# ---------------------------------------------------------------- higress


@dataclass(frozen=True, slots=True)
class HigressGpuParams:
    kv_cache_threshold: float = 0.8
    queue_threshold_critical: float = 5.0
    queueing_threshold_lora: float = 50.0


class HigressGpuStrategy:
    """Higress `endpoint_metrics` default policy: the GAIE v0.x filter tree, then a random pick.

    Critical requests: low queue (< queueing_threshold_lora) -> LoRA affinity -> least queue ->
    least KV; if no pod has a low queue: least queue -> LoRA affinity -> least KV. Sheddable
    requests (priority < 0) first need queue <= critical threshold and KV <= kv threshold.
    "least" keeps pods within min + (max - min) / n of the best value, as GAIE v0 does.
    """

    uses_prompt_tokens = False  # reads load signals only

    def __init__(self, name: str = "higress-gpu", params: HigressGpuParams | None = None) -> None:
        self.name = name
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
            return decision(
                self.name, ranked, "queue/KV metrics unknown on every pod; used least-request"
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
        return decision(self.name, head + rest, "; ".join(notes), scores)
