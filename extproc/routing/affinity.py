"""Cache-, user- and role-aware strategies: prefix-cache, prefix-cache-preble, kv-aware,
vtc-basic, pd and session-affinity. Rules and defaults follow docs/strategies.md.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

import numpy as np

from extproc.routing import signals
from extproc.routing.base import (
    DECODE_PROFILE,
    PREFILL_PROFILE,
    Capabilities,
    Decision,
    PodState,
    ProfileResult,
    RoutingRequest,
    Snapshot,
)
from extproc.routing.columns import (
    CHEAP_RULE,
    COSTLY_RULE,
    FloatArray,
    IntArray,
    PodColumns,
    columns_of,
    draws,
    rank_order,
    vectorised,
)
from extproc.routing.framework import ScoreTable
from extproc.routing.strategies import StrategyPlugin, least_request_at
from extproc.types import EndpointRole

__all__ = [
    "DECODING_WEIGHT",
    "KvAwareDynamoParams",
    "KvAwareDynamoStrategy",
    "KvAwareParams",
    "KvAwareStrategy",
    "LoadShare",
    "PdParams",
    "PdStrategy",
    "PrebleParams",
    "PrebleStrategy",
    "PrefixCacheParams",
    "PrefixCacheStrategy",
    "SessionAffinityStrategy",
    "VtcParams",
    "VtcStrategy",
    "load_tokens",
]


def _least_request(pods: Sequence[PodState], rng: random.Random) -> list[PodState]:
    return signals.rank_by(pods, lambda p: (float(p.in_flight),), rng)


def _imbalance_guard(pods: Sequence[PodState], abs_count: int) -> tuple[list[PodState], str | None]:
    """AIBrix: if the in-flight spread exceeds `abs_count`, only the least-loaded pods are candidates."""
    loads = [p.in_flight for p in pods]
    lo, hi = min(loads), max(loads)
    if hi - lo > abs_count:
        return [
            p for p in pods if p.in_flight == lo
        ], f"load imbalance (spread {hi - lo} > {abs_count}): least-loaded only"
    return list(pods), None


def _mean_plus_std(values: Sequence[float], k: float) -> float:
    """mean + k * population stddev (plain floats: the statistics module is ~10x slower)."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / n
    return mean + k * math.sqrt(var)


def _match_pct(req: RoutingRequest, p: PodState) -> float:
    if req.prompt_tokens <= 0:
        return 0.0
    return min(100.0, 100.0 * p.prefix_match_tokens / req.prompt_tokens)


def _rest(
    chosen: Sequence[PodState], pods: Sequence[PodState], rng: random.Random
) -> list[PodState]:
    taken = {id(p) for p in chosen}
    return _least_request([p for p in pods if id(p) not in taken], rng)


# ---------------------------------------------------------------- the same rules on columns


def _seq_sum(values: FloatArray) -> float:
    """Left-to-right sum, as Python's `sum` adds (numpy's `sum` pairs, so its last bit differs)."""
    return float(np.cumsum(values)[-1]) if len(values) else 0.0


def _mean_plus_std_array(values: FloatArray, k: float) -> float:
    """`_mean_plus_std` on an array, with the same float steps."""
    n = len(values)
    mean = _seq_sum(values) / n
    var = _seq_sum((values - mean) ** 2) / n
    return mean + k * math.sqrt(var)


def _match_pct_array(req: RoutingRequest, cols: PodColumns) -> FloatArray:
    if req.prompt_tokens <= 0:
        return np.zeros(cols.n)
    out: FloatArray = np.minimum(100.0, 100.0 * cols.prefix_match_tokens / req.prompt_tokens)
    return out


def _imbalance_guard_at(cols: PodColumns, abs_count: int) -> tuple[IntArray, list[str]]:
    """`_imbalance_guard` as indices, with the notes a decision starts from."""
    loads = cols.in_flight
    lo, hi = loads.min(), loads.max()
    if hi - lo > abs_count:
        spread = int(hi - lo)
        return np.flatnonzero(loads == lo), [
            f"load imbalance (spread {spread} > {abs_count}): least-loaded only"
        ]
    return np.arange(cols.n), []


def _rest_at(chosen: IntArray, at: IntArray, cols: PodColumns, rng: random.Random) -> IntArray:
    """`_rest`: the pods at `at` not in `chosen`, least-request first, as indices."""
    free = np.ones(cols.n, dtype=bool)
    free[chosen] = False
    return least_request_at(cols, at[free[at]], rng)


def _cat(*parts: IntArray) -> IntArray:
    return np.concatenate(parts).astype(np.intp, copy=False)


