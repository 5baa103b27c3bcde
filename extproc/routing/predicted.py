"""predicted-latency: pick the pod with the lowest predicted TTFT, from per-pod models learned
online from the gateway's own accounting records.

The rule reads a `LatencyPredictor` (the composition root injects
`extproc.accounting.latency_model.LatencyModels` through the plugin factory); routing only reads
it, the accounting side and the director's pre-request step write it. What a prediction depends
on is `LatencyFeatures`: what the decision knows about a pod (this request's uncached prompt
tokens there, the gateway's in-flight requests and tokens, the engine's queue, running requests
and KV usage). The same features travel with the request in its access-log record, so whichever
process accounts the record learns from exactly what the decision saw.

Until every candidate's model has enough samples the rule is the cost rule (`kv-aware`: uncached
prefill blocks + the pod's in-flight blocks), and the reason says which pods are cold.
Per-request SLO headers keep only the pods predicted to meet them; a sheddable request
(priority < 0) with no such pod is refused with 429 (`slo_unmet`), any other goes to the best
pod anyway.

`route` is pure: it changes no state, so an explain (a dry run) leaves the next decision as it
was. The probe bookkeeping (when a pod was last sent a request) is written by the director's
`MarkRouted` step, for real requests only. The rule reads the snapshot as numpy columns and the
predictor's coefficient table (`predict_columns`); the features of one pod
(`latency_features`, what the access-log record carries) are the same values as its column
(tests/routing/test_predicted_columns.py).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from extproc.routing.affinity import KvAwareParams, KvAwareStrategy, LoadShare
from extproc.routing.base import Capabilities, Decision, PodState, RoutingRequest, Snapshot
from extproc.routing.columns import (
    FloatArray,
    IntArray,
    PodColumns,
    columns_of,
    rank_order,
)
from extproc.routing.framework import gumbel_order
from extproc.routing.strategies import StrategyPlugin
from extproc.types import BadRequest, TooManyRequests

__all__ = [
    "FEATURE_NAMES",
    "LLMD_SLO_TPOT_HEADER",
    "LLMD_SLO_TTFT_HEADER",
    "SLO_TPOT_HEADER",
    "SLO_TTFT_HEADER",
    "SLO_UNMET",
    "ColdPredictor",
    "LatencyFeatures",
    "LatencyPrediction",
    "LatencyPredictor",
    "PredictedLatencyParams",
    "PredictedLatencyStrategy",
    "PredictionColumns",
    "latency_feature_columns",
    "latency_features",
    "slo_ms",
]

SLO_TTFT_HEADER = "x-slo-ttft-ms"
SLO_TPOT_HEADER = "x-slo-tpot-ms"
# llm-d's names for the same targets (its predicted-latency producer reads them): accepted too;
# where a request sends both, ours wins.
LLMD_SLO_TTFT_HEADER = "x-llm-d-slo-ttft-ms"
LLMD_SLO_TPOT_HEADER = "x-llm-d-slo-tpot-ms"
SLO_UNMET = "slo_unmet"  # the error code of the 429 for a sheddable request no pod can serve
MAX_SLO_MS = 3_600_000.0  # an hour: anything above is a typo, not a target
# The regressors, in `LatencyFeatures.vector()` order (scaled so each is O(1) in practice).
FEATURE_NAMES = (
    "intercept",
    "uncached_ktokens",
    "in_flight",
    "waiting",
    "running",
    "kv_usage",
    "in_flight_10ktokens",
)


class LatencyFeatures(NamedTuple):
    """What a decision knew about one pod for one request (a NamedTuple: built per candidate
    per decision, and builds several times faster than a frozen dataclass)."""

    uncached_tokens: int  # this request's prompt tokens not in the pod's cached prefix
    in_flight: int  # requests the gateway has on the pod
    in_flight_tokens: int  # their prompt + max_tokens estimate
    waiting: float  # the engine's queue (last scrape), 0 when unknown
    running: float  # the engine's running requests (last scrape), 0 when unknown
    kv_usage: float  # the engine's KV-cache usage in [0, 1] (last scrape), 0 when unknown

    def vector(self) -> tuple[float, ...]:
        return (
            1.0,
            self.uncached_tokens / 1000.0,
            float(self.in_flight),
            self.waiting,
            self.running,
            self.kv_usage,
            self.in_flight_tokens / 10000.0,
        )


_INF = math.inf


def latency_features(req: RoutingRequest, pod: PodState) -> LatencyFeatures:
    """The pod's features for this request; an unknown or non-finite engine signal is 0."""
    prompt = req.prompt_tokens if req.prompt_tokens > 0 else 0
    cached = pod.prefix_match_tokens
    cached = 0 if cached < 0 else prompt if cached > prompt else cached
    m = pod.metrics
    waiting = running = kv = 0.0
    if m is not None:  # `0 <= v < inf` is False for NaN too
        if m.waiting is not None and 0.0 <= m.waiting < _INF:
            waiting = m.waiting
        if m.running is not None and 0.0 <= m.running < _INF:
            running = m.running
        if m.kv_cache_usage is not None and 0.0 <= m.kv_cache_usage < _INF:
            kv = m.kv_cache_usage if m.kv_cache_usage < 1.0 else 1.0
    return LatencyFeatures(
        prompt - cached,
        pod.in_flight if pod.in_flight > 0 else 0,
        pod.in_flight_tokens if pod.in_flight_tokens > 0 else 0,
        waiting,
        running,
        kv,
    )


