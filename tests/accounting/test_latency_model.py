"""The online per-pod latency models: they converge on known coefficients, resist noise and
outliers, forget a pod that changed, ignore broken records, and travel as a compact tag."""

from __future__ import annotations

import copy
import math
import random
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from extproc.accounting.latency_model import (
    DecisionTag,
    LatencyMetrics,
    LatencyModels,
    OnlineRidge,
    PodLatencyModel,
    fullest_rows,
)
from extproc.routing.predicted import FEATURE_NAMES, LatencyFeatures
from tests._clock import ManualClock
from tests._metrics import sample

MODEL = "qwen3"


def features(rng: random.Random) -> LatencyFeatures:
    return LatencyFeatures(
        uncached_tokens=rng.randrange(0, 4000),
        in_flight=rng.randrange(0, 12),
        in_flight_tokens=rng.randrange(0, 20000),
        waiting=float(rng.randrange(0, 4)),
        running=float(rng.randrange(0, 8)),
        kv_usage=rng.random(),
    )


def ttft_of(f: LatencyFeatures, speed: float = 1.0) -> float:
    """A pod whose TTFT is 20 ms + 50 ms per 1k uncached tokens + 10 ms per request queued,
    all divided by `speed`."""
    return (0.02 + 0.05 * f.uncached_tokens / 1000 + 0.01 * f.in_flight) / speed


def tpot_of(f: LatencyFeatures, speed: float = 1.0) -> float:
    return (0.005 + 0.001 * f.running) / speed


def train(
    models: LatencyModels,
    address: str,
    n: int,
    *,
    speed: float = 1.0,
    noise: float = 0.0,
    seed: int = 1,
) -> None:
    rng = random.Random(seed)
    for _ in range(n):
        f = features(rng)
        ttft = ttft_of(f, speed) * (1 + noise * rng.gauss(0, 1))
        models.observe(MODEL, address, f, ttft_s=max(ttft, 0.0), tpot_s=tpot_of(f, speed))


def coefficients(models: LatencyModels, address: str, kind: str = "ttft") -> dict[str, float]:
    state = models.state()["models"][MODEL][address][kind]["coefficients"]
    return dict(state)


def test_it_recovers_known_coefficients_from_exact_samples() -> None:
    models = LatencyModels()
    train(models, "a", 200)
    c = coefficients(models, "a")
    assert c["intercept"] == pytest.approx(0.02, abs=2e-3)
    assert c["uncached_ktokens"] == pytest.approx(0.05, abs=2e-3)
    assert c["in_flight"] == pytest.approx(0.01, abs=1e-3)
    for name in ("waiting", "running", "kv_usage", "in_flight_10ktokens"):
        assert abs(c[name]) < 3e-3, name
    assert coefficients(models, "a", "tpot")["running"] == pytest.approx(0.001, abs=2e-4)


def test_with_noise_the_predictions_stay_close_to_the_truth() -> None:
    models = LatencyModels()
    train(models, "a", 400, noise=0.1)
    rng = random.Random(99)
    errors = []
    for _ in range(100):
        f = features(rng)
        pred = models.predict(MODEL, "a", f)
        assert pred is not None
        errors.append(abs(pred.ttft_s - ttft_of(f)) / ttft_of(f))
    assert sum(errors) / len(errors) < 0.1  # 10 % noise per sample, far less on average


def test_outliers_barely_move_a_warm_model() -> None:
    clean, dirty = LatencyModels(), LatencyModels()
    train(clean, "a", 300, seed=3)
    rng = random.Random(3)
    for i in range(300):
        f = features(rng)
        ttft = ttft_of(f) * (50.0 if i % 20 == 19 else 1.0)  # 5 % stalled requests
        dirty.observe(MODEL, "a", f, ttft_s=ttft, tpot_s=tpot_of(f))
    probe = LatencyFeatures(2000, 3, 0, 0.0, 2.0, 0.5)
    truth = ttft_of(probe)
    got = dirty.predict(MODEL, "a", probe)
    assert got is not None
    robust = abs(got.ttft_s - truth) / truth
    assert robust < 0.25
    # Without the down-weighting the same data lands far off: the fit really is robust.
    plain = OnlineRidge(len(FEATURE_NAMES))
    rng = random.Random(3)
    for i in range(300):
        f = features(rng)
        plain.observe(f.vector(), ttft_of(f) * (50.0 if i % 20 == 19 else 1.0))
    plain_error = abs(plain.predict(probe.vector()) - truth) / truth
    assert plain_error > 0.5 and plain_error > 4 * robust