class _JoinedScores(Mapping[str, Mapping[str, float]]):
    """Several score tables over disjoint pods, read as one (P/D: decode and prefill pools)."""

    def __init__(self, *tables: Mapping[str, Mapping[str, float]]) -> None:
        self._tables = tables

    def __getitem__(self, address: str) -> Mapping[str, float]:
        for table in self._tables:
            if address in table:
                return table[address]
        raise KeyError(address)

    def __iter__(self) -> Iterator[str]:
        for table in self._tables:
            yield from table

    def __len__(self) -> int:
        return sum(len(t) for t in self._tables)


# ---------------------------------------------------------------- prefix-cache (AIBrix)


@dataclass(frozen=True, slots=True)
class PrefixCacheParams:
    imbalance_abs_count: int = 8  # AIBRIX_PREFIX_CACHE_POD_RUNNING_REQUEST_IMBALANCE_ABS_COUNT
    stddev_factor: float = 1.0  # AIBRIX_PREFIX_CACHE_STANDARD_DEVIATION_FACTOR
    match_threshold_percent: float = 0.0  # PR #641 used 50; current AIBrix has no threshold


class PrefixCacheStrategy(StrategyPlugin):
    """AIBrix prefix-cache: deepest match whose load is within mean + k*stddev, else least-request."""

    type_name = "prefix-cache"
    Params: ClassVar[type] = PrefixCacheParams
    capabilities = Capabilities(prompt_tokens=True, prefix_matches=True)

    def __init__(self, name: str = "", params: PrefixCacheParams | None = None) -> None:
        super().__init__(name, params)
        self.params = params or PrefixCacheParams()

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        t0 = time.perf_counter_ns()
        if vectorised(snap.pods):
            return self._route_columns(req, snap, rng, t0)
        prm = self.params
        pods = snap.pods
        notes: list[str] = []
        cands, note = _imbalance_guard(pods, prm.imbalance_abs_count)
        if note:
            notes.append(note)
        loads = [float(p.in_flight) for p in pods]
        bound = _mean_plus_std(loads, prm.stddev_factor)
        scores = {
            p.address: {"match_pct": round(_match_pct(req, p), 2), "in_flight": float(p.in_flight)}
            for p in pods
        }
        matched = [
            p
            for p in cands
            if p.prefix_match_tokens > 0 and _match_pct(req, p) > prm.match_threshold_percent
        ]
        ordered = signals.rank_by(matched, lambda p: (-_match_pct(req, p), float(p.in_flight)), rng)
        pick = next((p for p in ordered if p.in_flight <= bound), None)
        if pick is not None:
            notes.insert(
                0, f"prefix match {_match_pct(req, pick):.0f}% within load bound {bound:.2f}"
            )
            ranked = [pick, *_rest([pick], cands, rng)]
        else:
            if req.prompt_tokens <= 0:
                why = "no prompt tokens"
            elif not matched:
                why = "no prefix match"
            else:
                why = f"every match over load bound {bound:.2f}"
            notes.insert(0, f"{why}: least-request")
            ranked = _least_request(cands, rng)
        ranked += _rest(ranked, pods, rng)
        return self.decision(t0, ranked, "; ".join(notes), scores)

    def _route_columns(
        self, req: RoutingRequest, snap: Snapshot, rng: random.Random, t0: int
    ) -> Decision:
        prm = self.params
        cols = columns_of(snap.pods)
        cands, notes = _imbalance_guard_at(cols, prm.imbalance_abs_count)
        loads = cols.in_flight
        bound = _mean_plus_std_array(loads, prm.stddev_factor)
        pct = _match_pct_array(req, cols)
        scores = ScoreTable(snap.pods, ("match_pct", "in_flight"), (pct, loads), (2, None))
        hit = (cols.prefix_match_tokens[cands] > 0) & (pct[cands] > prm.match_threshold_percent)
        matched = cands[hit]
        ordered = matched[rank_order([-pct[matched], loads[matched]], rng)]
        within = ordered[loads[ordered] <= bound]
        if len(within):
            pick = within[:1]
            notes.insert(0, f"prefix match {pct[pick[0]]:.0f}% within load bound {bound:.2f}")
            ranked = _cat(pick, _rest_at(pick, cands, cols, rng))
        else:
            if req.prompt_tokens <= 0:
                why = "no prompt tokens"
            elif not len(matched):
                why = "no prefix match"
            else:
                why = f"every match over load bound {bound:.2f}"
            notes.insert(0, f"{why}: least-request")
            ranked = least_request_at(cols, cands, rng)
        ranked = _cat(ranked, _rest_at(ranked, np.arange(cols.n), cols, rng))
        return self.decision_of(t0, cols.endpoints_at(ranked), "; ".join(notes), scores)


# ---------------------------------------------------------------- prefix-cache-preble (Preble E2)


@dataclass(frozen=True, slots=True)
class PrebleParams:
    imbalance_abs_count: int = 8
    exploit_ratio: float = 0.5  # AIBrix hard-codes matched/total > 0.5
    rebalance_ratio: float = 2.0  # holder "overloaded" at >= ratio * max(least in-flight, 1)