def latency_feature_columns(req: RoutingRequest, cols: PodColumns) -> FloatArray:
    """`latency_features(req, pod).vector()` for every pod: one row per feature, one column
    per pod (the same values)."""
    return _feature_columns(req, cols, _uncached_column(req, cols))


def _uncached_column(req: RoutingRequest, cols: PodColumns) -> FloatArray:
    prompt = float(req.prompt_tokens if req.prompt_tokens > 0 else 0)
    cached = cols.prefix_match_tokens
    uncached: FloatArray = prompt - np.minimum(np.maximum(cached, 0.0), prompt)  # whole tokens
    return uncached


def _feature_columns(req: RoutingRequest, cols: PodColumns, uncached: FloatArray) -> FloatArray:
    x = np.array(  # one row per feature (row 0, the intercept, is overwritten)
        (uncached, uncached, cols.in_flight, cols.waiting, cols.running, cols.kv_usage,
         cols.in_flight_tokens)
    )  # fmt: skip
    x[0] = 1.0
    x[1] /= 1000.0
    # The engine's signals: unknown (NaN), negative or infinite is 0, KV usage at most 1; the
    # in-flight counts (finite) at least 0. `fmax` takes 0 over NaN.
    rest = x[2:]
    np.fmax(rest, 0.0, out=rest)
    rest[rest == _INF] = 0.0
    np.minimum(x[5], 1.0, out=x[5])
    x[6] /= 10000.0
    return x


class LatencyPrediction(NamedTuple):
    ttft_s: float
    tpot_s: float | None  # None until the pod has enough streamed multi-token answers
    samples: int  # records the pod's model has learned from
    age_s: float = 0.0  # since the pod's model last learned (a pod the rule avoids stops teaching)
    error_s: float = 0.0  # the TTFT model's recent mean absolute error
    routed_s: float = _INF  # since this process last sent the pod a request (a real one)


class PredictionColumns:
    """`LatencyPrediction` for many pods, one array each, in pod order. The TPOT column is
    computed on first read (an SLO header, explain): most decisions never need it."""

    def __init__(
        self,
        *,
        warm: npt.NDArray[np.bool_],  # False: the pod's model is cold (its values mean nothing)
        ttft_s: FloatArray,
        samples: FloatArray,
        age_s: FloatArray,
        error_s: FloatArray,
        routed_s: FloatArray,
        # The TPOT of the pod at this position (None: all), NaN where not learned yet.
        tpot: Callable[[int | None], FloatArray],
    ) -> None:
        self.warm, self.ttft_s, self.samples = warm, ttft_s, samples
        self.age_s, self.error_s, self.routed_s = age_s, error_s, routed_s
        self._tpot = tpot

    @cached_property
    def tpot_s(self) -> FloatArray:
        return self._tpot(None)

    def tpot_at(self, i: int) -> float | None:
        """One pod's TPOT (None while not learned), without the whole column."""
        column = self.__dict__.get("tpot_s")
        value = float(self._tpot(i)[0] if column is None else column[i])
        return None if value != value else value


