"""The replica benchmark's own arithmetic: simulator deltas, in-flight visibility, histogram
quantiles, medians and spreads over repetitions, the targets against one process, and the
table; and the scenarios it runs exist with the strategies it names."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from bench.replicas import (
    HIT_RATE_TOL,
    IMBALANCE_TOL,
    REFERENCE,
    SCENARIOS,
    SETUPS,
    STRATEGIES,
    aggregate,
    bucket_quantile,
    checks,
    markdown,
    scaled,
    sim_delta,
    visibility,
)
from bench.scenario import load_scenario

SCENARIO_DIR = Path(__file__).resolve().parents[2] / "bench" / "scenarios"


def _sim(finished: int, queries: int, hits: int) -> dict[str, Any]:
    return {
        "finished": {"length": finished},
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
    }


def test_sim_delta_counts_only_what_happened_during_the_run() -> None:
    before = {"a": _sim(10, 1000, 500), "b": _sim(5, 400, 0)}
    after = {"a": _sim(40, 3000, 2000), "b": _sim(15, 1400, 500)}
    d = sim_delta(before, after)
    assert d["per_pod_requests"] == {"a": 30, "b": 10}
    assert d["engine_hit_rate"] == round(2000 / 3000, 4)  # (1500 + 500) / (2000 + 1000)
    assert d["imbalance"] == pytest.approx(30 / 20)  # max / mean


def test_sim_delta_without_traffic_has_no_rate_and_no_imbalance() -> None:
    same = {"a": _sim(3, 100, 10), "b": _sim(3, 100, 10)}
    d = sim_delta(same, same)
    assert d["engine_hit_rate"] is None and d["imbalance"] is None


@pytest.mark.parametrize(
    ("samples", "want"),
    [
        pytest.param([[(3, 0), (5, 0)]], 0.5, id="no-sharing-two-processes-see-half"),
        pytest.param([[(8, 5), (8, 3)]], 1.0, id="sharing-every-process-sees-all"),
        pytest.param([[(2, 0)] * 4], 0.25, id="no-sharing-four-processes"),
        pytest.param([[(0, 0), (0, 0)], [(4, 2), (4, 2)]], 1.0, id="idle-samples-skipped"),
        pytest.param([[(0, 0)]], None, id="nothing-in-flight"),
        pytest.param([], None, id="no-samples"),
    ],
)
def test_visibility(samples: list[list[tuple[int, int]]], want: float | None) -> None:
    assert visibility(samples) == want


def test_bucket_quantile_is_the_upper_bound_of_the_bucket_holding_it() -> None:
    buckets = {0.001: 50.0, 0.01: 98.0, 0.1: 100.0, float("inf"): 100.0}
    assert bucket_quantile(buckets, 0.5) == 0.001
    assert bucket_quantile(buckets, 0.9) == 0.01
    assert bucket_quantile(buckets, 0.99) == 0.1
    assert bucket_quantile({0.01: 0.0, float("inf"): 0.0}, 0.99) is None
    assert bucket_quantile({}, 0.5) is None


def test_scaled_changes_only_the_request_count() -> None:
    p = {"sessions": 60, "turns": 5, "user_tokens": 200}
    assert scaled(p, 0.5) == {"sessions": 30, "turns": 5, "user_tokens": 200}
    assert scaled({"requests": 3, "zipf": 0.8}, 0.1) == {"requests": 1, "zipf": 0.8}
    assert scaled(p, 1.0) == p


class RunBuilder:
    """One run's record with defaults; each test states only what it is about."""

    def __init__(self, scenario: str = "tenants", setup: str = REFERENCE, rep: int = 0) -> None:
        self._run: dict[str, Any] = {
            "scenario": scenario,
            "setup": setup,
            "sync": setup.endswith("+sync"),
            "rep": rep,
            "strategy": "least-request",
            "requests": 100,
            "errors": 0,
            "timed_out": False,
            "engine_hit_rate": 0.80,
            "imbalance": 1.05,
            "ttft_p50_ms": 40.0,
            "ttft_p90_ms": 300.0,
            "visibility": 1.0,
            "min_peers": None,
        }

    def with_(self, **fields: Any) -> RunBuilder:
        self._run.update(fields)
        return self

    def build(self) -> dict[str, Any]:
        return dict(self._run)