class PrebleStrategy(StrategyPlugin):
    """Preble E2: exploit the longest cached prefix when it outweighs the rest, else explore by cost.

    Exploit: among pods holding the longest match, the one with least outstanding token work.
    Rebalance: if that holder is overloaded relative to the least-loaded pod, explore instead.
    Explore: cost = this request's uncached prompt tokens on the pod + the pod's outstanding
    tokens (in-flight prompt + max_tokens estimates); lowest cost wins.
    """

    type_name = "prefix-cache-preble"
    Params: ClassVar[type] = PrebleParams
    capabilities = Capabilities(prompt_tokens=True, prefix_matches=True)

    def __init__(self, name: str = "", params: PrebleParams | None = None) -> None:
        super().__init__(name, params)
        self.params = params or PrebleParams()

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        t0 = time.perf_counter_ns()
        if vectorised(snap.pods):
            return self._route_columns(req, snap, rng, t0)
        prm = self.params
        pods = snap.pods
        notes: list[str] = []
        cands, note = _imbalance_guard(pods, prm.imbalance_abs_count)
        if note:
            notes.append(note)

        def cost(p: PodState) -> float:
            return float(max(req.prompt_tokens - p.prefix_match_tokens, 0) + p.in_flight_tokens)

        scores = {
            p.address: {
                "match_tokens": float(p.prefix_match_tokens),
                "cost": cost(p),
                "in_flight": float(p.in_flight),
            }
            for p in pods
        }
        longest = max(p.prefix_match_tokens for p in cands)
        explore_order = signals.rank_by(cands, lambda p: (cost(p), float(p.in_flight)), rng)
        if req.prompt_tokens > 0 and longest / req.prompt_tokens > prm.exploit_ratio:
            holders = [p for p in cands if p.prefix_match_tokens == longest]
            best = signals.rank_by(
                holders, lambda p: (float(p.in_flight_tokens), float(p.in_flight)), rng
            )[0]
            least = min(p.in_flight for p in pods)
            if best.in_flight >= prm.rebalance_ratio * max(least, 1):
                notes.insert(
                    0,
                    f"rebalance: holder {best.address} overloaded (in_flight {best.in_flight} vs least {least}); explore by cost",
                )
                ranked = explore_order
            else:
                notes.insert(0, f"exploit: {longest}/{req.prompt_tokens} tokens cached")
                ranked = [best, *[p for p in explore_order if p is not best]]
        else:
            notes.insert(
                0, f"explore: longest cached {longest}/{req.prompt_tokens} tokens; min cost"
            )
            ranked = explore_order
        ranked += _rest(ranked, pods, rng)
        return self.decision(t0, ranked, "; ".join(notes), scores)

    def _route_columns(
        self, req: RoutingRequest, snap: Snapshot, rng: random.Random, t0: int
    ) -> Decision:
        prm = self.params
        cols = columns_of(snap.pods)
        cands, notes = _imbalance_guard_at(cols, prm.imbalance_abs_count)
        match, loads = cols.prefix_match_tokens, cols.in_flight
        cost = np.maximum(req.prompt_tokens - match, 0.0) + cols.in_flight_tokens
        scores = ScoreTable(snap.pods, ("match_tokens", "cost", "in_flight"), (match, cost, loads))
        longest = int(match[cands].max())
        explore_order = cands[rank_order([cost[cands], loads[cands]], rng)]
        if req.prompt_tokens > 0 and longest / req.prompt_tokens > prm.exploit_ratio:
            holders = cands[match[cands] == longest]
            order = rank_order([cols.in_flight_tokens[holders], loads[holders]], rng)
            best = int(holders[order[0]])
            least = int(loads.min())
            best_load = int(loads[best])
            if best_load >= prm.rebalance_ratio * max(least, 1):
                notes.insert(
                    0,
                    f"rebalance: holder {cols.address(best)} overloaded (in_flight {best_load} vs least {least}); explore by cost",
                )
                ranked = explore_order
            else:
                notes.insert(0, f"exploit: {longest}/{req.prompt_tokens} tokens cached")
                ranked = _cat(np.array([best]), explore_order[explore_order != best])
        else:
            notes.insert(
                0, f"explore: longest cached {longest}/{req.prompt_tokens} tokens; min cost"
            )
            ranked = explore_order
        ranked = _cat(ranked, _rest_at(ranked, np.arange(cols.n), cols, rng))
        return self.decision_of(t0, cols.endpoints_at(ranked), "; ".join(notes), scores)


# ---------------------------------------------------------------- kv-aware (Dynamo)


