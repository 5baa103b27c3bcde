"""Cache-, user- and role-aware strategies: prefix-cache, prefix-cache-preble, kv-aware,
vtc-basic, pd and session-affinity. Rules and defaults follow docs/strategies.md.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

import numpy as np

from extproc.routing.base import (
    DECODE_PROFILE,
    PREFILL_PROFILE,
    Capabilities,
    Decision,
    ProfileResult,
    RoutingRequest,
    Snapshot,
)
from extproc.routing.columns import (
    FloatArray,
    IntArray,
    PodColumns,
    columns_of,
    draws,
    rank_order,
)
from extproc.routing.framework import ScoreTable
from extproc.routing.strategies import (
    StrategyPlugin,
    all_but,
    least_request,
    least_request_at,
)
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
    "slowness",
]


def _seq_sum(values: FloatArray) -> float:
    """Left-to-right sum (numpy's `sum` adds in pairs: its last bit may differ)."""
    return float(np.cumsum(values)[-1]) if len(values) else 0.0


def _mean_plus_std(values: FloatArray, k: float) -> float:
    """mean + k * population stddev."""
    n = len(values)
    mean = _seq_sum(values) / n
    var = _seq_sum((values - mean) ** 2) / n
    return mean + k * math.sqrt(var)


def _match_pct(req: RoutingRequest, cols: PodColumns) -> FloatArray:
    """Each pod's cached share of the prompt, in percent (0 without a prompt)."""
    if req.prompt_tokens <= 0:
        return np.zeros(cols.n)
    out: FloatArray = np.minimum(100.0, 100.0 * cols.prefix_match_tokens / req.prompt_tokens)
    return out


def _imbalance_guard(cols: PodColumns, abs_count: int) -> tuple[IntArray, list[str]]:
    """AIBrix: if the in-flight spread exceeds `abs_count`, only the least-loaded pods are
    candidates. The candidates' indices, and the notes a decision starts from."""
    loads = cols.in_flight
    lo, hi = loads.min(), loads.max()
    if hi - lo > abs_count:
        spread = int(hi - lo)
        return (loads == lo).nonzero()[0], [
            f"load imbalance (spread {spread} > {abs_count}): least-loaded only"
        ]
    return np.arange(cols.n), []


def _then_outside(
    ranked: IntArray, cols: PodColumns, cands: IntArray, rng: random.Random
) -> IntArray:
    """`ranked`, then the pods not among `cands` (those the imbalance guard left out),
    least-request first."""
    if len(cands) == cols.n:
        return ranked
    return np.concatenate((ranked, least_request_at(cols, all_but(cols, cands), rng)))


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
        prm = self.params
        cols = columns_of(snap.pods)
        cands, notes = _imbalance_guard(cols, prm.imbalance_abs_count)
        loads = cols.in_flight
        bound = _mean_plus_std(loads, prm.stddev_factor)
        pct = _match_pct(req, cols)
        scores = ScoreTable(cols.addresses, ("match_pct", "in_flight"), (pct, loads), (2, None))
        hit = (cols.prefix_match_tokens > 0) & (pct > prm.match_threshold_percent)
        matched = cands[hit[cands]]
        ordered = matched[rank_order([-pct[matched], loads[matched]], rng)]
        within = ordered[loads[ordered] <= bound]
        if len(within):
            pick = within[0]
            notes.insert(0, f"prefix match {pct[pick]:.0f}% within load bound {bound:.2f}")
            ranked = np.concatenate(((pick,), least_request_at(cols, cands[cands != pick], rng)))
        else:
            if req.prompt_tokens <= 0:
                why = "no prompt tokens"
            elif not len(matched):
                why = "no prefix match"
            else:
                why = f"every match over load bound {bound:.2f}"
            notes.insert(0, f"{why}: least-request")
            ranked = least_request_at(cols, cands, rng)
        ranked = _then_outside(ranked, cols, cands, rng)
        return self.decision(t0, cols.endpoints_at(ranked), "; ".join(notes), scores)


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
        prm = self.params
        cols = columns_of(snap.pods)
        cands, notes = _imbalance_guard(cols, prm.imbalance_abs_count)
        match, loads = cols.prefix_match_tokens, cols.in_flight
        cost = np.maximum(req.prompt_tokens - match, 0.0) + cols.in_flight_tokens
        scores = ScoreTable(
            cols.addresses, ("match_tokens", "cost", "in_flight"), (match, cost, loads)
        )
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
                ranked = np.concatenate(((best,), explore_order[explore_order != best]))
        else:
            notes.insert(
                0, f"explore: longest cached {longest}/{req.prompt_tokens} tokens; min cost"
            )
            ranked = explore_order
        ranked = _then_outside(ranked, cols, cands, rng)
        return self.decision(t0, cols.endpoints_at(ranked), "; ".join(notes), scores)


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
    # A pod whose engine's steps (its recent inter-token latency) take at least this many
    # times the fastest candidate's has its cost weighed by the ratio (see the class); 0 = off.
    slow_after: float = 2.0

    def __post_init__(self) -> None:
        if self.overlap_weight < 0 or self.temperature < 0:
            raise ValueError("overlap_weight and temperature must be >= 0")
        if self.slow_after != 0 and not self.slow_after >= 1:
            raise ValueError("slow_after must be 0 (off) or >= 1")
        if self.load_share not in tuple(LoadShare):
            raise ValueError(f"load_share must be one of {', '.join(LoadShare)}")
        object.__setattr__(self, "load_share", LoadShare(self.load_share))


def load_tokens(in_flight_tokens: FloatArray, prefill_tokens: FloatArray) -> FloatArray:
    """kv-aware's measured load of each pod: its in-flight tokens still before their first
    token, whole, plus DECODING_WEIGHT of the rest; all of them where not measured (NaN)."""
    measured = prefill_tokens == prefill_tokens  # NaN: not measured
    weighted = prefill_tokens + DECODING_WEIGHT * np.maximum(in_flight_tokens - prefill_tokens, 0.0)
    out: FloatArray = np.where(measured, weighted, in_flight_tokens)
    return out


def slowness(recent: FloatArray, baseline: FloatArray, slow_after: float) -> FloatArray:
    """How many times longer each pod's engine steps take now than the fastest candidate's,
    where that is at least `slow_after`, else 1 (also where unknown, or with `slow_after` 0).

    A pod's step time now is its engine's recent inter-token latency (`itl_recent_s`); the
    fastest is the least recent or baseline (`itl_baseline_s`, the last minute or so) value
    of any candidate, so a pod that turned slow is compared with what it and its peers did
    before, even when they have been idle since. A pod without recent gaps counts as fast: a
    slow pod left alone is tried again once its recent value is forgotten."""
    ones = np.ones(len(recent))
    if slow_after <= 0:
        return ones
    fastest = np.fmin(recent, baseline)  # NaN only where both are
    fastest = fastest[fastest > 0]  # NaN > 0 is False
    if not len(fastest):
        return ones
    ratio = recent / fastest.min()
    slow = ratio >= slow_after  # NaN >= x is False
    if not slow.any():
        return ones
    out: FloatArray = np.where(slow, ratio, ones)
    return out


class KvAwareStrategy(StrategyPlugin):
    """Dynamo KV router: cost = overlap_weight * prefill_blocks + decode_blocks, lowest wins.

    prefill_blocks = uncached prompt tokens / block_size; decode_blocks = the pod's active blocks
    (in-flight tokens / block_size; with `load_share: measured` those still before their first
    token whole and the decoding rest at DECODING_WEIGHT, see `load_tokens`) + this request's
    new blocks. A pod whose engine steps take s >= `slow_after` (2) times the fastest
    candidate's (`slowness`) costs s * (cost + request blocks) - request blocks: its blocks,
    and the request's own, take s times as long there. With temperature T > 0 the order
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
        prm = self.params
        cols = columns_of(snap.pods)
        bs = max(req.block_size, 1)
        total_blocks = math.ceil(req.prompt_tokens / bs)
        overlap = np.minimum(cols.prefix_match_tokens, float(req.prompt_tokens)) // bs
        prefill_blocks = (req.prompt_tokens - overlap * bs) / bs
        names: tuple[str, ...] = ("overlap_blocks", "prefill_blocks", "decode_blocks", "cost")
        digits: tuple[int | None, ...] = (None, 3, None, 3)
        if prm.load_share == LoadShare.MEASURED:
            young = cols.prefill_tokens
            unmeasured = int(np.count_nonzero(young != young))  # NaN: not measured
            load = load_tokens(cols.in_flight_tokens, young)
        else:
            unmeasured = 0
            load = cols.in_flight_tokens
        decode_blocks = np.ceil(load / bs) + (total_blocks - overlap)
        w = prm.overlap_weight
        costs = (prefill_blocks if w == 1.0 else w * prefill_blocks) + decode_blocks
        values: tuple[FloatArray, ...] = (overlap, prefill_blocks, decode_blocks, costs)
        slow_note = ""
        if prm.slow_after > 0:
            slow = slowness(cols.engine_itl_recent, cols.engine_itl_baseline, prm.slow_after)
            at = (slow != 1.0).nonzero()[0]
            if len(at):
                # The request's own blocks, which every pod reads at each of its steps, drop out
                # of a comparison between equal pods; on a pod whose steps take s times as
                # long they cost s times as much too: s * (cost + blocks) - blocks.
                costs = costs + (slow - 1.0) * (costs + total_blocks)
                slow_note = "; slower steps: " + ", ".join(
                    f"x{slow[i]:.1f} on {cols.address(i)}" for i in at.tolist()
                )
            names, digits = (*names[:-1], "slowness", "cost"), (*digits[:-1], 2, 3)
            values = (overlap, prefill_blocks, decode_blocks, slow, costs)
        if prm.load_share == LoadShare.MEASURED:  # explain shows -1 for "not measured"
            names, digits = (*names, "prefill_tokens"), (*digits, None)
            values = (*values, np.fmax(young, -1.0))  # NaN (not measured): -1
        scores = ScoreTable(cols.addresses, names, values, digits)
        lo, hi = (float(costs.min()), float(costs.max())) if prm.temperature > 0 else (0.0, 0.0)
        if hi > lo:  # softmax (T > 0) over costs that differ
            span = (hi - lo) * prm.temperature
            # A Gumbel key, then a tie-break, drawn pod by pod.
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
            reason = "min cost" + (" (all equal: uniform)" if prm.temperature > 0 else "")
        if not np.count_nonzero(cols.prefix_match_tokens):
            reason += "; no cached prefix on any pod: cost is load only"
        if unmeasured:
            reason += f"; {unmeasured} of {cols.n} pods without a measured TTFT: whole load"
        reason += slow_note
        return self.decision(t0, cols.endpoints_at(ranked), reason, scores)


@dataclass(frozen=True, slots=True)
class KvAwareDynamoParams(KvAwareParams):
    load_share: str = LoadShare.WHOLE.value
    slow_after: float = 0.0  # Dynamo's cost reads no engine speed


class KvAwareDynamoStrategy(KvAwareStrategy):
    """kv-aware with Dynamo's cost as published: every in-flight block counts for as long as
    its request is in flight (`load_share: whole`), whatever the pod's speed (`slow_after: 0`);
    kept to measure the default against."""

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
        cols = columns_of(snap.pods)
        if req.user is None or snap.fairness is None:
            why = "no user on request" if req.user is None else "no fairness counters"
            order = least_request(cols, rng)
            return self.decision(t0, cols.endpoints_at(order), f"{why}: least-request")
        fair = snap.fairness
        active_min = fair.active_min()
        user_tokens = max(fair.tokens(req.user), active_min)
        min_tokens = max(prm.min_tokens_floor, active_min)
        bucket = max(prm.min_tokens_floor, (min_tokens + prm.max_tokens_floor) / 2)
        by_address = cols.address_order()
        target = min(user_tokens / bucket, cols.n - 1)
        notes = [f"user tokens {user_tokens:.0f} bucket {bucket:.0f} -> target index {target:.2f}"]
        running = cols.running[by_address]
        unknown = np.isnan(running)
        run = np.where(unknown, cols.in_flight[by_address], running)
        util = np.minimum(run / prm.max_pod_load, 1.0)
        fairness = np.abs(np.arange(cols.n) - target)
        jitter = 0.1 * draws(rng, cols.n)  # rng.uniform(0.0, 0.1), pod by pod
        s = prm.fairness_weight * fairness + prm.utilization_weight * util + jitter
        if np.count_nonzero(unknown):
            missing = cols.addresses_text(by_address[unknown])
            notes.append(f"running unknown on {missing}: used gateway in-flight")
        scores = ScoreTable(
            cols.addresses,
            ("fairness", "utilization", "score"),
            (fairness, util, s),
            (3, 3, 3),
            at=by_address,
        )
        ranked = by_address[np.argsort(s, kind="stable")]
        return self.decision(t0, cols.endpoints_at(ranked), "; ".join(notes), scores)


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

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        t0 = time.perf_counter_ns()
        cols = columns_of(snap.pods)
        is_prefill = cols.role_is(EndpointRole.PREFILL)
        is_decode = cols.role_is(EndpointRole.DECODE)
        prefill = is_prefill.nonzero()[0]
        decode = is_decode.nonzero()[0]
        both = (~is_prefill & ~is_decode).nonzero()[0]
        pool = decode if len(decode) else both
        if not len(pool):
            eps = cols.endpoints_at(least_request(cols, rng))
            return self.decision(
                t0,
                eps,
                "no decode or both pod: whole request on a prefill pod by least-request",
                profiles=(ProfileResult(PREFILL_PROFILE, ()), ProfileResult(DECODE_PROFILE, eps)),
            )
        notes: list[str] = []
        loads = cols.in_flight
        decode_ranked, decode_scores, missing = self._decode_order(cols, pool, rng)
        tables: list[Mapping[str, Mapping[str, float]]] = [decode_scores]
        if missing:
            notes.append(f"running unknown on {missing}: used in-flight")
        prefill_ranked = np.empty(0, dtype=np.intp)
        if len(prefill):
            pl = loads[prefill]
            bound = _mean_plus_std(pl, self.params.stddev_factor)
            max_load = max(float(pl.max()), 1.0)
            ok = prefill[pl <= bound]
            if not len(ok):
                ok = prefill
            val = (100.0 - _match_pct(req, cols)[ok]) * 0.1 + loads[ok] / max_load
            tables.append(ScoreTable(cols.addresses, ("prefill_score",), (val,), (4,), at=ok))
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
        # The fallbacks: the non-prefill pods outside the pool (both pods beside decode ones),
        # then every prefill pod, each least-request first.
        parts = [decode_ranked]
        if len(decode):
            parts.append(least_request_at(cols, both, rng))
        parts.append(least_request_at(cols, prefill, rng))
        eps = cols.endpoints_at(np.concatenate(parts))
        return self.decision(
            t0,
            eps,
            "; ".join(notes),
            _JoinedScores(*tables),
            profiles=(
                ProfileResult(PREFILL_PROFILE, cols.endpoints_at(prefill_ranked)),
                ProfileResult(DECODE_PROFILE, eps[: len(decode_ranked)]),
            ),
        )

    @staticmethod
    def _decode_order(
        cols: PodColumns, pool: IntArray, rng: random.Random
    ) -> tuple[IntArray, ScoreTable, str]:
        """The decode pool by (running / max running) / (free KV / max free KV), then fewer
        in flight; its scores, and the pods whose running count was unknown (in-flight used)."""
        loads = cols.in_flight
        running = cols.running[pool]
        unknown = np.isnan(running)
        runs = np.where(unknown, loads[pool], running)
        kv = cols.kv_usage[pool]
        kv = np.where(np.isnan(kv), 0.0, kv)  # unknown KV usage: 0
        frees = np.maximum(1.0 - kv, 0.01)
        max_run, max_free = max(float(runs.max()), 1.0), float(frees.max())
        value = (runs / max_run) / (frees / max_free)
        ranked = pool[rank_order([value, loads[pool]], rng)]
        scores = ScoreTable(cols.addresses, ("decode_score",), (value,), (4,), at=pool)
        missing = cols.addresses_text(pool[unknown]) if np.count_nonzero(unknown) else ""
        return ranked, scores, missing


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
        cols = columns_of(snap.pods)
        addresses = cols.addresses
        key = req.headers.get(SESSION_KEY_HEADER)
        if req.session_id is not None and req.session_id in addresses:
            i = addresses.index(req.session_id)
            reason = "session honoured"
        elif key and len(key) <= 256:
            i = max(range(cols.n), key=lambda j: _fnv1a64((key + addresses[j]).encode()))
            reason = "session key: rendezvous hashing"
        else:
            i = int(least_request(cols, rng)[0])
            reason = (
                "unknown session: least-request" if req.session_id else "no session: least-request"
            )
        rest = least_request_at(cols, all_but(cols, [i]), rng)
        eps = cols.endpoints_at(np.concatenate(((i,), rest)))
        return self.decision(t0, eps, reason, session_id=addresses[i])