def _ref(rep: int, p50: float, p90: float, **kw: Any) -> dict[str, Any]:
    return RunBuilder(rep=rep).with_(ttft_p50_ms=p50, ttft_p90_ms=p90, **kw).build()


def test_aggregate_takes_medians_and_spreads_per_scenario_and_setup() -> None:
    runs = [
        _ref(0, 40.0, 300.0, engine_hit_rate=0.80),
        _ref(1, 50.0, 280.0, engine_hit_rate=0.82),
        _ref(2, 44.0, 320.0, engine_hit_rate=0.78),
        RunBuilder(setup="2p+sync").with_(min_peers=1).build(),
        RunBuilder(setup="2p+sync", rep=1).with_(min_peers=0, errors=2).build(),
    ]
    rows = {r["setup"]: r for r in aggregate(runs)}
    ref = rows[REFERENCE]
    assert ref["reps"] == 3 and ref["requests"] == 300
    assert ref["ttft_p50_ms"] == 44.0 and ref["ttft_p50_ms_spread"] == 10.0
    assert ref["ttft_p90_ms"] == 300.0 and ref["ttft_p90_ms_spread"] == 40.0
    assert ref["engine_hit_rate"] == 0.80 and ref["engine_hit_rate_spread"] == pytest.approx(0.04)
    assert rows["2p+sync"]["errors"] == 2
    assert rows["2p+sync"]["min_peers"] == 0  # one run lost its peer at some point


def test_one_repetition_has_no_spread() -> None:
    (row,) = aggregate([_ref(0, 40.0, 300.0)])
    assert row["ttft_p50_ms_spread"] is None


def _pair(setup: str, rep: int, **fields: Any) -> dict[str, Any]:
    return RunBuilder(setup=setup, rep=rep).with_(**fields).build()


def _check(runs: list[dict[str, Any]], setup: str) -> Mapping[str, Any]:
    return next(c for c in checks(runs) if c["setup"] == setup)


def test_a_sharing_setup_within_every_bound_meets_the_targets() -> None:
    runs = [
        _ref(0, 40.0, 300.0),
        _ref(1, 46.0, 330.0),  # noise floor: 6 ms at p50, 30 ms at p90
        _pair("4p+sync", 0, ttft_p50_ms=44.0, ttft_p90_ms=320.0, engine_hit_rate=0.79),
        _pair("4p+sync", 1, ttft_p50_ms=48.0, ttft_p90_ms=340.0, engine_hit_rate=0.795),
    ]
    c = _check(runs, "4p+sync")
    assert c["target"] is True
    assert c["d_ttft_p50_ms"] == pytest.approx(3.0)  # paired: (4 + 2) / 2
    assert c["noise_ttft_p50_ms"] == 6.0 and c["noise_ttft_p90_ms"] == 30.0
    assert c["d_hit_rate"] == pytest.approx(-0.0075)
    assert c["met"] is True


@pytest.mark.parametrize(
    ("fields", "failed"),
    [
        pytest.param({"engine_hit_rate": 0.80 - HIT_RATE_TOL - 0.01}, "hit_rate_ok", id="hit-low"),
        pytest.param({"engine_hit_rate": 0.80 + HIT_RATE_TOL + 0.01}, "hit_rate_ok", id="hit-high"),
        pytest.param({"imbalance": 1.05 + IMBALANCE_TOL + 0.01}, "imbalance_ok", id="imbalance"),
        pytest.param({"ttft_p50_ms": 40.0 + 11.0}, "ttft_p50_ok", id="p50-over-noise"),
        pytest.param({"ttft_p90_ms": 300.0 - 31.0}, "ttft_p90_ok", id="p90-under-noise"),
    ],
)
def test_each_bound_is_checked_on_its_own(fields: dict[str, Any], failed: str) -> None:
    runs = [
        _ref(0, 40.0, 300.0),
        _ref(1, 50.0, 330.0),  # noise floor: 10 ms at p50, 30 ms at p90
        _pair("2p+sync", 0, **fields),
        _pair("2p+sync", 1, **{**fields, **_shifted(fields)}),
    ]
    c = _check(runs, "2p+sync")
    assert c[failed] is False
    assert c["met"] is False
    others = {"hit_rate_ok", "imbalance_ok", "ttft_p50_ok", "ttft_p90_ok"} - {failed}
    assert all(c[k] is True for k in others), c