class LoadShare(StrEnum):
    """How much of a pod's in-flight work kv-aware counts as its load."""

    # What is still before its first token counts whole: the requests routed there within
    # the pod's measured TTFT (`PodState.prefill_tokens`); the rest, decoding, weighs
    # DECODING_WEIGHT. The whole work where TTFT is not measured.
    MEASURED = "measured"
    WHOLE = "whole"  # Dynamo's rule: every in-flight block, for as long as it is in flight


# What a request past its expected first token weighs, per token, in kv-aware's load: its
# blocks stay resident and it takes a slot in every batch step, but a new prefill does not
# wait behind it.
DECODING_WEIGHT = 0.05


@dataclass(frozen=True, slots=True)
class KvAwareParams:
    overlap_weight: float = 1.0  # DYN_KV_OVERLAP_SCORE_WEIGHT
    temperature: float = 0.0  # DYN_ROUTER_TEMPERATURE; 0 = argmin
    load_share: str = LoadShare.MEASURED.value  # a LoadShare value: measured | whole

    def __post_init__(self) -> None:
        if self.overlap_weight < 0 or self.temperature < 0:
            raise ValueError("overlap_weight and temperature must be >= 0")
        if self.load_share not in tuple(LoadShare):
            raise ValueError(f"load_share must be one of {', '.join(LoadShare)}")
        object.__setattr__(self, "load_share", LoadShare(self.load_share))


def load_tokens(in_flight_tokens: float, prefill_tokens: float | None) -> float:
    """kv-aware's measured load of a pod: its in-flight tokens still before their first
    token, whole, plus DECODING_WEIGHT of the rest (all of it where not measured)."""
    if prefill_tokens is None:
        return in_flight_tokens
    return float(_weighted_load(in_flight_tokens, prefill_tokens))


def _weighted_load(in_flight_tokens: Any, prefill_tokens: Any) -> Any:
    """`load_tokens`'s formula, for floats or numpy arrays alike."""
    return prefill_tokens + DECODING_WEIGHT * np.maximum(in_flight_tokens - prefill_tokens, 0.0)


