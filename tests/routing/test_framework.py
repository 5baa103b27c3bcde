"""Profiles, pickers, strict plugin decoding, weighted header specs."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest

from extproc.routing.base import (
    NO_CAPABILITIES,
    Capabilities,
    FilterResult,
    PodState,
    RoutingRequest,
    ScoreResult,
)
from extproc.routing.builtin import default_plugins
from extproc.routing.filters import SaturationFilter, SaturationParams
from extproc.routing.framework import (
    MaxScorePicker,
    PluginConfigError,
    Profile,
    SoftmaxParams,
    SoftmaxPicker,
    WeightedRandomPicker,
    build_profile,
    decode_params,
    parse_weighted_header,
)
from tests.routing._builders import pod, req, snap

A, B, C, D = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"


@dataclass(frozen=True, slots=True)
class P:
    count: int = 1
    ratio: float = 0.5
    flag: bool = False
    label: str | None = None


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ({}, P()),
        ({"count": 3, "ratio": 2}, P(count=3, ratio=2.0)),
        ({"flag": True, "label": "x"}, P(flag=True, label="x")),
        ({"label": None}, P()),
    ],
)
def test_decode_params_good(raw: dict[str, object], want: P) -> None:
    assert decode_params(P, raw, "test") == want


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"cuont": 1}, "test.cuont: unknown key"),
        ({"count": "3"}, "test.count: must be int"),
        ({"count": True}, "test.count: must be int"),  # bool is not an int here
        ({"count": 1.5}, "test.count: must be int"),
        ({"ratio": "fast"}, "test.ratio: must be float"),
        ({"ratio": math.inf}, "test.ratio: must be a finite number"),
        ({"flag": 1}, "test.flag: must be bool"),
        ({"label": 7}, "test.label: must be str"),
    ],
)
def test_decode_params_errors_name_the_key_path(raw: dict[str, object], key: str) -> None:
    with pytest.raises(PluginConfigError, match=f"^{key}"):
        decode_params(P, raw, "test")


def test_params_range_checks_become_config_errors() -> None:
    with pytest.raises(PluginConfigError, match="temperature"):
        decode_params(SoftmaxParams, {"temperature": 0.0}, "picker")


GOOD_SPEC: dict[str, object] = {
    "filters": [{"type": "saturation", "params": {"queue_threshold": 3, "kv_threshold": 0.9}}],
    "scorers": [
        {"type": "prefix", "weight": 3},
        {"type": "queue-scorer", "weight": 2.5},
        {"type": "least-request"},
    ],
    "picker": {"type": "softmax", "params": {"temperature": 0.2}},
}


def test_build_profile_from_yaml_shape() -> None:
    prof = build_profile("mine", GOOD_SPEC, default_plugins())
    assert [(s.name, w) for s, w in prof.scorers] == [
        ("prefix", 3.0),
        ("queue", 2.5),
        ("least-request", 1.0),
    ]
    assert isinstance(prof.picker, SoftmaxPicker) and prof.picker.temperature == 0.2
    assert isinstance(prof.filters[0], SaturationFilter)
    assert prof.filters[0].params == SaturationParams(queue_threshold=3.0, kv_threshold=0.9)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({**GOOD_SPEC, "scorrers": []}, "p.scorrers: unknown key"),
        ({"scorers": []}, "p.scorers: must list at least one scorer"),
        ({"scorers": [{"type": "nope"}]}, "p.scorers[0].type: unknown scorer 'nope'"),
        ({"scorers": [{"type": "queue", "wieght": 1}]}, "p.scorers[0].wieght: unknown key"),
        ({"scorers": [{"type": "queue", "weight": "high"}]}, "p.scorers[0].weight: must be float"),
        ({"scorers": [{"type": "queue", "weight": -1}]}, "p.scorers[0].weight: must be >= 0"),
        ({"scorers": [{"type": "queue", "params": {"x": 1}}]}, "p.scorers[0].params.x: unknown"),
        ({"scorers": [{"weight": 1}]}, "p.scorers[0].type: must be a non-empty string"),
        ({"scorers": "queue"}, "p.scorers: must be a list"),
        (
            {
                "scorers": [{"type": "queue"}],
                "filters": [{"type": "saturation", "params": {"kv": 1}}],
            },
            "p.filters[0].params.kv: unknown key",
        ),
        (
            {"scorers": [{"type": "queue"}], "filters": [{"type": "queue"}]},
            "p.filters[0].type: unknown filter 'queue' (known: lora-affinity, low-queue,",
        ),
        (
            {
                "scorers": [{"type": "queue"}],
                "picker": {"type": "softmax", "params": {"temperature": "hot"}},
            },
            "p.picker.params.temperature: must be float",
        ),
        (
            {
                "scorers": [{"type": "queue"}],
                "filters": [{"type": "role", "params": {"role": "chef"}}],
            },
            "p.filters[0].params: role must be one of",
        ),
    ],
)
def test_build_profile_errors_name_the_key_path(spec: dict[str, object], needle: str) -> None:
    with pytest.raises(PluginConfigError) as err:
        build_profile("bad", spec, default_plugins(), where="p")
    assert str(err.value).startswith(needle)


@pytest.mark.parametrize(
    ("header", "want"),
    [
        ("prefix-cache:3,least-request:1", [("prefix", 3.0), ("least-request", 1.0)]),
        ("queue, kv-cache-utilization:2", [("queue", 1.0), ("kv-cache-utilization", 2.0)]),
        ("least-kv-cache:0,least-request", [("least-request", 1.0)]),  # weight 0 drops
        ("least-latency:1000000", [("latency", 1e6)]),
        ("session-affinity:5,random", [("session-affinity", 5.0), ("random", 1.0)]),
    ],
)
def test_parse_weighted_header_good(header: str, want: list[tuple[str, float]]) -> None:
    prof = parse_weighted_header(header, default_plugins())
    assert [(s.name, w) for s, w in prof.scorers] == want


@pytest.mark.parametrize(
    ("header", "needle"),
    [
        ("prefix-cache:x", "not a number"),
        ("prefix-cache:-1", r"\[0, 1000000\]"),
        ("prefix-cache:2000000", r"\[0, 1000000\]"),
        ("prefix-cache:nan", r"\[0, 1000000\]"),
        ("bogus:1", "unknown scorer 'bogus'"),
        ("queue,,least-request", "empty item"),
        ("queue:1,queue-scorer:2", "listed twice"),
        ("queue:0", "no scorer with a weight above 0"),
    ],
)
def test_parse_weighted_header_bad(header: str, needle: str) -> None:
    with pytest.raises(PluginConfigError, match=needle):
        parse_weighted_header(header, default_plugins())


class FixedScorer:
    type_name: ClassVar[str] = "fixed"
    capabilities: ClassVar[Capabilities] = NO_CAPABILITIES

    def __init__(self, name: str, values: Sequence[float]) -> None:
        self.name = name
        self.values = values

    def score(self, req: RoutingRequest, pods: Sequence[PodState]) -> ScoreResult:
        return list(self.values[: len(pods)]), None


class DropAll:
    type_name: ClassVar[str] = "drop-all"
    capabilities: ClassVar[Capabilities] = NO_CAPABILITIES
    name = "drop-all"

    def filter(self, req: RoutingRequest, pods: Sequence[PodState]) -> FilterResult:
        return [], None


def test_profile_sums_clamped_weighted_scores_and_records_them() -> None:
    prof = Profile(
        "p",
        [],
        [
            (FixedScorer("s1", [2.0, 0.5, math.nan]), 2.0),
            (FixedScorer("s2", [0.0, 1.0, -3.0]), 1.0),
        ],
        MaxScorePicker(),
    )
    d = prof.route(req(), snap(pod(A), pod(B), pod(C)), random.Random(0))
    assert d.scores[A] == {"s1": 1.0, "s2": 0.0, "total": 2.0}
    assert d.scores[B] == {"s1": 0.5, "s2": 1.0, "total": 2.0}
    assert d.scores[C] == {"s1": 0.0, "s2": 0.0, "total": 0.0}
    assert d.ranked[-1].address == C
    assert "s1:2,s2:1" in d.reason


def test_filter_that_empties_falls_back_and_says_so() -> None:
    prof = Profile("p", [DropAll()], [(FixedScorer("s", [0.1, 0.9]), 1.0)], MaxScorePicker())
    d = prof.route(req(), snap(pod(A), pod(B)), random.Random(0))
    assert d.endpoint.address == B
    assert "filter drop-all removed every pod" in d.reason


def test_filtered_out_pods_remain_as_fallbacks() -> None:
    prof = build_profile(
        "p",
        {"filters": [{"type": "saturation"}], "scorers": [{"type": "queue"}]},
        default_plugins(),
    )
    pods = [pod(A, waiting=9, kv=0.1), pod(B, waiting=1, kv=0.1), pod(C, waiting=0, kv=0.95)]
    d = prof.route(req(), snap(*pods), random.Random(0))
    assert d.endpoint.address == B
    assert {e.address for e in d.ranked[1:]} == {A, C}
    assert A not in d.scores  # only scored pods carry scores


def test_scorer_notes_missing_signal_in_reason() -> None:
    prof = parse_weighted_header("queue", default_plugins())
    d = prof.route(req(), snap(pod(A, waiting=2), pod(B)), random.Random(0))
    assert "waiting unknown on 10.0.0.2:8000 (neutral 0.5)" in d.reason


def test_max_score_picker_random_tie_break_spreads() -> None:
    counts = Counter(
        int(MaxScorePicker().rank(np.ones(4), random.Random(s))[0]) for s in range(400)
    )
    assert set(counts) == {0, 1, 2, 3} and min(counts.values()) > 50


def test_max_score_picker_ranks_every_position_highest_first() -> None:
    order = MaxScorePicker().rank(np.array([0.2, 0.9, 0.5, 0.9]), random.Random(0))
    assert sorted(order.tolist()) == [0, 1, 2, 3]
    assert set(order[:2].tolist()) == {1, 3} and order[2:].tolist() == [2, 0]


def test_softmax_temperature_controls_spread() -> None:
    totals = np.array([1.0, 0.5])

    def share_of_best(t: float) -> float:
        picker = SoftmaxPicker("softmax", SoftmaxParams(temperature=t))
        wins = sum(int(picker.rank(totals, random.Random(s))[0]) == 0 for s in range(2000))
        return wins / 2000

    cold, warm, hot = share_of_best(0.02), share_of_best(0.5), share_of_best(50.0)
    assert cold > 0.99
    # softmax theory: P(A) = 1 / (1 + exp(-0.5 / T)); T=0.5 -> 0.731
    assert abs(warm - 1 / (1 + math.exp(-1.0))) < 0.05
    assert abs(hot - 0.5) < 0.05


def test_weighted_random_picker_zero_scores_last() -> None:
    totals = np.array([0.0, 0.4, 0.6, 0.0])
    for s in range(50):
        ranked = WeightedRandomPicker().rank(totals, random.Random(s))
        assert sorted(ranked.tolist()) == [0, 1, 2, 3]
        assert set(ranked[-2:].tolist()) == {0, 3}
    wins = Counter(
        int(WeightedRandomPicker().rank(totals, random.Random(s))[0]) for s in range(1000)
    )
    assert abs(wins[2] / 1000 - 0.6) < 0.06


def test_profile_rejects_negative_weight() -> None:
    with pytest.raises(PluginConfigError, match="weight"):
        Profile("p", [], [(FixedScorer("s", [1.0]), -1.0)], MaxScorePicker())