def test_it_forgets_a_pod_that_became_slower() -> None:
    models = LatencyModels(forgetting=0.95)
    train(models, "a", 200, speed=1.0)
    probe = LatencyFeatures(1000, 2, 0, 0.0, 1.0, 0.2)
    before = models.predict(MODEL, "a", probe)
    train(models, "a", 150, speed=0.5, seed=7)  # the pod now takes twice as long
    after = models.predict(MODEL, "a", probe)
    assert before is not None and after is not None
    assert before.ttft_s == pytest.approx(ttft_of(probe), rel=0.1)
    assert after.ttft_s == pytest.approx(ttft_of(probe, 0.5), rel=0.1)


def test_each_pod_learns_its_own_speed() -> None:
    models = LatencyModels()
    train(models, "fast", 100, speed=4.0)
    train(models, "slow", 100, speed=1.0, seed=2)
    probe = LatencyFeatures(1500, 1, 0, 0.0, 1.0, 0.1)
    fast, slow = models.predict(MODEL, "fast", probe), models.predict(MODEL, "slow", probe)
    assert fast is not None and slow is not None
    assert slow.ttft_s / fast.ttft_s == pytest.approx(4.0, rel=0.1)
    assert models.predict("other-model", "fast", probe) is None  # per model, too


def test_cold_until_min_samples_then_warm() -> None:
    models = LatencyModels(min_samples=5)
    probe = LatencyFeatures(100, 0, 0, 0.0, 0.0, 0.0)
    train(models, "a", 4)
    assert models.predict(MODEL, "a", probe) is None
    train(models, "a", 1, seed=5)
    pred = models.predict(MODEL, "a", probe)
    assert pred is not None and pred.samples == 5


@pytest.mark.parametrize(
    ("ttft", "tpot", "learned"),
    [
        pytest.param(math.nan, None, False, id="nan"),
        pytest.param(math.inf, math.inf, False, id="inf"),
        pytest.param(-0.5, None, False, id="negative"),
        pytest.param(10_000.0, None, False, id="absurd"),
        pytest.param(None, None, False, id="nothing"),
        pytest.param(0.1, math.nan, True, id="good-ttft-bad-tpot"),
    ],
)
def test_bad_values_are_ignored(ttft: float | None, tpot: float | None, learned: bool) -> None:
    models = LatencyModels(min_samples=1)
    probe = LatencyFeatures(100, 0, 0, 0.0, 0.0, 0.0)
    assert models.observe(MODEL, "a", probe, ttft_s=ttft, tpot_s=tpot) is learned
    assert models.ignored == (0 if learned else 1)
    pred = models.predict(MODEL, "a", probe)
    if learned:
        assert pred is not None and pred.ttft_s == pytest.approx(0.1, rel=0.01)
        assert pred.tpot_s is None  # the bad TPOT taught nothing
    else:
        assert pred is None


def test_a_feature_that_never_varies_keeps_predictions_finite() -> None:
    models = LatencyModels(min_samples=2)
    flat = LatencyFeatures(0, 0, 0, 0.0, 0.0, 0.0)  # only the intercept is ever excited
    for y in (0.1, 0.12, 0.11, 0.1):
        models.observe(MODEL, "a", flat, ttft_s=y, tpot_s=0.01)
    wild = LatencyFeatures(10**6, 500, 10**7, 100.0, 100.0, 1.0)
    pred = models.predict(MODEL, "a", wild)
    assert pred is not None
    assert math.isfinite(pred.ttft_s) and 0.0 <= pred.ttft_s <= 4 * 0.12 + 1e-3


def test_a_fit_pushed_outside_what_it_saw_predicts_no_less_than_half_the_fastest_sample() -> None:
    # Every sample at KV usage 0.6-1.0, TTFT steep in it: the line through them is negative at
    # usage 0. Clamped to 0 (before), the pod looked instantly fast and won every decision
    # (a CI run's predicted-latency test saw 0.0 ms for its fast pod).
    models = LatencyModels(min_samples=4)
    rng = random.Random(7)
    fastest = math.inf
    for _ in range(40):
        kv = 0.6 + 0.4 * rng.random()
        ttft = 0.05 + 1.0 * (kv - 0.6)
        fastest = min(fastest, ttft)
        models.observe(MODEL, "a", LatencyFeatures(1500, 0, 0, 0.0, 1.0, kv), ttft_s=ttft,
                       tpot_s=0.01)  # fmt: skip
    probe = LatencyFeatures(1500, 0, 0, 0.0, 1.0, 0.0)
    pred = models.predict(MODEL, "a", probe)
    assert pred is not None
    assert pred.ttft_s >= 0.5 * fastest > 0
    # The columns every decision reads give the same.
    cols = models.predict_columns(MODEL, ["a"], np.array(probe.vector(), dtype=float)[:, None])
    assert cols is not None and float(cols.ttft_s[0]) == pred.ttft_s