def _shifted(fields: dict[str, Any]) -> dict[str, Any]:
    """The second repetition's values move with the reference's (paired deltas stay equal)."""
    out: dict[str, Any] = {"ttft_p50_ms": 50.0, "ttft_p90_ms": 330.0}
    if "ttft_p50_ms" in fields:
        out["ttft_p50_ms"] = fields["ttft_p50_ms"] + 10.0
    if "ttft_p90_ms" in fields:
        out["ttft_p90_ms"] = fields["ttft_p90_ms"] + 30.0
    return out


def test_setups_without_sharing_are_compared_but_not_targets() -> None:
    runs = [_ref(0, 40.0, 300.0), _ref(1, 40.0, 300.0), _pair("2p", 0), _pair("2p", 1)]
    c = _check(runs, "2p")
    assert c["target"] is False and c["met"] is True


def test_without_a_noise_floor_ttft_is_not_decided() -> None:
    runs = [_ref(0, 40.0, 300.0), _pair("2p+sync", 0)]
    c = _check(runs, "2p+sync")
    assert c["ttft_p50_ok"] is None and c["met"] is None
    assert c["hit_rate_ok"] is True  # the fixed bounds need no noise floor


def test_one_bound_missed_is_a_miss_even_when_another_is_not_decided() -> None:
    runs = [_ref(0, 40.0, 300.0), _pair("2p+sync", 0, imbalance=1.5)]
    c = _check(runs, "2p+sync")
    assert c["ttft_p50_ok"] is None and c["imbalance_ok"] is False
    assert c["met"] is False


def test_checks_are_per_scenario() -> None:
    runs = [
        _ref(0, 40.0, 300.0),
        _ref(1, 40.0, 300.0),
        RunBuilder("docqa", REFERENCE, 0).with_(engine_hit_rate=0.5).build(),
        RunBuilder("docqa", REFERENCE, 1).with_(engine_hit_rate=0.5).build(),
        RunBuilder("docqa", "2p+sync", 0).with_(engine_hit_rate=0.5).build(),
        RunBuilder("docqa", "2p+sync", 1).with_(engine_hit_rate=0.5).build(),
    ]
    (c,) = checks(runs)
    assert c["scenario"] == "docqa" and c["d_hit_rate"] == 0.0  # not against tenants' 0.8


def test_markdown_marks_each_target_and_lists_misses() -> None:
    runs = [
        _ref(0, 40.0, 300.0),
        _ref(1, 46.0, 330.0),
        _pair("2p", 0, engine_hit_rate=0.6),
        _pair("2p", 1, engine_hit_rate=0.6),
        _pair("2p+sync", 0, imbalance=1.3),
        _pair("2p+sync", 1, imbalance=1.3),
    ]
    text = markdown({"summary": aggregate(runs), "checks": checks(runs), "notes": ["a note"]})
    assert "**replicas / tenants**" in text
    assert "| 1p |" in text and "reference" in text
    assert "+0.250 ✗" in text  # 2p+sync's imbalance
    assert "(missed; no sharing)" in text  # 2p's hit rate, shown for contrast
    assert "**Missing one or more**: tenants 2p+sync (imbalance)." in text
    assert text.rstrip().endswith("a note")


def test_the_scenarios_exist_and_name_a_strategy_each() -> None:
    assert set(STRATEGIES) == set(SCENARIOS)
    assert {"least-request", "prefix-cache"} <= set(STRATEGIES.values())
    for name in SCENARIOS:
        for quick in (False, True):
            sc = load_scenario(SCENARIO_DIR / f"{name}.yaml", quick=quick)
            assert sc.loads, name


def test_the_setups_are_one_process_and_two_and_four_with_and_without_sharing() -> None:
    assert [s.key for s in SETUPS] == ["1p", "2p", "2p+sync", "4p", "4p+sync"]
    assert SETUPS[0].key == REFERENCE