class LatencyPredictor(Protocol):
    def predict(
        self, model: str, address: str, features: LatencyFeatures
    ) -> LatencyPrediction | None:
        """The pod's predicted latencies for a request with `features`; None while the pod's
        model is cold (too few samples). Finite and >= 0 when not None."""
        ...

    def predict_columns(
        self, model: str, addresses: Sequence[str], features: FloatArray
    ) -> PredictionColumns | None:
        """`predict` for every address at once (`features`: `latency_feature_columns`, one
        column per address), the same values; None when every pod is cold."""
        ...


class ColdPredictor:
    """No model wired (a registry built without the app): every pod is cold, the cost rule runs."""

    def predict(
        self, model: str, address: str, features: LatencyFeatures
    ) -> LatencyPrediction | None:
        return None

    def predict_columns(
        self, model: str, addresses: Sequence[str], features: FloatArray
    ) -> PredictionColumns | None:
        return None


@dataclass(frozen=True, slots=True)
class PredictedLatencyParams:
    # Against herding, the order is sampled from softmax(-(ttft - best) / (T * spread)), spread
    # being the models' own mean error (at least 5 % of the best prediction): pods the models
    # cannot tell apart share the traffic, a pod predicted many errors slower gets none.
    # At T = 1 a pod one error behind is picked 1/e as often as the best; 0 = lowest wins.
    temperature: float = 1.0
    # The spread at most this share of the best prediction (0: no cap). Under overload the
    # models' absolute error grows with the queues, mostly alike on every pod (all slow
    # together), not in how pods compare; spread that wide, the softmax turned near-uniform
    # and sent a customer's requests away from its cache, which slowed every pod further
    # (`kvwins` in the twin: 5 of 12 seeds collapsed to p50 227-332 ms from 116-175; with the
    # cap 0 of 12; live 144 ms against 352; docs/strategies.md, predicted-latency).
    spread_cap: float = 0.25
    overlap_weight: float = 1.0  # the cold-start cost rule's (kv-aware) prefill weight
    # The models decide once every candidate's has learned this many samples (until then the
    # cost rule does): as many as a model remembers (forgetting 0.98: ~50). Fitted on fewer,
    # early ones (7 coefficients from 8 samples at a low load, 8 until 2026-12-07) a cold
    # start took the wrong turn under a rising load: on kvwins' capture replayed from no
    # models, p50 above 250 ms in 10 of 16 seeds at 8, 7 at 16, 2 at 32, none at 50 or 64
    # (118-159 ms; docs/strategies.md, predicted-latency).
    min_samples: int = 50
    # A pod whose model has not learned for this long, and that this process has not sent a
    # request for as long, gets one (a probe), so a pod the rule stopped choosing is measured
    # again (it may have got faster); 0 = never.
    probe_after_s: float = 30.0

    def __post_init__(self) -> None:
        values = (self.temperature, self.spread_cap, self.overlap_weight, self.probe_after_s,
                  self.min_samples)  # fmt: skip
        if min(values) < 0:
            raise ValueError(
                "temperature, spread_cap, overlap_weight, probe_after_s and min_samples must "
                "be >= 0"
            )


def slo_ms(headers: Mapping[str, str], *names: str) -> float | None:
    """The first of `names` the request sends (ours, then llm-d's); 400 naming it if bad."""
    for name in names:
        raw = headers.get(name)
        if raw is not None and raw.strip():
            break
    else:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (0 < value <= MAX_SLO_MS):
        raise BadRequest(
            f"{name} must be a number of milliseconds in (0, {MAX_SLO_MS:g}], got {raw[:40]!r}",
            param=name,
            code="invalid_slo",
        )
    return value


def _slo(req: RoutingRequest) -> _Slo | None:
    """The request's SLOs (the director read them from its headers with `slo_ms`); None
    without any (the common case: nothing built)."""
    ttft, tpot = req.slo_ttft_ms, req.slo_tpot_ms
    return None if ttft is None and tpot is None else _Slo(ttft, tpot)


def _ms(seconds: float | None) -> float:
    return round(seconds * 1000.0, 3) if seconds is not None else -1.0


class _Slo(NamedTuple):
    ttft_ms: float | None
    tpot_ms: float | None

    @property
    def text(self) -> str:
        parts = []
        if self.ttft_ms is not None:
            parts.append(f"ttft <= {self.ttft_ms:g} ms")
        if self.tpot_ms is not None:
            parts.append(f"tpot <= {self.tpot_ms:g} ms")
        return ", ".join(parts)

    def refuse(self) -> TooManyRequests:
        return TooManyRequests(
            f"no endpoint is predicted to meet the request's SLO ({self.text}); "
            "sheddable request dropped",
            code=SLO_UNMET,
        )

    def met_note(self, ok: int, n: int) -> str:
        return f"{ok} of {n} pods predicted to meet {self.text}"

    def unmet_note(self) -> str:
        return f"no pod predicted to meet {self.text}: best predicted pod anyway (request not sheddable)"


