"""Per-pod latency models learned online from accounting records (no sidecar).

For each (model, pod): TTFT and time per output token as linear functions of what the routing
decision knew (`extproc.routing.predicted.LatencyFeatures`: uncached prompt tokens, in-flight
requests and tokens, the engine's queue, running requests and KV usage), fitted by exponentially
weighted ridge regression. The weighted sums X'WX and X'Wy are kept (d = 7) and the normal
equations solved by Cholesky after each sample (tens of µs in pure Python, on the accounting
path); a prediction is one dot product per candidate (a few µs with its features, on the decision
path; `bench/routing_bench.py` times the strategy). The strategy predicts every candidate at
once (`predict_columns`): each served model's warm coefficients are also kept as rows of
numpy arrays (`CoefficientTable`), written when a pod's model learns, never rebuilt per request.

Why this shape: every pod gets its own coefficients, so a slower pod predicts slower
(heterogeneous pools are the point); the forgetting factor tracks a pod that changes (a new
engine version, a noisy neighbour); the ridge term keeps the solve well-posed when a feature
never varies (a pod that never queued), and sums instead of a recursive-least-squares covariance
cannot wind up. Robust: a record with a non-finite, negative or absurd value is ignored; once a
model is warm, a residual far outside its recent scale is down-weighted (Huber), so one stalled
request does not move the coefficients much; predictions are clamped to [half the smallest
sample seen, a few times the largest] and never NaN (a linear fit pushed outside what it saw can
give a negative TTFT; clamped to 0, such a pod looked instantly fast and won every decision).

The decision's features and prediction travel in the request's metadata as one compact string
(`DecisionTag.encode`), so whichever process gets the record learns from it and measures the
prediction's error (`extproc_latency_prediction_error_seconds{pod,kind}`).
"""

from __future__ import annotations

import math
import operator
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np
from prometheus_client import CollectorRegistry, Histogram

from extproc.routing.columns import FloatArray, IntArray
from extproc.routing.predicted import (
    FEATURE_NAMES,
    LatencyFeatures,
    LatencyPrediction,
    PredictionColumns,
)

__all__ = [
    "CoefficientTable",
    "DecisionTag",
    "LatencyMetrics",
    "LatencyModels",
    "LearnedModels",
    "OnlineRidge",
    "PodLatencyModel",
    "fullest_rows",
]

MAX_LATENCY_S = 600.0  # a TTFT or TPOT sample above this is a broken record, not a sample
MAX_TAG_CHARS = 200
RECENT_CHECKS = 10  # predictions kept per pod with their actual values, for the debug view
ERROR_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _ok(value: float) -> bool:
    return math.isfinite(value) and 0.0 <= value <= MAX_LATENCY_S