def test_the_number_of_pods_is_bounded_dropping_the_least_recently_updated() -> None:
    clock = ManualClock()
    models = LatencyModels(min_samples=1, max_pods=2, clock=clock.now)
    probe = LatencyFeatures(0, 0, 0, 0.0, 0.0, 0.0)
    for address in ("a", "b", "c"):
        clock.advance(1.0)
        models.observe(MODEL, address, probe, ttft_s=0.1, tpot_s=None)
    assert sorted(models.state()["models"][MODEL]) == ["b", "c"]


@pytest.mark.parametrize(
    "tag",
    [
        DecisionTag(LatencyFeatures(812, 3, 5200, 0.0, 2.0, 0.25)),
        DecisionTag(LatencyFeatures(0, 0, 0, 1.5, 0.0, 1.0), 0.1234, None),
        DecisionTag(LatencyFeatures(5, 1, 2, 0.0, 0.0, 0.0), 0.5, 0.0125),
    ],
)
def test_the_tag_round_trips(tag: DecisionTag) -> None:
    text = tag.encode()
    assert len(text) < 80
    assert DecisionTag.decode(text) == tag


@pytest.mark.parametrize(
    "text",
    ["", "1,2,3", "a,b,c,d,e,f", "1,2,3,4,5,6,7", "-1,0,0,0,0,0", "1,1,1,nan,0,0",
     "1,1,1,0,0,0,inf,-", "1,1,1,0,0,0," + "9" * 300],
)  # fmt: skip
def test_a_malformed_tag_decodes_to_none(text: str) -> None:
    assert DecisionTag.decode(text) is None


def test_prediction_errors_are_exported_per_pod_and_kind() -> None:
    registry = CollectorRegistry()
    metrics = LatencyMetrics(registry)
    metrics.observe_error("10.0.0.1:8000", "ttft", 0.02)
    metrics.observe_error("10.0.0.1:8000", "ttft", 0.2)
    name = "extproc_latency_prediction_error_seconds_count"
    assert sample(registry, name, pod="10.0.0.1:8000", kind="ttft") == 2
    assert sample(registry, name, pod="10.0.0.1:8000", kind="tpot") == 0


def test_learned_models_start_another_gateway_where_this_one_is() -> None:
    old_clock, new_clock = ManualClock(start=5000.0), ManualClock(start=0.0)
    learned_here = LatencyModels(clock=old_clock.now)
    train(learned_here, "fast", 60, speed=4.0)
    train(learned_here, "slow", 60, speed=1.0, seed=2)
    learned_here.routed(MODEL, "slow")
    learned = learned_here.learned()
    probe = LatencyFeatures(1500, 1, 0, 0.0, 1.0, 0.1)
    before = learned_here.predict(MODEL, "slow", probe)
    train(learned_here, "slow", 60, speed=0.25, seed=3)  # later learning: not in the copy

    models = LatencyModels(clock=new_clock.now)
    assert models.predict(MODEL, "slow", probe) is None  # cold
    models.start_from(learned)
    slow, fast = models.predict(MODEL, "slow", probe), models.predict(MODEL, "fast", probe)
    assert slow is not None and fast is not None and before is not None
    assert slow.ttft_s == pytest.approx(before.ttft_s) and slow.samples == 60
    assert slow.ttft_s / fast.ttft_s == pytest.approx(4.0, rel=0.1)
    # As if just learned, never routed to by this gateway: no probe is due, none was sent.
    assert slow.age_s == 0.0 and slow.routed_s == math.inf
    # The same answers through the column path the strategy reads.
    cols = models.predict_columns(
        MODEL, ["fast", "slow"], np.array([[v, v] for v in probe.vector()])
    )
    assert cols is not None and list(cols.ttft_s) == [fast.ttft_s, slow.ttft_s]
    # It learns on from there, its own copy: the source is untouched.
    train(models, "slow", 30, speed=0.25, seed=4)
    assert {(r[0], r[1]): r[2] for r in learned.rows}[(MODEL, "slow")][0][0] == 60
    # Bounded as learning is.
    small = LatencyModels(max_pods=1)
    small.start_from(learned)
    assert len(small.state()["models"][MODEL]) == 1