def _probe_reason(address: str, age_s: float, ttft_s: float) -> str:
    return (
        f"probe: the model of {address} has not learned for {age_s:.0f} s "
        f"(predicted ttft {_ms(ttft_s):g} ms); one request measures it again"
    )


class PredictedLatencyStrategy(StrategyPlugin):
    """Lowest predicted TTFT (per-pod online models), softmax against herding, SLO headers.

    Cold start (any candidate with too few samples): the `kv-aware` cost rule.
    """

    type_name = "predicted-latency"
    Params: ClassVar[type] = PredictedLatencyParams
    capabilities = Capabilities(prompt_tokens=True, prefix_matches=True)

    def __init__(
        self,
        name: str = "",
        params: PredictedLatencyParams | None = None,
        *,
        predictor: LatencyPredictor | None = None,
    ) -> None:
        super().__init__(name, params)
        self.params = params or PredictedLatencyParams()
        self._predictor: LatencyPredictor = predictor or ColdPredictor()
        self._cost = KvAwareStrategy(
            "kv-aware",
            KvAwareParams(
                overlap_weight=self.params.overlap_weight,
                load_share=LoadShare.WHOLE,
                slow_after=0.0,  # the cold-start rule is Dynamo's cost as published
            ),
        )
        t = self.params.temperature
        self._rule = f"softmax T={t:g}" if t > 0 else "argmin"

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        t0 = time.perf_counter_ns()
        slo = _slo(req)
        cols = columns_of(snap.pods)
        uncached = _uncached_column(req, cols)
        x = _feature_columns(req, cols, uncached)
        addresses = cols.addresses
        preds = self._predictor.predict_columns(req.model, addresses, x)
        if preds is None:
            cold_at = np.arange(cols.n)
        else:
            cold_at = (~(preds.warm & (preds.samples >= self.params.min_samples))).nonzero()[0]
        if preds is None or len(cold_at):
            cold = [addresses[i] for i in cold_at[:5].tolist()]
            return self._cold_start(t0, req, snap, rng, cold, slo, len(cold_at))
        n = cols.n
        ttft = preds.ttft_s
        best = float(ttft.min())
        error_sum = float(preds.error_s.cumsum()[-1])  # left to right
        # How far apart predictions must be to mean something: the models' mean error, at
        # most `spread_cap` of the best prediction, at least 5 % of it.
        spread = error_sum / n
        cap = self.params.spread_cap
        if cap > 0 and spread > cap * best:
            spread = cap * best
        spread = max(spread, 0.05 * best, 1e-3)
        totals = (best - ttft) / spread  # <= 0: errors behind the best
        notes: list[str] = []
        head: IntArray | None = None  # None: every pod
        if slo is not None:
            ok = _meets(preds, slo).nonzero()[0]
            if not len(ok) and req.priority < 0:
                raise slo.refuse()
            if len(ok):
                if len(ok) < n:
                    head = ok
                notes.append(slo.met_note(len(ok), n))
            else:
                notes.append(slo.unmet_note())
        if head is None:
            ranked = self._order(totals, rng)
        else:  # the pods predicted to miss the SLO follow as fallbacks, fastest first
            rest = np.isin(np.arange(n), head, invert=True).nonzero()[0]
            ranked = head[self._order(totals[head], rng)]
            ranked = np.concatenate((ranked, rest[rank_order([ttft[rest]], rng)]))
        probe = None
        if self.params.probe_after_s > 0:  # only among the pods predicted to meet an SLO
            probe = self._probe(preds, head)
        if probe is not None and ranked[0] != probe:
            ranked = np.concatenate(([probe], ranked[ranked != probe]))
            reason = _probe_reason(addresses[probe], float(preds.age_s[probe]), float(ttft[probe]))
        else:
            i = int(ranked[0])
            reason = self._min_reason(addresses[i], float(ttft[i]), preds.tpot_at(i))
        if notes:
            reason += "; " + "; ".join(notes)
        scores = _PredictionScores(addresses, preds, uncached, totals)
        return self.decision(t0, cols.endpoints_at(ranked), reason, scores)

    def _order(self, totals: FloatArray, rng: random.Random) -> IntArray:
        """Positions by `totals`, best first: the `softmax` picker's order (Gumbel top-k, ties
        to the later position), or at temperature 0 the `max-score` picker's (ties at random)."""
        t = self.params.temperature
        if t <= 0:
            return rank_order([-totals], rng)
        return gumbel_order(totals if t == 1.0 else totals / t, rng)

    def _min_reason(self, address: str, ttft_s: float, tpot_s: float | None) -> str:
        return (
            f"min predicted ttft ({self._rule}): {address} "
            f"ttft {_ms(ttft_s):g} ms, tpot {_ms(tpot_s):g} ms"
        )

    def _probe(self, preds: PredictionColumns, among: IntArray | None) -> int | None:
        """The pod (of `among`; None: every pod) whose model is stalest past `probe_after_s`
        and that this process has not sent a request for as long (the last one among equals).
        Reads state, writes none."""
        after = self.params.probe_after_s
        if preds.age_s.max() < after:  # the common case: every model learned lately
            return None
        if among is None:
            among = np.arange(len(preds.age_s))
        age = preds.age_s[among]
        due = among[(age >= after) & (preds.routed_s[among] >= after)]
        if not len(due):
            return None
        ages = preds.age_s[due]
        return int(due[(ages == ages.max()).nonzero()[0][-1]])

    def _cold_start(
        self,
        t0: int,
        req: RoutingRequest,
        snap: Snapshot,
        rng: random.Random,
        cold: Sequence[str],
        slo: _Slo | None,
        n_cold: int | None = None,
    ) -> Decision:
        fallback = self._cost.route(req, snap, rng)
        n_cold = len(cold) if n_cold is None else n_cold
        reason = (
            f"cold start ({n_cold} of {len(snap.pods)} pods with too few samples: "
            f"{','.join(cold[:4])}{',...' if n_cold > 4 else ''}): "
            f"cost rule (kv-aware) {fallback.reason}"
        )
        if slo is not None:
            reason += "; SLO headers not applied (no prediction yet)"
        return self.decision(t0, fallback.ranked, reason, fallback.scores)