class KvAwareStrategy(StrategyPlugin):
    """Dynamo KV router: cost = overlap_weight * prefill_blocks + decode_blocks, lowest wins.

    prefill_blocks = uncached prompt tokens / block_size; decode_blocks = the pod's active blocks
    (in-flight tokens / block_size; with `load_share: measured` those still before their first
    token whole and the decoding rest at DECODING_WEIGHT, see `load_tokens`) + this request's
    new blocks. With temperature T > 0 the order
    is sampled from softmax(-(cost - min) / ((max - min) * T)); at T = 0 ties go to the pod with
    the smaller cache (cached_blocks), then random.
    """

    type_name = "kv-aware"
    Params: ClassVar[type] = KvAwareParams
    capabilities = Capabilities(prompt_tokens=True, prefix_matches=True, accounting=True)

    def __init__(self, name: str = "", params: KvAwareParams | None = None) -> None:
        super().__init__(name, params)
        self.params = params or KvAwareParams()

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        t0 = time.perf_counter_ns()
        if vectorised(snap.pods, CHEAP_RULE):
            return self._route_columns(req, snap, rng, t0)
        prm = self.params
        bs = max(req.block_size, 1)
        total_blocks = math.ceil(req.prompt_tokens / bs)
        costs: dict[int, float] = {}
        scores: dict[str, dict[str, float]] = {}
        measured = prm.load_share == LoadShare.MEASURED
        unmeasured = 0
        for p in snap.pods:
            overlap = min(p.prefix_match_tokens, req.prompt_tokens) // bs
            prefill_blocks = (req.prompt_tokens - overlap * bs) / bs
            young = p.prefill_tokens if measured else None
            unmeasured += measured and young is None
            load = load_tokens(p.in_flight_tokens, young)
            decode_blocks = math.ceil(load / bs) + (total_blocks - overlap)
            c = prm.overlap_weight * prefill_blocks + decode_blocks
            costs[id(p)] = c
            scores[p.address] = {
                "overlap_blocks": float(overlap),
                "prefill_blocks": round(prefill_blocks, 3),
                "decode_blocks": float(decode_blocks),
                "cost": round(c, 3),
            }
            if measured:
                scores[p.address]["prefill_tokens"] = -1.0 if young is None else float(young)
        values = list(costs.values())
        lo, hi = min(values), max(values)
        if prm.temperature > 0 and hi > lo:
            span = (hi - lo) * prm.temperature

            def gumbel_key(p: PodState) -> tuple[float, ...]:
                u = rng.random() or 1e-300
                return (-(-(costs[id(p)] - lo) / span - math.log(-math.log(u))),)

            ranked = signals.rank_by(snap.pods, gumbel_key, rng)
            reason = f"softmax over cost, T={prm.temperature:g}"
        else:
            ranked = signals.rank_by(
                snap.pods, lambda p: (costs[id(p)], float(p.cached_blocks)), rng
            )
            reason = "min cost" + (
                " (all equal: uniform)" if hi == lo and prm.temperature > 0 else ""
            )
        if not any(p.prefix_match_tokens for p in snap.pods):
            reason += "; no cached prefix on any pod: cost is load only"
        if unmeasured:
            reason += _unmeasured_note(unmeasured, len(snap.pods))
        return self.decision(t0, ranked, reason, scores)

    def _route_columns(
        self, req: RoutingRequest, snap: Snapshot, rng: random.Random, t0: int
    ) -> Decision:
        prm = self.params
        cols = columns_of(snap.pods)
        bs = max(req.block_size, 1)
        total_blocks = math.ceil(req.prompt_tokens / bs)
        overlap = np.minimum(cols.prefix_match_tokens, float(req.prompt_tokens)) // bs
        prefill_blocks = (req.prompt_tokens - overlap * bs) / bs
        unmeasured = 0
        tokens = cols.in_flight_tokens
        if prm.load_share == LoadShare.MEASURED:
            young = cols.prefill_tokens
            known = young == young  # NaN: not measured, the whole load
            unmeasured = int(cols.n - np.count_nonzero(known))
            young = np.where(known, young, -1.0)  # what explain shows for "not measured"
            load = np.where(known, _weighted_load(tokens, young), tokens)
        else:
            load = tokens
        decode_blocks = np.ceil(load / bs) + (total_blocks - overlap)
        costs = prm.overlap_weight * prefill_blocks + decode_blocks
        names: tuple[str, ...] = ("overlap_blocks", "prefill_blocks", "decode_blocks", "cost")
        values = [overlap, prefill_blocks, decode_blocks, costs]
        digits: list[int | None] = [None, 3, None, 3]
        if prm.load_share == LoadShare.MEASURED:
            names, values, digits = (*names, "prefill_tokens"), [*values, young], [*digits, None]
        scores = ScoreTable(snap.pods, names, tuple(values), tuple(digits))
        lo, hi = float(costs.min()), float(costs.max())
        if prm.temperature > 0 and hi > lo:
            span = (hi - lo) * prm.temperature
            # rank_by draws the key's number, then the tie-break, pod by pod: keep that order.
            pairs = draws(rng, 2 * cols.n)
            u, tie = pairs[0::2].tolist(), pairs[1::2]
            keys = np.array(
                [
                    -(-(c - lo) / span - math.log(-math.log(x or 1e-300)))
                    for c, x in zip(costs.tolist(), u, strict=True)
                ]
            )
            ranked = np.lexsort((tie, keys))
            reason = f"softmax over cost, T={prm.temperature:g}"
        else:
            ranked = rank_order([costs, cols.cached_blocks], rng)
            reason = "min cost" + (
                " (all equal: uniform)" if hi == lo and prm.temperature > 0 else ""
            )
        if not cols.prefix_match_tokens.any():
            reason += "; no cached prefix on any pod: cost is load only"
        if unmeasured:
            reason += _unmeasured_note(unmeasured, cols.n)
        return self.decision_of(t0, cols.endpoints_at(ranked), reason, scores)


@dataclass(frozen=True, slots=True)
class KvAwareDynamoParams(KvAwareParams):
    load_share: str = LoadShare.WHOLE.value


class KvAwareDynamoStrategy(KvAwareStrategy):
    """kv-aware with Dynamo's load term as published: every in-flight block counts for as long
    as its request is in flight (`load_share: whole`); kept to measure the default against."""

    type_name = "kv-aware-dynamo"
    Params: ClassVar[type] = KvAwareDynamoParams
    capabilities = Capabilities(prompt_tokens=True, prefix_matches=True)

    def __init__(self, name: str = "", params: KvAwareParams | None = None) -> None:
        super().__init__(name, params or KvAwareDynamoParams())


def _unmeasured_note(unmeasured: int, n: int) -> str:
    return f"; {unmeasured} of {n} pods without a measured TTFT: whole load"


# ---------------------------------------------------------------- vtc-basic (AIBrix)


@dataclass(frozen=True, slots=True)
class VtcParams:
    max_pod_load: float = 100.0  # AIBRIX_ROUTER_VTC_BASIC_MAX_POD_LOAD
    fairness_weight: float = 1.0
    utilization_weight: float = 1.0
    min_tokens_floor: float = 1000.0
    max_tokens_floor: float = 8000.0

    def __post_init__(self) -> None:
        if self.max_pod_load <= 0 or self.min_tokens_floor <= 0:
            raise ValueError("max_pod_load and min_tokens_floor must be > 0")


