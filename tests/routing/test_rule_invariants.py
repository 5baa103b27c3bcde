"""Every built-in rule, on seeded random snapshots of 1 to 80 pods (ties, unknown signals, P/D
roles, LoRA adapters, users, sessions, measured and unmeasured TTFT, empty prompts, sheddable
requests, SLO headers): through every registered strategy (with several params), built-in
profile, scorer, filter and picker.

Until issue 33 each rule was written twice, per pod below a pool-size threshold and on numpy
columns above it; a property test compared the two at every size before the per-pod paths
were deleted. What it held stays here: a decision ranks exactly the candidates, is the same
for a seed whatever holds the pods (a tuple, a `PodRows`, a table that builds rows on read),
explains itself with finite scores of candidates, and follows its rule's order.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest

from extproc.accounting.latency_model import LatencyModels
from extproc.routing.base import Decision, PodState, RoutingRequest, Snapshot, Strategy
from extproc.routing.builtin import BUILTIN_PROFILES, default_plugins
from extproc.routing.columns import PodRows
from extproc.routing.framework import build_profile
from extproc.routing.predicted import (
    SLO_TPOT_HEADER,
    SLO_TTFT_HEADER,
    PredictedLatencyParams,
    PredictedLatencyStrategy,
)
from extproc.routing.registry import StrategyRegistry
from extproc.routing.strategies import LeastSignalStrategy
from extproc.types import TooManyRequests
from tests._clock import ManualClock
from tests.routing._builders import FakeFairness, RowTable, learned_models, random_pods, req

PLUGINS = default_plugins()
STRATEGY_PARAMS = {
    "kv-aware": [{}, {"temperature": 0.5}, {"load_share": "whole", "overlap_weight": 2.0}],
    "prefix-cache": [{}, {"match_threshold_percent": 50.0, "imbalance_abs_count": 2}],
    "prefix-cache-preble": [{}, {"exploit_ratio": 0.1, "rebalance_ratio": 1.0}],
    "vtc-basic": [{}, {"max_pod_load": 3.0}],
    "pd": [{}, {"stddev_factor": 0.0}],
    "higress-gpu": [{}, {"queueing_threshold_lora": 3.0, "queue_threshold_critical": 2.0}],
}
PROFILES = {
    **BUILTIN_PROFILES,
    "every-scorer": {
        "scorers": [
            {"type": t, "weight": 1.0 + i / 4} for i, t in enumerate(PLUGINS.type_names("scorer"))
        ]
    },
    "filtered-softmax": {
        "filters": [{"type": "low-queue", "params": {"threshold": 4.0}}, {"type": "lora-affinity"}],
        "scorers": [{"type": "queue"}, {"type": "prefix", "weight": 2.0}],
        "picker": {"type": "softmax", "params": {"temperature": 0.3}},
    },
    "saturation-weighted": {
        "filters": [{"type": "saturation"}, {"type": "role", "params": {"role": "decode"}}],
        "scorers": [{"type": "least-request"}, {"type": "kv-cache-utilization"}],
        "picker": {"type": "weighted-random"},
    },
}
SPECS = ["prefix-cache:3,least-request:1", "queue:2,kv-cache-utilization:2,prefix:3,latency:1"]


def _rules() -> list[tuple[str, Strategy]]:
    out: list[tuple[str, Strategy]] = []
    for type_name in PLUGINS.type_names("strategy"):
        for k, params in enumerate(STRATEGY_PARAMS.get(type_name, [{}])):
            out.append((f"{type_name}#{k}", PLUGINS.create("strategy", type_name, params)))
    for name, spec in PROFILES.items():
        out.append((name, build_profile(name, spec, PLUGINS)))
    registry = StrategyRegistry(PLUGINS)
    out += [(spec, registry.resolve(spec)) for spec in SPECS]
    return out


RULES = _rules()


def _pods(n: int, rng: random.Random) -> list[PodState]:
    return random_pods(n, rng, roles=rng.random() < 0.3, sparse=rng.random() < 0.5)


def _models(pods: list[PodState], rng: random.Random) -> LatencyModels:
    """A tenth of the pods cold, a fifth without a TPOT model."""
    cold = [i for i in range(len(pods)) if rng.random() < 0.1]
    tpot_cold = [i for i in range(len(pods)) if rng.random() < 0.2]
    return learned_models(pods, rng, ManualClock(), cold=cold, tpot_cold=tpot_cold)


def _predicted(pods: list[PodState], rng: random.Random) -> list[tuple[str, Strategy]]:
    models = _models(pods, rng)
    return [
        (
            f"predicted-latency T={t} probe={probe}",
            PredictedLatencyStrategy(
                "predicted-latency",
                PredictedLatencyParams(temperature=t, probe_after_s=probe),
                predictor=models,
            ),
        )
        for t, probe in ((1.0, 10.0), (1.0, 0.0), (0.0, 10.0))
    ]


def _request(rng: random.Random, pods: list[PodState]) -> RoutingRequest:
    headers = {"x-aibrix-session-key": "k"} if rng.random() < 0.3 else {}
    slo = rng.choice([{}, {}, {SLO_TTFT_HEADER: "60"}, {SLO_TPOT_HEADER: "8"},
                      {SLO_TTFT_HEADER: "90", SLO_TPOT_HEADER: "15"}, {SLO_TTFT_HEADER: "0.001"}])  # fmt: skip
    headers.update(slo)
    return req(
        prompt_tokens=rng.choice([0, 100, 256, 1000]),
        max_tokens=rng.choice([None, 64]),
        user=rng.choice([None, "u1", "u2", "u3"]),
        lora=rng.choice([None, "ad"]),
        session_id=rng.choice([None, rng.choice(pods).address, "10.9.9.9:1"]),
        priority=rng.choice([0, 0, -1]),
        headers=headers,
        block_size=rng.choice([16, 32]),
    )


FAIRNESS = FakeFairness({"u1": 40_000.0, "u2": 10.0}, minimum=5_000.0)


def _decide(
    strategy: Strategy, r: RoutingRequest, pods: Sequence[PodState], seed: int
) -> Decision | None:
    """The decision, or None for a 429 (a sheddable request no pod is predicted to serve)."""
    snap = Snapshot(now=1.0, pods=pods, fairness=FAIRNESS if r.user != "u3" else None)
    try:
        return strategy.route(r, snap, random.Random(seed))
    except TooManyRequests as err:
        assert err.code == "slo_unmet" and r.priority < 0
        return None


def _outcome(d: Decision | None) -> tuple[object, ...]:
    if d is None:
        return ("429",)
    scores = {a: dict(s) for a, s in d.scores.items()}
    return (d.ranked, scores, d.reason, d.profiles, d.session_id)


def _check(
    label: str, strategy: Strategy, r: RoutingRequest, pods: list[PodState], d: Decision
) -> None:
    """What every decision holds, and what its rule says about the order."""
    addresses = [p.address for p in pods]
    ranked = [e.address for e in d.ranked]
    assert sorted(ranked) == sorted(addresses)  # each candidate once: pick + fallbacks
    for profile in d.profiles:
        assert set(e.address for e in profile.ranked) <= set(addresses)
    assert d.reason.strip()
    scores = {a: dict(s) for a, s in d.scores.items()}
    assert set(scores) <= set(addresses)
    assert all(math.isfinite(v) for s in scores.values() for v in s.values())
    if isinstance(strategy, LeastSignalStrategy):  # by the signal, then in-flight; unknown last
        known = [a for a in ranked if a in scores]
        assert ranked[: len(known)] == known
        keys = [(scores[a][strategy.label], scores[a]["in_flight"]) for a in known]
        assert keys == sorted(keys)
    elif label in ("kv-aware#0", "kv-aware#2", "kv-aware-dynamo#0"):  # argmin cost
        costs = [scores[a]["cost"] for a in ranked]
        assert costs == sorted(costs)
    elif label.startswith("vtc-basic") and scores:
        assert [scores[a]["score"] for a in ranked] == sorted(s["score"] for s in scores.values())
    elif label.startswith("round-robin"):
        by_address = sorted(addresses)
        k = by_address.index(ranked[0])
        assert ranked == by_address[k:] + by_address[:k]
    elif label.startswith("session-affinity") and r.session_id in addresses:
        assert ranked[0] == d.session_id == r.session_id
    elif label in BUILTIN_PROFILES or label in SPECS or label == "every-scorer":
        totals = [scores[a]["total"] for a in ranked if a in scores]  # max-score picker
        assert totals == sorted(totals, reverse=True)


SIZES = [1, 2, 3, 4, 5, 6, 8, 11, 16, 23, 31, 47, 80]


@pytest.mark.slow
@pytest.mark.parametrize("n", SIZES)
def test_every_rule_at_every_size(n: int) -> None:
    for case in range(6):
        rng = random.Random(1000 * n + case)
        pods = _pods(n, rng)
        r = _request(rng, pods)
        for label, strategy in [*RULES, *_predicted(pods, rng)]:
            seed = rng.randrange(1 << 30)
            d = _decide(strategy, r, tuple(pods), seed)
            for held in (PodRows(pods), RowTable(pods)):
                assert _outcome(_decide(strategy, r, held, seed)) == _outcome(d), (label, n, case)
            if d is not None:
                _check(label, strategy, r, pods, d)
