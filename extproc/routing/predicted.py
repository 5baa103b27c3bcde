"""predicted-latency: pick the pod with the lowest predicted TTFT, from per-pod models learned
online from the gateway's own accounting records.

The rule reads a `LatencyPredictor` (the composition root injects
`extproc.accounting.latency_model.LatencyModels` through the plugin factory); routing only reads
it, the accounting side writes it. What a prediction depends on is `LatencyFeatures`: what the
decision knows about a pod (this request's uncached prompt tokens there, the gateway's in-flight
requests and tokens, the engine's queue, running requests and KV usage). The same features travel
with the request in its access-log record, so whichever process accounts the record learns from
exactly what the decision saw.

Until every candidate's model has enough samples the rule is the cost rule (`kv-aware`: uncached
prefill blocks + the pod's in-flight blocks), and the reason says which pods are cold.
Per-request SLO headers keep only the pods predicted to meet them; a sheddable request
(priority < 0) with no such pod is refused with 429, any other goes to the best pod anyway.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Protocol

from extproc.routing import signals
from extproc.routing.affinity import KvAwareParams, KvAwareStrategy
from extproc.routing.base import Capabilities, Decision, PodState, RoutingRequest, Snapshot
from extproc.routing.framework import MaxScorePicker, SoftmaxParams, SoftmaxPicker
from extproc.routing.strategies import StrategyPlugin
from extproc.types import BadRequest, TooManyRequests

__all__ = [
    "FEATURE_NAMES",
    "SLO_TPOT_HEADER",
    "SLO_TTFT_HEADER",
    "ColdPredictor",
    "LatencyFeatures",
    "LatencyPrediction",
    "LatencyPredictor",
    "PredictedLatencyParams",
    "PredictedLatencyStrategy",
    "latency_features",
]

SLO_TTFT_HEADER = "x-slo-ttft-ms"
SLO_TPOT_HEADER = "x-slo-tpot-ms"
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


class LatencyPrediction(NamedTuple):
    ttft_s: float
    tpot_s: float | None  # None until the pod has enough streamed multi-token answers
    samples: int  # records the pod's model has learned from
    age_s: float = 0.0  # since the pod's model last learned (a pod the rule avoids stops teaching)
    error_s: float = 0.0  # the TTFT model's recent mean absolute error


class LatencyPredictor(Protocol):
    def predict(
        self, model: str, address: str, features: LatencyFeatures
    ) -> LatencyPrediction | None:
        """The pod's predicted latencies for a request with `features`; None while the pod's
        model is cold (too few samples). Finite and >= 0 when not None."""
        ...


class ColdPredictor:
    """No model wired (a registry built without the app): every pod is cold, the cost rule runs."""

    def predict(
        self, model: str, address: str, features: LatencyFeatures
    ) -> LatencyPrediction | None:
        return None


@dataclass(frozen=True, slots=True)
class PredictedLatencyParams:
    # Against herding, the order is sampled from softmax(-(ttft - best) / (T * spread)), spread
    # being the models' own mean error (at least 5 % of the best prediction): pods the models
    # cannot tell apart share the traffic, a pod predicted many errors slower gets none.
    # At T = 1 a pod one error behind is picked 1/e as often as the best; 0 = lowest wins.
    temperature: float = 1.0
    overlap_weight: float = 1.0  # the cold-start cost rule's (kv-aware) prefill weight
    # A pod whose model has not learned for this long gets one request (a probe) per period, so
    # a pod the rule stopped choosing is measured again (it may have got faster); 0 = never.
    probe_after_s: float = 30.0

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.overlap_weight < 0 or self.probe_after_s < 0:
            raise ValueError("temperature, overlap_weight and probe_after_s must be >= 0")


def _slo_ms(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None or not raw.strip():
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


def _ms(seconds: float | None) -> float:
    return round(seconds * 1000.0, 3) if seconds is not None else -1.0


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
            "kv-aware", KvAwareParams(overlap_weight=self.params.overlap_weight)
        )
        t = self.params.temperature
        self._picker = (
            SoftmaxPicker("softmax", SoftmaxParams(temperature=t)) if t > 0 else MaxScorePicker()
        )
        self._rule = f"softmax T={t:g}" if t > 0 else "argmin"
        self._probed: dict[str, float] = {}  # pod -> when this instance last probed it

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        t0 = time.perf_counter_ns()
        slo_ttft = _slo_ms(req.headers, SLO_TTFT_HEADER)
        slo_tpot = _slo_ms(req.headers, SLO_TPOT_HEADER)
        pods = snap.pods
        predict = self._predictor.predict
        model = req.model
        preds: list[LatencyPrediction] = []
        uncached: list[int] = []
        cold: list[PodState] = []
        for p in pods:
            f = latency_features(req, p)
            uncached.append(f[0])
            pred = predict(model, p.address, f)
            if pred is None:
                cold.append(p)
            else:
                preds.append(pred)
        if cold:
            return self._cold_start(t0, req, snap, rng, cold, slo_ttft or slo_tpot)
        ttfts = [pr[0] for pr in preds]
        best = min(ttfts)
        # How far apart predictions must be to mean something: the models' mean error.
        spread = max(sum(pr.error_s for pr in preds) / len(preds), 0.05 * best, 1e-3)
        totals = [(best - t) / spread for t in ttfts]  # <= 0: errors behind the best
        notes: list[str] = []
        head_idx: Sequence[int] = range(len(pods))
        if slo_ttft is not None or slo_tpot is not None:
            target = _slo_text(slo_ttft, slo_tpot)
            ok = [i for i, pr in enumerate(preds) if _meets(pr, slo_ttft, slo_tpot)]
            if not ok and req.priority < 0:
                raise TooManyRequests(
                    f"no endpoint is predicted to meet the request's SLO ({target}); "
                    "sheddable request dropped"
                )
            if ok:
                head_idx = ok
                notes.append(f"{len(ok)} of {len(pods)} pods predicted to meet {target}")
            else:
                notes.append(
                    f"no pod predicted to meet {target}: best predicted pod anyway "
                    "(request not sheddable)"
                )
        if len(head_idx) == len(pods):
            ranked = self._picker.rank(pods, totals, rng)
        else:  # the pods predicted to miss the SLO follow as fallbacks, fastest first
            ranked = self._picker.rank(
                [pods[i] for i in head_idx], [totals[i] for i in head_idx], rng
            )
            taken = set(head_idx)
            rest = sorted((ttfts[i], rng.random(), i) for i in range(len(pods)) if i not in taken)
            ranked += [pods[i] for _, _, i in rest]
        probe = None
        if self.params.probe_after_s > 0:  # only among the pods predicted to meet an SLO
            probe = self._probe(pods, preds, head_idx, snap.now)
        if probe is not None and ranked[0] is not pods[probe]:
            pick = pods[probe]
            ranked = [pick, *(p for p in ranked if p is not pick)]
            pred = preds[probe]
            reason = (
                f"probe: the model of {pick.address} has not learned for {pred.age_s:.0f} s "
                f"(predicted ttft {_ms(pred.ttft_s):g} ms); one request measures it again"
            )
        else:
            pick = ranked[0]
            pred = preds[next(i for i, p in enumerate(pods) if p is pick)]
            reason = (
                f"min predicted ttft ({self._rule}): {pick.address} "
                f"ttft {_ms(pred.ttft_s):g} ms, tpot {_ms(pred.tpot_s):g} ms"
            )
        if notes:
            reason += "; " + "; ".join(notes)
        return Decision(
            ranked=tuple([p.endpoint for p in ranked]),
            strategy=self.name,
            scores=_PredictionScores(pods, preds, uncached, totals),
            reason=reason,
            timings=((self.ref, time.perf_counter_ns() - t0),),
        )

    def _probe(
        self,
        pods: Sequence[PodState],
        preds: Sequence[LatencyPrediction],
        among: Sequence[int],
        now: float,
    ) -> int | None:
        """The pod whose model is stalest past `probe_after_s` and not probed for as long."""
        after = self.params.probe_after_s
        found, oldest = None, after
        for i in among:
            pr = preds[i]
            if pr.age_s >= oldest and now - self._probed.get(pods[i].address, -math.inf) >= after:
                found, oldest = i, pr.age_s
        if found is not None:
            if len(self._probed) > 4 * len(pods) + 64:
                self._probed.clear()  # pods that left: bounded by the pool
            self._probed[pods[found].address] = now
        return found

    def _cold_start(
        self,
        t0: int,
        req: RoutingRequest,
        snap: Snapshot,
        rng: random.Random,
        cold: Sequence[PodState],
        slo: float | None,
    ) -> Decision:
        fallback = self._cost.route(req, snap, rng)
        reason = (
            f"cold start ({len(cold)} of {len(snap.pods)} pods with too few samples: "
            f"{signals.addresses(cold[:4])}{',...' if len(cold) > 4 else ''}): "
            f"cost rule (kv-aware) {fallback.reason}"
        )
        if slo is not None:
            reason += "; SLO headers not applied (no prediction yet)"
        return self.decision(
            t0, _pods_in_order(fallback, snap.pods), reason, _dict_scores(fallback)
        )


class _PredictionScores(Mapping[str, Mapping[str, float]]):
    """`Decision.scores` built only when read (explain, the status page), not per decision."""

    __slots__ = ("_index", "_pods", "_preds", "_totals", "_uncached")

    def __init__(
        self,
        pods: Sequence[PodState],
        preds: Sequence[LatencyPrediction],
        uncached: Sequence[int],
        totals: Sequence[float],
    ) -> None:
        self._pods, self._preds, self._uncached, self._totals = pods, preds, uncached, totals
        self._index: dict[str, int] | None = None

    def __getitem__(self, address: str) -> Mapping[str, float]:
        if self._index is None:
            self._index = {p.address: i for i, p in enumerate(self._pods)}
        i = self._index[address]
        pr = self._preds[i]
        return {
            "pred_ttft_ms": _ms(pr.ttft_s),
            "pred_tpot_ms": _ms(pr.tpot_s),  # -1: TPOT not learned yet
            "uncached_tokens": float(self._uncached[i]),
            "samples": float(pr.samples),
            "errors_behind_best": round(0.0 - self._totals[i], 4),
        }

    def __iter__(self) -> Iterator[str]:
        return (p.address for p in self._pods)

    def __len__(self) -> int:
        return len(self._pods)


def _meets(pred: LatencyPrediction, slo_ttft: float | None, slo_tpot: float | None) -> bool:
    ttft_ok = slo_ttft is None or pred.ttft_s * 1000.0 <= slo_ttft
    tpot_ok = slo_tpot is None or (pred.tpot_s is not None and pred.tpot_s * 1000.0 <= slo_tpot)
    return ttft_ok and tpot_ok


def _slo_text(slo_ttft: float | None, slo_tpot: float | None) -> str:
    parts = []
    if slo_ttft is not None:
        parts.append(f"ttft <= {slo_ttft:g} ms")
    if slo_tpot is not None:
        parts.append(f"tpot <= {slo_tpot:g} ms")
    return ", ".join(parts)


def _pods_in_order(decision: Decision, pods: Sequence[PodState]) -> list[PodState]:
    by_address = {p.address: p for p in pods}
    return [by_address[e.address] for e in decision.ranked]


def _dict_scores(decision: Decision) -> dict[str, dict[str, float]]:
    return {a: dict(s) for a, s in decision.scores.items()}
