"""The scenario runner's own pieces: variant selection and the engine-side TTFT split."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.scenario import Variant, _engine_ttft_ms, load_scenario

SCENARIOS = Path(__file__).resolve().parents[2] / "bench" / "scenarios"


def test_a_run_can_keep_named_variants_only() -> None:
    sc = load_scenario(SCENARIOS / "higress.yaml", only_variants=["envoy-rr", "prefix-cache"])
    assert [v.name for v in sc.variants] == ["envoy-rr", "prefix-cache"]
    assert sc.baseline == "envoy-rr"
    sc = load_scenario(SCENARIOS / "higress.yaml", only_variants=["prefix-cache"])
    assert sc.baseline is None  # no ratios without the baseline in the run
    with pytest.raises(ValueError, match="no variants"):
        load_scenario(SCENARIOS / "higress.yaml", only_variants=["nope"])


def test_named_variants_run_at_the_quick_size_even_outside_the_quick_subset() -> None:
    # higress's quick block runs 3 variants; a twin proof at the quick size names others.
    quick = load_scenario(SCENARIOS / "higress.yaml", quick=True)
    assert "kv-aware" not in [v.name for v in quick.variants]
    sc = load_scenario(SCENARIOS / "higress.yaml", quick=True, only_variants=["kv-aware"])
    assert [v.name for v in sc.variants] == ["kv-aware"]
    assert sc.repetitions == quick.repetitions == 1  # the quick sizes still apply
    assert sc.loads == quick.loads


def test_the_overhead_scenario_measures_tracing_at_1_and_100_percent() -> None:
    sc = load_scenario(SCENARIOS / "overhead.yaml")
    traced = {v.name: v.tracing for v in sc.variants if v.tracing is not None}
    assert sorted(traced.values()) == [0.01, 1.0]
    assert all(v.tracing is None for v in sc.variants if v.name == "buffered+als")


def _stats(*reqs: tuple[str, float]) -> dict[str, Any]:
    return {"recent": [{"request_id": i, "sim_ttft_s": t} for i, t in reqs]}


def test_engine_ttft_counts_only_requests_finished_during_the_run() -> None:
    before = {"a": _stats(("old", 9.0))}
    after = {
        "a": _stats(("old", 9.0), ("a1", 0.010), ("a2", 0.030)),
        "b": _stats(("b1", 0.020), ("b2", -1.0)),  # -1: aborted before its first token
    }
    assert _engine_ttft_ms(before, after, 50) == 20.0
    assert _engine_ttft_ms(before, after, 100) == 30.0
    assert _engine_ttft_ms(after, after, 50) is None


def test_a_variant_may_run_its_rule_with_params_on_a_server_of_its_own() -> None:
    v = Variant.parse(
        {"name": "pl-uncapped", "kind": "extproc", "strategy": "predicted-latency",
         "params": {"spread_cap": 0.0}}
    )  # fmt: skip
    assert v.params == {"spread_cap": 0.0} and v.strategy == "predicted-latency"
    assert Variant.parse({"name": "pl", "kind": "extproc", "strategy": "kv-aware"}).params is None
    for bad in (
        {"name": "x", "kind": "extproc", "params": {"a": 1}},  # no strategy to give them to
        {"name": "x", "kind": "peer", "policy": "random", "strategy": "s", "params": {}},
        {"name": "x", "kind": "extproc", "strategy": "s", "params": [1]},
        {"name": "x", "kind": "extproc", "strategy": "s", "params": {}, "held": True},
        {"name": "x", "kind": "extproc", "strategy": "s", "params": {}, "processes": 2},
    ):
        with pytest.raises(ValueError, match="params"):
            Variant.parse(bad)