class VtcStrategy(StrategyPlugin):
    """AIBrix vtc-basic: score = w_f*|index - min(tokens/bucket, n-1)| + w_u*min(running/max, 1) + U[0, 0.1).

    Lowest wins. The user's counter is lifted to the smallest active counter (VTC counter lift)
    so a returning idle user gets no banked credit. Pods are indexed in address order so a user's
    token band maps to a stable pod. Without a user or counters: least-request (AIBrix: random).
    """

    type_name = "vtc-basic"
    Params: ClassVar[type] = VtcParams
    capabilities = Capabilities(fairness=True)

    def __init__(self, name: str = "", params: VtcParams | None = None) -> None:
        super().__init__(name, params)
        self.params = params or VtcParams()

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        t0 = time.perf_counter_ns()
        prm = self.params
        if req.user is None or snap.fairness is None:
            why = "no user on request" if req.user is None else "no fairness counters"
            if vectorised(snap.pods, CHEAP_RULE):
                cols = columns_of(snap.pods)
                order = least_request_at(cols, np.arange(cols.n), rng)
                return self.decision_of(t0, cols.endpoints_at(order), f"{why}: least-request")
            return self.decision(t0, _least_request(snap.pods, rng), f"{why}: least-request")
        fair = snap.fairness
        active_min = fair.active_min()
        user_tokens = max(fair.tokens(req.user), active_min)
        min_tokens = max(prm.min_tokens_floor, active_min)
        bucket = max(prm.min_tokens_floor, (min_tokens + prm.max_tokens_floor) / 2)
        if vectorised(snap.pods, CHEAP_RULE):
            return self._route_columns(snap, rng, t0, user_tokens, bucket)
        pods = sorted(snap.pods, key=lambda p: p.address)
        target = min(user_tokens / bucket, len(pods) - 1)
        notes = [f"user tokens {user_tokens:.0f} bucket {bucket:.0f} -> target index {target:.2f}"]
        score: dict[int, float] = {}
        scores: dict[str, dict[str, float]] = {}
        missing = []
        for idx, p in enumerate(pods):
            run = signals.running(p)
            if run is None:
                run = float(p.in_flight)
                missing.append(p.address)
            util = min(run / prm.max_pod_load, 1.0)
            fairness = abs(idx - target)
            s = (
                prm.fairness_weight * fairness
                + prm.utilization_weight * util
                + rng.uniform(0.0, 0.1)
            )
            score[id(p)] = s
            scores[p.address] = {
                "fairness": round(fairness, 3),
                "utilization": round(util, 3),
                "score": round(s, 3),
            }
        if missing:
            notes.append(f"running unknown on {','.join(missing)}: used gateway in-flight")
        ranked = sorted(pods, key=lambda p: score[id(p)])
        return self.decision(t0, ranked, "; ".join(notes), scores)

    def _route_columns(
        self, snap: Snapshot, rng: random.Random, t0: int, user_tokens: float, bucket: float
    ) -> Decision:
        prm = self.params
        cols = columns_of(snap.pods)
        addresses = cols.addresses
        by_address = cols.address_order()
        target = min(user_tokens / bucket, cols.n - 1)
        notes = [f"user tokens {user_tokens:.0f} bucket {bucket:.0f} -> target index {target:.2f}"]
        running = cols.running[by_address]
        unknown = np.isnan(running)
        run = np.where(unknown, cols.in_flight[by_address], running)
        util = np.minimum(run / prm.max_pod_load, 1.0)
        fairness = np.abs(np.arange(cols.n) - target)
        jitter = 0.0 + (0.1 - 0.0) * draws(rng, cols.n)  # rng.uniform(0.0, 0.1), pod by pod
        s = prm.fairness_weight * fairness + prm.utilization_weight * util + jitter
        if unknown.any():
            missing = ",".join([addresses[i] for i in by_address[unknown].tolist()])
            notes.append(f"running unknown on {missing}: used gateway in-flight")
        scores = ScoreTable(
            cols.rows(by_address),
            ("fairness", "utilization", "score"),
            (fairness, util, s),
            (3, 3, 3),
        )
        ranked = by_address[np.argsort(s, kind="stable")]
        return self.decision_of(t0, cols.endpoints_at(ranked), "; ".join(notes), scores)


# ---------------------------------------------------------------- pd (AIBrix)


@dataclass(frozen=True, slots=True)
class PdParams:
    stddev_factor: float = 1.0  # prefill pods above mean + k*stddev in-flight are skipped