def test_a_peers_models_as_rows_predict_here_as_there_and_learn_on() -> None:
    there, here = LatencyModels(), LatencyModels()
    train(there, "fast", 40, speed=4.0, noise=0.05)
    train(there, "slow", 40, speed=1.0, noise=0.05, seed=2)
    train(there, "cold", 3)  # not warm: shared, and cold here too
    rows = there.rows()
    assert sorted(r[1] for r in rows) == ["cold", "fast", "slow"]
    assert here.adopt(rows) == 3 and here.adopted == 3 and here.ignored == 0
    assert here.predict(MODEL, "cold", features(random.Random(1))) is None
    rng = random.Random(7)
    for _ in range(20):
        f = features(rng)
        a, b = there.predict(MODEL, "slow", f), here.predict(MODEL, "slow", f)
        assert a is not None and b is not None
        assert (b.ttft_s, b.tpot_s, b.samples, b.error_s) == (
            a.ttft_s, a.tpot_s, a.samples, a.error_s,
        )  # fmt: skip
    # Both learn the next samples alike: the sums travelled, not only the coefficients.
    train(there, "slow", 10, speed=0.5, seed=3)
    train(here, "slow", 10, speed=0.5, seed=3)
    assert coefficients(here, "slow") == coefficients(there, "slow")
    assert here.state()["models"][MODEL]["slow"] == there.state()["models"][MODEL]["slow"]


def test_a_model_that_learned_as_many_samples_is_kept_one_that_learned_fewer_gives_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    restored: list[object] = []
    restore = PodLatencyModel.restore

    def counted(pod: PodLatencyModel, values: object) -> bool:
        restored.append(values)
        return restore(pod, values)

    monkeypatch.setattr(PodLatencyModel, "restore", counted)
    there, here = LatencyModels(), LatencyModels()
    train(there, "a", 30)
    train(there, "b", 30)
    train(here, "a", 30, speed=10.0, seed=5)  # as many samples, its own
    train(here, "b", 9, speed=10.0, seed=5)  # warm, but fewer: a process that just started
    probe = LatencyFeatures(1500, 1, 0, 0.0, 1.0, 0.1)
    own_a = here.predict(MODEL, "a", probe)
    assert here.adopt(there.rows()) == 1
    assert len(restored) == 1  # the kept model's row is not even solved
    kept = here.predict(MODEL, "a", probe)
    assert own_a is not None and kept is not None
    assert (kept.ttft_s, kept.samples) == (own_a.ttft_s, 30)
    b, theirs = here.predict(MODEL, "b", probe), there.predict(MODEL, "b", probe)
    assert b is not None and theirs is not None and b.ttft_s == theirs.ttft_s and b.samples == 30
    # Bounded as learning is: a full table takes no new pod.
    small = LatencyModels(max_pods=1)
    train(small, "a", 2)
    assert small.adopt(there.rows()) == 1 and set(small.state()["models"][MODEL]) == {"a"}


def _broken(row: list[Any], where: tuple[int, ...], to: object) -> list[Any]:
    out = copy.deepcopy(row)
    target = out
    for i in where[:-1]:
        target = target[i]
    target[where[-1]] = to
    return out


@pytest.mark.parametrize(
    ("where", "to"),
    [
        ((), "not a row"),
        ((0,), 7),  # the model's name
        ((2,), "values"),
        ((2, 0), [1.0, 2.0]),  # the TTFT's values, cut short
        ((2, 0, 0), 0),  # no sample
        ((2, 0, 0), 30.5),
        ((2, 0, 0), True),
        ((2, 0, 1), -0.1),  # a negative residual scale
        ((2, 0, 2), math.inf),
        ((2, 0, 3), 9.0),  # the fastest sample above the slowest
        ((2, 0, 8), math.nan),
        ((2, 0, 8), "1.0"),
        ((2, 0, 5), -1e9),  # X'WX not positive definite
        ((2, 1), [1]),  # the TPOT's values
    ],
)
def test_a_malformed_model_row_is_refused_and_counted(where: tuple[int, ...], to: object) -> None:
    there, here = LatencyModels(), LatencyModels()
    train(there, "a", 30)
    (row,) = there.rows()
    bad = to if where == () else _broken(row, where, to)
    assert here.adopt([bad]) == 0
    assert here.ignored == 1 and here.state()["models"] == {}
    assert here.adopt([row]) == 1  # the row itself is fine


def test_of_several_replicas_rows_each_pods_fullest_is_kept_as_adopt_would() -> None:
    # A capture joins every process's export: one row a pod, the one adopt would keep.
    one, two = LatencyModels(), LatencyModels()
    train(one, "a", 30)
    train(two, "a", 12, seed=2)
    train(one, "b", 9, seed=3)
    train(two, "b", 20, seed=4)
    train(two, "c", 5, seed=5)
    rows = [*one.rows(), *two.rows(), "not a row", [MODEL, 7, []], [MODEL, "d", "values"]]
    kept = fullest_rows(rows)
    assert [(r[1], r[2][0][0]) for r in kept] == [("a", 30), ("b", 20), ("c", 5)]
    every = LatencyModels()
    every.adopt(rows)
    joined = LatencyModels()
    assert joined.adopt(kept) == 3 and joined.ignored == 0
    assert joined.state()["models"] == every.state()["models"]