class _PredictionScores(Mapping[str, Mapping[str, float]]):
    """`Decision.scores` built only when read (explain, the status page), not per decision."""

    __slots__ = ("_addresses", "_index", "_preds", "_totals", "_uncached")

    def __init__(
        self,
        addresses: Sequence[str],
        preds: PredictionColumns,
        uncached: FloatArray,
        totals: FloatArray,
    ) -> None:
        self._addresses, self._preds, self._uncached, self._totals = (
            addresses, preds, uncached, totals,
        )  # fmt: skip
        self._index: dict[str, int] | None = None

    def __getitem__(self, address: str) -> Mapping[str, float]:
        if self._index is None:
            self._index = {a: i for i, a in enumerate(self._addresses)}
        i = self._index[address]
        p = self._preds
        tpot = float(p.tpot_s[i])
        return _scores(
            float(p.ttft_s[i]),
            None if tpot != tpot else tpot,
            float(self._uncached[i]),
            float(p.samples[i]),
            float(self._totals[i]),
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._addresses)

    def __len__(self) -> int:
        return len(self._addresses)


def _scores(
    ttft_s: float, tpot_s: float | None, uncached: float, samples: float, total: float
) -> dict[str, float]:
    return {
        "pred_ttft_ms": _ms(ttft_s),
        "pred_tpot_ms": _ms(tpot_s),  # -1: TPOT not learned yet
        "uncached_tokens": float(uncached),
        "samples": float(samples),
        "errors_behind_best": round(0.0 - total, 4),
    }


def _meets(preds: PredictionColumns, slo: _Slo) -> npt.NDArray[np.bool_]:
    """Whether each pod is predicted to meet the SLO (a NaN TPOT, not learned, meets no TPOT
    target)."""
    ok = np.ones(len(preds.ttft_s), dtype=bool)
    if slo.ttft_ms is not None:
        ok &= preds.ttft_s * 1000.0 <= slo.ttft_ms
    if slo.tpot_ms is not None:
        ok &= preds.tpot_s * 1000.0 <= slo.tpot_ms
    return ok