class PdStrategy(StrategyPlugin):
    """AIBrix pd: a prefill pod (role prefill) and a decode pod (role decode, else both).

    Prefill score (lowest wins) = (100 - match%) * 0.1 + in_flight / max in_flight, skipping pods
    above mean + k*stddev. Decode score = (running / max running) / (free KV / max free KV).
    The decision has two profiles, prefill and decode; without a prefill pod the prefill profile
    is empty and the request goes to a decode/both pod whole, and the reason says so.
    """

    type_name = "pd"
    Params: ClassVar[type] = PdParams
    capabilities = Capabilities(prompt_tokens=True, prefix_matches=True, disaggregated=True)

    def __init__(self, name: str = "", params: PdParams | None = None) -> None:
        super().__init__(name, params)
        self.params = params or PdParams()

    def _decode_order(
        self, pool: Sequence[PodState], rng: random.Random, scores: dict[str, dict[str, float]]
    ) -> tuple[list[PodState], str | None]:
        runs = []
        missing = []
        for p in pool:
            r = signals.running(p)
            if r is None:
                r = float(p.in_flight)
                missing.append(p.address)
            runs.append(r)
        frees = [max(1.0 - (signals.kv_usage(p) or 0.0), 0.01) for p in pool]
        max_run, max_free = max(max(runs), 1.0), max(frees)
        val: dict[int, float] = {}
        for p, r, f in zip(pool, runs, frees, strict=True):
            val[id(p)] = (r / max_run) / (f / max_free)
            scores.setdefault(p.address, {})["decode_score"] = round(val[id(p)], 4)
        note = f"running unknown on {','.join(missing)}: used in-flight" if missing else None
        return signals.rank_by(pool, lambda p: (val[id(p)], float(p.in_flight)), rng), note

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        t0 = time.perf_counter_ns()
        if vectorised(snap.pods, COSTLY_RULE):
            return self._route_columns(req, snap, rng, t0)
        pods = snap.pods
        prefill = [p for p in pods if p.endpoint.role is EndpointRole.PREFILL]
        decode = [p for p in pods if p.endpoint.role is EndpointRole.DECODE]
        both = [p for p in pods if p.endpoint.role is EndpointRole.BOTH]
        scores: dict[str, dict[str, float]] = {}
        notes: list[str] = []
        pool = decode or both
        if not pool:
            ranked = _least_request(pods, rng)
            return self.decision(
                t0,
                ranked,
                "no decode or both pod: whole request on a prefill pod by least-request",
                profiles=(
                    ProfileResult(PREFILL_PROFILE, ()),
                    ProfileResult(DECODE_PROFILE, tuple([p.endpoint for p in ranked])),
                ),
            )
        decode_ranked, note = self._decode_order(pool, rng, scores)
        if note:
            notes.append(note)
        prefill_ranked: list[PodState] = []
        if prefill:
            loads = [float(p.in_flight) for p in prefill]
            bound = _mean_plus_std(loads, self.params.stddev_factor)
            max_load = max(max(loads), 1.0)
            ok = [p for p in prefill if p.in_flight <= bound] or prefill
            val = {id(p): (100.0 - _match_pct(req, p)) * 0.1 + p.in_flight / max_load for p in ok}
            for p in ok:
                scores.setdefault(p.address, {})["prefill_score"] = round(val[id(p)], 4)
            prefill_ranked = signals.rank_by(ok, lambda p: (val[id(p)],), rng)
            notes.insert(
                0, f"prefill on {prefill_ranked[0].address}, decode on {decode_ranked[0].address}"
            )
        else:
            notes.insert(
                0,
                f"no prefill pod: whole request on {'decode' if decode else 'both'} pod {decode_ranked[0].address}",
            )
        ranked = decode_ranked + _rest(
            decode_ranked, [p for p in pods if p.endpoint.role is not EndpointRole.PREFILL], rng
        )
        ranked += _rest(ranked, pods, rng)
        return self.decision(
            t0,
            ranked,
            "; ".join(notes),
            scores,
            profiles=(
                ProfileResult(PREFILL_PROFILE, tuple([p.endpoint for p in prefill_ranked])),
                ProfileResult(DECODE_PROFILE, tuple([p.endpoint for p in decode_ranked])),
            ),
        )

    def _route_columns(
        self, req: RoutingRequest, snap: Snapshot, rng: random.Random, t0: int
    ) -> Decision:
        cols = columns_of(snap.pods)
        is_prefill = cols.role_is(EndpointRole.PREFILL)
        is_decode = cols.role_is(EndpointRole.DECODE)
        prefill = np.flatnonzero(is_prefill)
        decode = np.flatnonzero(is_decode)
        both = np.flatnonzero(~is_prefill & ~is_decode)
        pool = decode if len(decode) else both
        everyone = np.arange(cols.n)
        if not len(pool):
            ranked = least_request_at(cols, everyone, rng)
            eps = cols.endpoints_at(ranked)
            return self.decision_of(
                t0,
                eps,
                "no decode or both pod: whole request on a prefill pod by least-request",
                profiles=(ProfileResult(PREFILL_PROFILE, ()), ProfileResult(DECODE_PROFILE, eps)),
            )
        notes: list[str] = []
        loads = cols.in_flight
        running = cols.running[pool]
        unknown = np.isnan(running)
        runs = np.where(unknown, loads[pool], running)
        kv = cols.kv_usage[pool]
        kv = np.where(np.isnan(kv), 0.0, kv)  # `kv_usage(p) or 0.0`
        frees = np.maximum(1.0 - kv, 0.01)
        max_run, max_free = max(float(runs.max()), 1.0), float(frees.max())
        decode_val = (runs / max_run) / (frees / max_free)
        decode_ranked = pool[rank_order([decode_val, loads[pool]], rng)]
        tables: list[Mapping[str, Mapping[str, float]]] = [
            ScoreTable(cols.rows(pool), ("decode_score",), (decode_val,), (4,))
        ]
        if unknown.any():
            missing = ",".join([cols.addresses[i] for i in pool[unknown].tolist()])
            notes.append(f"running unknown on {missing}: used in-flight")
        prefill_ranked = np.empty(0, dtype=np.intp)
        if len(prefill):
            pl = loads[prefill]
            bound = _mean_plus_std_array(pl, self.params.stddev_factor)
            max_load = max(float(pl.max()), 1.0)
            ok = prefill[pl <= bound]
            if not len(ok):
                ok = prefill
            val = (100.0 - _match_pct_array(req, cols)[ok]) * 0.1 + loads[ok] / max_load
            tables.append(ScoreTable(cols.rows(ok), ("prefill_score",), (val,), (4,)))
            prefill_ranked = ok[rank_order([val], rng)]
            notes.insert(
                0,
                f"prefill on {cols.address(prefill_ranked[0])}, decode on {cols.address(decode_ranked[0])}",
            )
        else:
            notes.insert(
                0,
                f"no prefill pod: whole request on {'decode' if len(decode) else 'both'} pod {cols.address(decode_ranked[0])}",
            )
        # `_rest` twice: the non-prefill pods outside the pool (both pods beside decode
        # ones), then every prefill pod, each least-request first.
        beside = both if len(decode) else np.empty(0, dtype=np.intp)
        ranked = _cat(
            decode_ranked,
            least_request_at(cols, beside, rng),
            least_request_at(cols, prefill, rng),
        )
        eps = cols.endpoints_at(ranked)
        return self.decision_of(
            t0,
            eps,
            "; ".join(notes),
            _JoinedScores(*tables),
            profiles=(
                ProfileResult(PREFILL_PROFILE, cols.endpoints_at(prefill_ranked)),
                ProfileResult(DECODE_PROFILE, eps[: len(decode_ranked)]),
            ),
        )