class OnlineRidge:
    """Exponentially weighted ridge regression: minimises sum_i lambda^(n-i) w_i (y_i - x_i.b)^2
    + ridge |b[1:]|^2, from its sufficient statistics."""

    __slots__ = ("_a", "_b", "_forgetting", "_ridge", "coef", "dim", "weight")

    def __init__(self, dim: int, *, forgetting: float = 0.98, ridge: float = 1e-3) -> None:
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        self.dim = dim
        self._forgetting = forgetting
        self._ridge = ridge
        self._a = [[0.0] * dim for _ in range(dim)]
        self._b = [0.0] * dim
        self.coef = [0.0] * dim
        self.weight = 0.0  # effective number of samples (sum of decayed weights)

    def observe(self, x: tuple[float, ...], y: float, weight: float = 1.0) -> None:
        lam, a, b = self._forgetting, self._a, self._b
        for i in range(self.dim):
            xi = x[i] * weight
            row = a[i]
            for j in range(i + 1):
                row[j] = lam * row[j] + xi * x[j]
            b[i] = lam * b[i] + xi * y
        self.weight = lam * self.weight + weight
        self._solve()

    def predict(self, x: tuple[float, ...]) -> float:
        c = self.coef
        return sum(c[i] * x[i] for i in range(self.dim))

    def sums(self) -> list[float]:
        """What it has learned as plain numbers (`restore`): the effective samples, X'WX's
        lower triangle row by row, X'Wy."""
        triangle = [self._a[i][j] for i in range(self.dim) for j in range(i + 1)]
        return [self.weight, *triangle, *self._b]

    def restore(self, sums: Sequence[float]) -> bool:
        """Take `sums` (from `sums`, of a regression of this dimension) and solve; False, and
        nothing changed, when they are not a positive definite system's."""
        n = self.dim
        if len(sums) != 1 + n * (n + 1) // 2 + n:
            return False
        triangle = iter(sums[1 : 1 + n * (n + 1) // 2])
        a = [[0.0] * n for _ in range(n)]
        for i in range(n):
            for j in range(i + 1):
                a[i][j] = next(triangle)
        kept = (self._a, self._b, self.coef, self.weight)
        self._a, self._b, self.weight = a, list(sums[1 + n * (n + 1) // 2 :]), sums[0]
        self.coef = [math.nan] * n
        self._solve()
        if not all(math.isfinite(c) for c in self.coef):
            self._a, self._b, self.coef, self.weight = kept
            return False
        return True

    def _solve(self) -> None:
        """Cholesky on (A + ridge I); the intercept gets a token ridge only. Keeps the last
        good coefficients when the system is not positive definite (cannot happen with
        ridge > 0 in exact arithmetic; a guard against rounding)."""
        n, a = self.dim, self._a
        low = [[0.0] * n for _ in range(n)]
        for i in range(n):
            for j in range(i + 1):
                s = a[i][j]
                if i == j:
                    s += self._ridge if i > 0 else 1e-9
                for k in range(j):
                    s -= low[i][k] * low[j][k]
                if i == j:
                    if not s > 0.0 or not math.isfinite(s):
                        return
                    low[i][i] = math.sqrt(s)
                else:
                    low[i][j] = s / low[j][j]
        z = [0.0] * n
        for i in range(n):
            z[i] = (self._b[i] - sum(low[i][k] * z[k] for k in range(i))) / low[i][i]
        coef = [0.0] * n
        for i in reversed(range(n)):
            coef[i] = (z[i] - sum(low[k][i] * coef[k] for k in range(i + 1, n))) / low[i][i]
        if all(math.isfinite(c) for c in coef):
            self.coef = coef


class _Target:
    """One learned quantity (TTFT or TPOT) of one pod: the regression and its residual scale."""

    __slots__ = ("max_seen", "min_seen", "reg", "samples", "scale")

    def __init__(self, dim: int, forgetting: float, ridge: float) -> None:
        self.reg = OnlineRidge(dim, forgetting=forgetting, ridge=ridge)
        self.samples = 0
        self.scale = 0.0  # EW mean of |residual|
        self.max_seen = 0.0
        self.min_seen = math.inf

    def observe(self, x: tuple[float, ...], y: float, min_samples: int, huber_k: float) -> None:
        weight = 1.0
        if self.samples >= min_samples:
            r = abs(y - self.reg.predict(x))
            bound = huber_k * max(self.scale, 1e-3 * max(y, 1e-3))
            if r > bound:
                weight = bound / r  # an outlier moves the fit like a sample at the bound
            self.scale = 0.9 * self.scale + 0.1 * min(r, 4 * bound)
        elif self.samples > 0:
            self.scale = 0.9 * self.scale + 0.1 * abs(y - self.reg.predict(x))
        self.reg.observe(x, y, weight)
        self.samples += 1
        self.max_seen = max(self.max_seen * 0.999, y)
        self.min_seen = min(self.min_seen * 1.001, y)

    def values(self) -> list[float]:
        """What it has learned as plain numbers (`restore`)."""
        return [self.samples, self.scale, self.max_seen, self.min_seen, *self.reg.sums()]

    def restore(self, values: Sequence[Any]) -> bool:
        """Take `values` (from `values`); False, and nothing changed, for anything that is not
        a learned target's: a count, a residual scale and sample bounds within what a sample
        may be, finite sums of a positive definite system."""
        if not isinstance(values, list | tuple) or len(values) < 5:
            return False
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            return False
        samples, scale, max_seen, min_seen = values[:4]
        if not (samples == int(samples) >= 1 and _ok(scale) and _ok(max_seen)):
            return False
        if not (_ok(min_seen) and min_seen <= max_seen):
            return False
        if not all(math.isfinite(v) for v in values[4:]) or not self.reg.restore(values[4:]):
            return False
        self.samples, self.scale = int(samples), float(scale)
        self.max_seen, self.min_seen = float(max_seen), float(min_seen)
        return True

    @property
    def cap(self) -> float:
        """The largest prediction: a few times the largest sample seen (extrapolation bound)."""
        return 4.0 * self.max_seen + 1e-3

    @property
    def floor(self) -> float:
        """The smallest prediction: half the smallest sample seen (extrapolation bound)."""
        return 0.5 * self.min_seen if self.min_seen < math.inf else 0.0

    def predict(self, x: tuple[float, ...]) -> float:
        return _clamped(self.reg.predict(x), self.floor, self.cap)


def _claimed_samples(values: Any) -> float:
    """The TTFT sample count a peer's model values say they hold (`PodLatencyModel.values`),
    unchecked (`restore` checks); infinity when they do not say, so no model is kept for
    them and `restore` refuses them."""
    try:
        count = values[0][0]
    except (TypeError, IndexError, KeyError):
        return math.inf
    return (
        float(count) if isinstance(count, int | float) and not isinstance(count, bool) else math.inf
    )


def _row(row: Any) -> tuple[str, str, Any] | None:
    """A peer's row (`LatencyModels.rows`) as (model, address, values); None when it is not
    shaped so (its values are `restore`'s to check)."""
    if not isinstance(row, list | tuple) or len(row) != 3:
        return None
    model, address, values = row
    if not isinstance(model, str) or not isinstance(address, str):
        return None
    return model, address, values


def fullest_rows(rows: Iterable[Any]) -> list[list[Any]]:
    """Of several replicas' `LatencyModels.rows`, each pod's that learned the most samples (the
    one `adopt` would keep), in first-seen order; a row not shaped `[model, address, values]`
    is left out (`adopt` would refuse it). One capture's line from every process's export."""
    best: dict[tuple[str, str], list[Any]] = {}
    for row in rows:
        if (parts := _row(row)) is None:
            continue
        model, address, values = parts
        claimed = _claimed_samples(values)
        if not math.isfinite(claimed):
            continue
        kept = best.get((model, address))
        if kept is None or claimed > _claimed_samples(kept[2]):
            best[(model, address)] = [model, address, values]
    return list(best.values())


def _ms3(seconds: float | None) -> Any:
    return None if seconds is None else round(seconds * 1000.0, 3)


def _clamped(value: float, floor: float, cap: float) -> float:
    """`value` within [floor, cap]; NaN (cannot happen with finite inputs) becomes the cap."""
    if value != value:
        return cap
    return floor if value < floor else cap if value > cap else value


class _Fit(NamedTuple):
    """What a warm pod's prediction needs, refreshed after each sample."""

    ttft_coef: tuple[float, ...]
    ttft_floor: float
    ttft_cap: float
    tpot_coef: tuple[float, ...] | None  # None while TPOT is cold
    tpot_floor: float
    tpot_cap: float
    samples: int
    error: float  # the TTFT's mean absolute error


class PodLatencyModel:
    """TTFT and TPOT of one pod."""

    __slots__ = ("_forgetting", "_huber", "_min", "_ridge", "checked", "fit", "routed_at", "tpot",
                 "ttft", "updated_at")  # fmt: skip

    def __init__(
        self, *, forgetting: float, ridge: float, min_samples: int, huber_k: float
    ) -> None:
        dim = len(FEATURE_NAMES)
        self._forgetting, self._ridge = forgetting, ridge
        self.ttft = _Target(dim, forgetting, ridge)
        self.tpot = _Target(dim, forgetting, ridge)
        self._min = min_samples
        self._huber = huber_k
        self.updated_at = 0.0
        self.routed_at = -math.inf  # when this process last sent the pod a request
        self.fit: _Fit | None = None  # None while cold
        # The last predictions checked against what happened: (predicted, actual) TTFT and
        # TPOT in ms, for the debug view (the metric has the distribution).
        self.checked: deque[tuple[float, float, float | None, float | None]] = deque(
            maxlen=RECENT_CHECKS
        )

    def observe(self, x: tuple[float, ...], ttft_s: float | None, tpot_s: float | None) -> None:
        if ttft_s is not None:
            self.ttft.observe(x, ttft_s, self._min, self._huber)
        if tpot_s is not None:
            self.tpot.observe(x, tpot_s, self._min, self._huber)
        self._refit()

    def _refit(self) -> None:
        ttft, tpot = self.ttft, self.tpot
        if ttft.samples >= self._min:
            tpot_coef = tuple(tpot.reg.coef) if tpot.samples >= self._min else None
            self.fit = _Fit(tuple(ttft.reg.coef), ttft.floor, ttft.cap, tpot_coef, tpot.floor,
                            tpot.cap, ttft.samples, ttft.scale)  # fmt: skip

    def values(self) -> list[Any]:
        """What it has learned as plain numbers (`restore`): the TTFT's, the TPOT's (None
        while it has no sample)."""
        return [self.ttft.values(), self.tpot.values() if self.tpot.samples else None]

    def restore(self, values: Any) -> bool:
        """Take a model's `values` (another replica's, `values`); False, and nothing changed,
        for anything else."""
        if not isinstance(values, list | tuple) or len(values) != 2:
            return False
        ttft, tpot = values
        dim = len(FEATURE_NAMES)
        new_ttft = _Target(dim, self._forgetting, self._ridge)
        new_tpot = _Target(dim, self._forgetting, self._ridge)
        if not new_ttft.restore(ttft):
            return False
        if tpot is not None and not new_tpot.restore(tpot):
            return False
        self.ttft, self.tpot = new_ttft, new_tpot
        self._refit()
        return True

    def predict(self, x: tuple[float, ...], now: float) -> LatencyPrediction | None:
        fit = self.fit
        if fit is None:
            return None
        ttft = _clamped(sum(map(operator.mul, fit.ttft_coef, x)), fit.ttft_floor, fit.ttft_cap)
        age, routed = now - self.updated_at, now - self.routed_at
        if fit.tpot_coef is None:
            return LatencyPrediction(ttft, None, fit.samples, age, fit.error, routed)
        tpot = _clamped(sum(map(operator.mul, fit.tpot_coef, x)), fit.tpot_floor, fit.tpot_cap)
        return LatencyPrediction(ttft, tpot, fit.samples, age, fit.error, routed)

    def state(self) -> dict[str, Any]:
        def target(t: _Target) -> dict[str, Any]:
            return {
                "samples": t.samples,
                "effective_samples": round(t.reg.weight, 2),
                "mean_abs_residual_s": round(t.scale, 6),
                "coefficients": {
                    n: round(c, 6) for n, c in zip(FEATURE_NAMES, t.reg.coef, strict=True)
                },
            }

        return {
            "warm": self.ttft.samples >= self._min,
            "ttft": target(self.ttft),
            "tpot": target(self.tpot),
            "predicted_vs_actual_ms": [
                {"ttft": [p, a], "tpot": [pt, at]} for p, a, pt, at in self.checked
            ],
        }


class CoefficientTable:
    """One served model's pods as columns of arrays (one column per pod, one row per
    coefficient or value): what `PodLatencyModel.predict` reads, for predicting every
    candidate at once. A pod's column is written when its model learns (or the pod is routed
    to); a request only gathers columns. Column 0 is a spare that is never warm: an address
    without a model reads it."""

    __slots__ = ("_last", "free", "index", "meta", "tpot", "ttft", "version")

    def __init__(self, slots: int = 16) -> None:
        dim = len(FEATURE_NAMES)
        self.index: dict[str, int] = {}
        self.version = 0  # bumped when an address gets or loses its column
        self.free: list[int] = list(range(slots - 1, 0, -1))  # column 0 is the spare
        self.ttft = np.zeros((dim, slots))
        self.tpot = np.zeros((dim, slots))
        self.meta = np.zeros((len(_META), slots))
        self.meta[_ROUTED_AT] = -math.inf
        # The columns of the last addresses asked for: a pool asks for the same list each time.
        self._last: tuple[list[str], int, IntArray] = ([], -1, np.empty(0, dtype=np.intp))

    def slot(self, address: str) -> int:
        """The address's column, taken (and the arrays grown) on first use."""
        found = self.index.get(address)
        if found is not None:
            return found
        if not self.free:
            old = self.meta.shape[1]
            for name in ("ttft", "tpot", "meta"):
                values = getattr(self, name)
                grown = np.zeros((values.shape[0], 2 * old))
                grown[:, :old] = values
                setattr(self, name, grown)
            self.meta[_ROUTED_AT, old:] = -math.inf
            self.free.extend(range(2 * old - 1, old - 1, -1))
        slot = self.index[address] = self.free.pop()
        self.version += 1
        return slot

    def write(self, address: str, pod: PodLatencyModel) -> None:
        """The pod's model as it predicts now (after it learned)."""
        fit = pod.fit
        if fit is None:
            return
        i = self.slot(address)
        self.ttft[:, i] = fit.ttft_coef
        if fit.tpot_coef is not None:
            self.tpot[:, i] = fit.tpot_coef
        tpot_warm = 1.0 if fit.tpot_coef is not None else 0.0
        self.meta[:, i] = (1.0, fit.ttft_floor, fit.ttft_cap, tpot_warm, fit.tpot_floor,
                           fit.tpot_cap, fit.samples, fit.error, pod.updated_at,
                           pod.routed_at)  # fmt: skip

    def routed(self, address: str, at: float) -> None:
        i = self.index.get(address)
        if i is not None:
            self.meta[_ROUTED_AT, i] = at

    def drop(self, address: str) -> None:
        i = self.index.pop(address, None)
        if i is not None:
            self.meta[:, i] = 0.0
            self.meta[_ROUTED_AT, i] = -math.inf
            self.free.append(i)
            self.version += 1

    def slots(self, addresses: Sequence[str]) -> IntArray:
        last, version, slots = self._last
        if version != self.version or addresses != last:
            n = len(addresses)
            slots = np.fromiter(map(self.index.get, addresses, repeat(0)), np.intp, n)
            self._last = (list(addresses), self.version, slots)
        return slots

    def predict(self, addresses: Sequence[str], x: FloatArray, now: float) -> PredictionColumns:
        """`PodLatencyModel.predict` for every address (features `x`: one row per feature, one
        column per address), with the same float steps: the dot product summed left to right,
        then clamped."""
        at = self.slots(addresses)
        meta = np.take(self.meta, at, axis=1)

        def tpot(one: int | None) -> FloatArray:
            if one is not None:  # one pod (the pick's reason): as `PodLatencyModel.predict`
                if meta[_TPOT_WARM, one] == 0.0:
                    return np.array([np.nan])
                coef = self.tpot[:, int(at[one])].tolist()
                dot = sum(map(operator.mul, coef, x[:, one].tolist()))
                floor, cap = float(meta[_TPOT_FLOOR, one]), float(meta[_TPOT_CAP, one])
                return np.array([_clamped(dot, floor, cap)])
            out = _clamped_columns(
                _dot(np.take(self.tpot, at, axis=1), x), meta[_TPOT_FLOOR], meta[_TPOT_CAP]
            )
            out[meta[_TPOT_WARM] == 0.0] = np.nan
            return out

        return PredictionColumns(
            warm=meta[_WARM] == 1.0,
            ttft_s=_clamped_columns(
                _dot(np.take(self.ttft, at, axis=1), x), meta[_TTFT_FLOOR], meta[_TTFT_CAP]
            ),
            samples=meta[_SAMPLES],
            age_s=now - meta[_UPDATED_AT],
            error_s=meta[_ERROR],
            routed_s=now - meta[_ROUTED_AT],
            tpot=tpot,
        )


# The per-pod values of a `CoefficientTable` column besides its coefficients (`meta` rows).
_META = ("warm", "ttft_floor", "ttft_cap", "tpot_warm", "tpot_floor", "tpot_cap", "samples",
         "error", "updated_at", "routed_at")  # fmt: skip
(_WARM, _TTFT_FLOOR, _TTFT_CAP, _TPOT_WARM, _TPOT_FLOOR, _TPOT_CAP, _SAMPLES, _ERROR, _UPDATED_AT,
 _ROUTED_AT) = range(10)  # fmt: skip


def _dot(coef: FloatArray, x: FloatArray) -> FloatArray:
    """Column-wise dot products, added left to right from 0 as `sum(map(mul, ...))` adds."""
    terms = coef * x
    out: FloatArray = terms[0] + 0.0  # 0 + t, as `sum` starts: a -0.0 first term becomes 0.0
    for term in terms[1:]:
        out += term
    return out


def _clamped_columns(value: FloatArray, floor: FloatArray, cap: FloatArray) -> FloatArray:
    """`_clamped` on arrays: NaN becomes the cap (`_dot` never gives -0.0, where `maximum`
    and `_clamped` could differ)."""
    out: FloatArray = np.minimum(np.maximum(value, floor), cap)
    nan = np.isnan(out)
    if nan.any():
        out[nan] = cap[nan]
    return out


@dataclass(frozen=True, slots=True)
class LearnedModels:
    """What `LatencyModels` has learned, detached from it (`LatencyModels.learned`): every
    pod's model as plain values (`LatencyModels.rows`, what a joining replica is sent too),
    picklable (the twin hands it to its worker processes)."""

    rows: tuple[list[Any], ...]


class LatencyModels:
    """Every pod's latency model, by (model name, pod address). Implements
    `extproc.routing.predicted.LatencyPredictor`. Bounded: past `max_pods` models, the one
    updated longest ago is dropped (a pod that left the pool)."""

    def __init__(
        self,
        *,
        min_samples: int = 8,
        forgetting: float = 0.98,
        ridge: float = 1e-3,
        huber_k: float = 4.0,
        max_pods: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min_samples < 1 or max_pods < 1:
            raise ValueError("min_samples and max_pods must be >= 1")
        self.min_samples = min_samples
        self._forgetting = forgetting
        self._ridge = ridge
        self._huber = huber_k
        self._max = max_pods
        self._clock = clock
        self._pods: dict[tuple[str, str], PodLatencyModel] = {}
        self._tables: dict[str, CoefficientTable] = {}  # by served model: the pods as arrays
        self.ignored = 0  # records (and peers' models) with an unusable value
        self.adopted = 0  # models taken from a peer's (`adopt`)

    def predict(
        self, model: str, address: str, features: LatencyFeatures
    ) -> LatencyPrediction | None:
        pod = self._pods.get((model, address))
        return None if pod is None else pod.predict(features.vector(), self._clock())

    def predict_columns(
        self, model: str, addresses: Sequence[str], features: FloatArray
    ) -> PredictionColumns | None:
        """`predict` for every address at once (`features`: one column per address); None
        when no pod of `model` has a model yet."""
        table = self._tables.get(model)
        return None if table is None else table.predict(addresses, features, self._clock())

    def learned(self) -> LearnedModels:
        """Every pod's model as it stands, detached."""
        return LearnedModels(tuple(self.rows()))

    def start_from(self, learned: LearnedModels) -> None:
        """Take `learned`'s models (`adopt`: as if each had just learned and no request had
        been sent yet): the twin's gateway starts where the running gateway is, whose models
        learn from every request whatever rule routes it."""
        self.adopt(learned.rows)

    def rows(self) -> list[list[Any]]:
        """Every pod's model that has learned a TTFT, as plain values `[model, address,
        values]`: what a replica that just started takes from its peers (`adopt`, over the
        sync bus), and what the twin starts from (`learned`)."""
        return [
            [model, address, pod.values()]
            for (model, address), pod in self._pods.items()
            if pod.ttft.samples
        ]

    def adopt(self, rows: Iterable[Any]) -> int:
        """Take the models in `rows` (another replica's `rows`) for the pods whose own model
        learned fewer samples: a replica that just started (or restarted) routes by what its
        peers learned rather than by a few early samples of its own (which the peer learned
        too: the samples it shares reach this replica before its models). A model that learned
        as many is kept. A malformed row is skipped and counted (`ignored`); never raises.
        Returns how many models were taken."""
        taken = 0
        for row in rows:
            if (parts := _row(row)) is None:
                self.ignored += 1
                continue
            model, address, values = parts
            key = (model, address)
            mine = self._pods.get(key)
            if mine is None and len(self._pods) >= self._max:
                continue  # bounded as learning is
            if mine is not None and mine.ttft.samples >= _claimed_samples(values):
                continue  # the common case (every live peer hears a joiner's snapshot): no solve
            pod = self._new_pod()
            if not pod.restore(values):
                self.ignored += 1
                continue
            pod.updated_at = self._clock()
            self._pods[key] = pod
            self._tables.setdefault(model, CoefficientTable()).write(address, pod)
            taken += 1
        self.adopted += taken
        return taken

    def _new_pod(self) -> PodLatencyModel:
        return PodLatencyModel(
            forgetting=self._forgetting, ridge=self._ridge,
            min_samples=self.min_samples, huber_k=self._huber,
        )  # fmt: skip

    def routed(self, model: str, address: str) -> None:
        """This process just sent the pod a request (a real one, not an explain): the
        predicted-latency probe leaves it alone for a period."""
        pod = self._pods.get((model, address))
        if pod is not None:
            pod.routed_at = now = self._clock()
            self._tables[model].routed(address, now)

    def observe(
        self,
        model: str,
        address: str,
        features: LatencyFeatures,
        *,
        ttft_s: float | None,
        tpot_s: float | None,
    ) -> bool:
        """Learn from one finished request; False (and counted) when its values are unusable."""
        if ttft_s is not None and not _ok(ttft_s):
            ttft_s = None
        if tpot_s is not None and not _ok(tpot_s):
            tpot_s = None
        x = features.vector()
        if (ttft_s is None and tpot_s is None) or not all(
            math.isfinite(v) and abs(v) < 1e6 for v in x
        ):
            self.ignored += 1
            return False
        key = (model, address)
        pod = self._pods.get(key)
        if pod is None:
            if len(self._pods) >= self._max:
                oldest = min(self._pods, key=lambda k: self._pods[k].updated_at)
                del self._pods[oldest]
                self._tables[oldest[0]].drop(oldest[1])
            pod = self._pods[key] = self._new_pod()
        pod.observe(x, ttft_s, tpot_s)
        pod.updated_at = self._clock()
        table = self._tables.get(model)
        if table is None:
            table = self._tables[model] = CoefficientTable()
        table.write(address, pod)
        return True

    def checked(
        self,
        model: str,
        address: str,
        predicted: tuple[float, float | None],
        actual: tuple[float, float | None],
    ) -> None:
        """A prediction (TTFT, TPOT s) against what happened, for `/debug/latency-model`."""
        pod = self._pods.get((model, address))
        if pod is not None:
            pod.checked.append((_ms3(predicted[0]), _ms3(actual[0]),
                                _ms3(predicted[1]), _ms3(actual[1])))  # fmt: skip

    def observe_tagged(
        self, model: str, address: str, tag: str, ttft_s: float | None, tpot_s: float | None
    ) -> bool:
        """`observe` with the features in a `DecisionTag` string (a peer replica's sample)."""
        decoded = DecisionTag.decode(tag)
        if decoded is None:
            self.ignored += 1
            return False
        return self.observe(model, address, decoded.features, ttft_s=ttft_s, tpot_s=tpot_s)

    def state(self) -> dict[str, Any]:
        """The debug view (`/debug/latency-model`): per model and pod, samples and coefficients."""
        out: dict[str, Any] = {
            "min_samples": self.min_samples,
            "forgetting": self._forgetting,
            "features": list(FEATURE_NAMES),
            "ignored_records": self.ignored,
            "adopted_from_peers": self.adopted,
            "models": {},
        }
        for (model, address), pod in sorted(self._pods.items()):
            out["models"].setdefault(model, {})[address] = pod.state()
        return out


@dataclass(frozen=True, slots=True)
class DecisionTag:
    """What the decision knew about the pick and what it predicted, as one metadata string:
    `u,f,t,q,r,kv[,ttft,tpot]` (tokens, counts, KV fraction, predicted seconds or `-`)."""

    features: LatencyFeatures
    ttft_s: float | None = None
    tpot_s: float | None = None

    def encode(self) -> str:
        f = self.features
        text = (
            f"{f.uncached_tokens},{f.in_flight},{f.in_flight_tokens},"
            f"{f.waiting:.6g},{f.running:.6g},{f.kv_usage:.4g}"
        )
        if self.ttft_s is not None:
            tpot = f"{self.tpot_s:.4g}" if self.tpot_s is not None else "-"
            text += f",{self.ttft_s:.4g},{tpot}"  # 4 digits: well below the model's error
        return text

    @staticmethod
    def decode(text: str) -> DecisionTag | None:
        """The tag in `text`, or None for anything malformed (never raises)."""
        if not text or len(text) > MAX_TAG_CHARS:
            return None
        parts = text.split(",")
        if len(parts) not in (6, 8):
            return None
        try:
            u, f, t = (int(p) for p in parts[:3])
            q, r, kv = (float(p) for p in parts[3:6])
            ttft = float(parts[6]) if len(parts) == 8 else None
            tpot = float(parts[7]) if len(parts) == 8 and parts[7] != "-" else None
        except ValueError:
            return None
        numbers = [v for v in (q, r, kv, ttft, tpot) if v is not None]
        if min(u, f, t) < 0 or not all(math.isfinite(v) and 0 <= v < 1e9 for v in numbers):
            return None
        return DecisionTag(LatencyFeatures(u, f, t, q, r, min(kv, 1.0)), ttft, tpot)


class LatencyMetrics:
    """The calibration of the predictions: |predicted - actual| per pod and kind (ttft, tpot)."""

    def __init__(self, registry: CollectorRegistry, *, namespace: str = "extproc") -> None:
        self.error = Histogram(
            "latency_prediction_error_seconds",
            "Absolute error of the predicted-latency model's prediction for the routed pod, "
            "measured when the request's access-log record arrives (kind: ttft, tpot)",
            ["pod", "kind"], buckets=ERROR_BUCKETS, namespace=namespace, registry=registry,
        )  # fmt: skip
        self._children: dict[tuple[str, str], Any] = {}

    def observe_error(self, pod: str, kind: str, seconds: float) -> None:
        child = self._children.get((pod, kind))
        if child is None:
            child = self._children[(pod, kind)] = self.error.labels(pod, kind)
        child.observe(seconds)