# ---------------------------------------------------------------- session-affinity (AIBrix)

SESSION_KEY_HEADER = "x-aibrix-session-key"
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3


def _fnv1a64(data: bytes) -> int:
    h = _FNV_OFFSET
    for b in data:
        h = ((h ^ b) * _FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return h


class SessionAffinityStrategy(StrategyPlugin):
    """AIBrix session-affinity: the session's pod (`RoutingRequest.session_id`: the pod the
    `x-session-id` token names, or the rendezvous pick for an id the client made up); else
    rendezvous hashing on `x-aibrix-session-key`; else least-request. The client always gets
    back the pick's token (`Decision.session_id` is the pick)."""

    type_name = "session-affinity"

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        t0 = time.perf_counter_ns()
        pods = snap.pods
        if vectorised(pods, COSTLY_RULE):
            return self._route_columns(req, pods, rng, t0)
        pick = next(
            (p for p in pods if req.session_id is not None and p.address == req.session_id), None
        )
        key = req.headers.get(SESSION_KEY_HEADER)
        if pick is not None:
            reason = "session honoured"
        elif key and len(key) <= 256:
            pick = max(pods, key=lambda p: _fnv1a64((key + p.address).encode()))
            reason = "session key: rendezvous hashing"
        else:
            pick = _least_request(pods, rng)[0]
            reason = (
                "unknown session: least-request" if req.session_id else "no session: least-request"
            )
        ranked = [pick, *_rest([pick], pods, rng)]
        return self.decision(t0, ranked, reason, session_id=pick.address)

    def _route_columns(
        self, req: RoutingRequest, pods: Sequence[PodState], rng: random.Random, t0: int
    ) -> Decision:
        """`route` on the address and in-flight columns (no row read): the same pick, draws."""
        cols = columns_of(pods)
        addresses = cols.addresses
        key = req.headers.get(SESSION_KEY_HEADER)
        if req.session_id is not None and req.session_id in addresses:
            i = addresses.index(req.session_id)
            reason = "session honoured"
        elif key and len(key) <= 256:
            i = max(range(cols.n), key=lambda j: _fnv1a64((key + addresses[j]).encode()))
            reason = "session key: rendezvous hashing"
        else:
            i = int(least_request_at(cols, np.arange(cols.n), rng)[0])
            reason = (
                "unknown session: least-request" if req.session_id else "no session: least-request"
            )
        at = np.array([i])
        eps = cols.endpoints_at(_cat(at, _rest_at(at, np.arange(cols.n), cols, rng)))
        return self.decision_of(t0, eps, reason, session_id=addresses[i])
