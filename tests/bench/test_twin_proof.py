"""bench.twin_proof: the twin's numbers against a live run's, per rule, for its recommendation
(within 5 % of the live best or inside the noise floor) and for its replay of the captured
rule against the capture's own TTFTs. A hand-made `extproc tune` output
(twin_tune_fixture.json) and hand-made live repetitions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.twin_proof import (
    add_repetitions,
    capture_in,
    captured_ttft,
    keep_inputs,
    markdown,
    pooled_tune,
    proof_path,
    prove,
    read_capture,
    replace_runs,
)

FIXTURE = Path(__file__).with_name("twin_tune_fixture.json")


def _result(table: dict[str, dict[str, list[float]]], load: str = "c20") -> dict[str, Any]:
    """A `bench run` result: per variant, per metric, one value per repetition."""
    runs = []
    for variant, metrics in table.items():
        reps = len(next(iter(metrics.values())))
        for rep in range(reps):
            runs.append(
                {"load": load, "variant": variant, "rep": rep}
                | {m: vals[rep] for m, vals in metrics.items()}
            )
    strategies = {"kv-aware-dynamo": "kv-aware-dynamo"}
    variants = [{"name": v, "kind": "extproc", "strategy": strategies.get(v, v)} for v in table]
    return {"scenario": "multiturn", "config": {"variants": variants}, "runs": runs}


LIVE: dict[str, dict[str, list[float]]] = {
    "kv-aware": {"ttft_p50_ms": [48, 52], "ttft_p90_ms": [110, 120], "cache_hit_rate": [0.7, 0.74]},
    "least-request": {"ttft_p50_ms": [76, 80], "ttft_p90_ms": [170, 176], "cache_hit_rate": [0.3, 0.3]},
    "prefix-cache": {"ttft_p50_ms": [60, 62], "ttft_p90_ms": [128, 132], "cache_hit_rate": [0.7, 0.7]},
    "kv-aware-dynamo": {"ttft_p50_ms": [55, 57], "ttft_p90_ms": [124, 126], "cache_hit_rate": [0.7, 0.7]},
}  # fmt: skip


def _capture(ttfts: list[Any]) -> list[dict[str, Any]]:
    return [{"timestamp": i, "ttft_ms": t} for i, t in enumerate(ttfts)]


def test_each_rule_is_matched_to_its_live_variant_and_judged_within_15_percent() -> None:
    tune = json.loads(FIXTURE.read_text())
    proof = prove(tune, _result(LIVE), _capture([50.0] * 9 + [120.0]))
    rows = {r.name: r for r in proof.rules}
    assert rows["dynamo"].variant == "kv-aware-dynamo"  # another name, the same strategy
    assert rows["kv-aware"].live["ttft_p50_ms"] == 50
    assert rows["kv-aware"].live_range["ttft_p90_ms"] == (110, 120)
    assert rows["kv-aware"].ratio == {"ttft_p50_ms": 1.04, "ttft_p90_ms": round(118 / 115, 4)}
    # least-request's p50: the twin says 95 ms, live 78 ms (1.22): outside 15 %
    assert rows["least-request"].ratio["ttft_p50_ms"] == round(95 / 78, 4)
    assert {n: r.within for n, r in rows.items()} == {
        "kv-aware": True,
        "least-request": False,
        "prefix-cache": True,
        "dynamo": True,
    }
    assert proof.rules_within == (3, 4)
    assert proof.reps == 2 and proof.load == "c20"
    assert [(p.metric, p.recommended, p.best, p.verdict) for p in proof.picks] == [
        ("ttft_p50_ms", "kv-aware", "kv-aware", "yes"),
        ("ttft_p90_ms", "kv-aware", "kv-aware", "yes"),
    ]
    assert proof.running == "kv-aware"
    assert proof.replay["captured"]["ttft_p50_ms"] == 50.0
    assert proof.replay["captured"]["ttft_p90_ms"] == 120.0
    assert proof.replay["within"] is True
    assert proof.fidelity == tune["fidelity"]


def test_a_rule_within_at_p50_but_not_at_p90_counts_at_p50_alone() -> None:
    live = {**LIVE, "prefix-cache": {**LIVE["prefix-cache"], "ttft_p90_ms": [200, 200]}}
    proof = prove(json.loads(FIXTURE.read_text()), _result(live), _capture([50.0]))
    row = next(r for r in proof.rules if r.name == "prefix-cache")
    assert row.p50_within is True and row.within is False
    assert proof.rules_within == (2, 4)
    assert proof.rules_within_p50 == (3, 4)  # least-request is out at p50 too
    text = markdown(proof)
    assert "rules within 15%: 2 of 4 at p50 and p90, 3 of 4 at p50; " in text
    assert "3 of 4 at p50 within 15% of the live repetitions' range" in text


@pytest.mark.parametrize(
    ("live_p50", "want_within", "want_in_spread"),
    [
        ([60, 80, 130], False, True),  # twin 95 against a median of 80 (1.19), range 60-130
        ([40, 80, 82], False, False),  # the same median, a range of 40-82: 95 is past 94.3
        ([85, 90, 95], True, True),
    ],
)
def test_a_miss_of_the_live_median_inside_the_live_runs_spread_is_told_apart(
    live_p50: list[float], want_within: bool, want_in_spread: bool
) -> None:
    # The twin's least-request (fixture: 95 ms at p50) against three live repetitions.
    live = {**LIVE, "least-request": {**LIVE["least-request"], "ttft_p50_ms": live_p50}}
    live = {k: {m: (v * 2)[:3] for m, v in t.items()} for k, t in live.items()}  # 3 reps
    proof = prove(json.loads(FIXTURE.read_text()), _result(live), _capture([50.0]))
    row = next(r for r in proof.rules if r.name == "least-request")
    assert (row.p50_within, row.p50_in_spread) == (want_within, want_in_spread)


@pytest.mark.parametrize(
    ("seeds", "live_p50", "want"),
    [
        ([60, 62, 130, 133], [58, 128, 131], True),  # two modes in both: the ranges meet
        ([60, 61, 62], [128, 130, 131], False),  # the twin's one mode is not live's
        ([110, 112], [128, 130, 131], True),  # 112 is within 15 % of live's lowest
        (None, [128, 130, 131], None),  # a tuning without its seeds: nothing to say
    ],
)
def test_the_twins_seeds_range_is_set_beside_the_live_runs_range(
    seeds: list[float] | None, live_p50: list[float], want: bool | None
) -> None:
    # A rule with two modes (kvwins' predicted-latency: live 122, 343, 344 ms) has medians that
    # fall on either; the twin's seeds show its modes as the live runs show theirs.
    tune = json.loads(FIXTURE.read_text())
    for rule in tune["rules"]:
        if rule["name"] == "least-request" and seeds is not None:
            rule["ttft_p50_ms_seeds"] = seeds
    live = {**LIVE, "least-request": {**LIVE["least-request"], "ttft_p50_ms": live_p50}}
    live = {k: {m: (v * 2)[:3] for m, v in t.items()} for k, t in live.items()}  # 3 reps
    proof = prove(tune, _result(live), _capture([50.0]))
    row = next(r for r in proof.rules if r.name == "least-request")
    assert row.ranges_meet is want
    assert row.twin_range == (None if seeds is None else (min(seeds), max(seeds)))
    assert proof.rules_ranges_meet == (int(bool(want)), 0 if want is None else 1)
    if seeds is not None:
        assert f"| least-request | 95 ({min(seeds):.0f}-{max(seeds):.0f}) |" in markdown(proof)


def test_a_rule_the_twin_has_but_live_did_not_run_is_not_judged() -> None:
    tune = json.loads(FIXTURE.read_text())
    live = {k: v for k, v in LIVE.items() if k != "least-request"}
    proof = prove(tune, _result(live), _capture([50.0]))
    row = next(r for r in proof.rules if r.name == "least-request")
    assert row.variant is None and row.within is None and row.live["ttft_p50_ms"] is None
    assert row.p50_within is None
    assert proof.rules_within == (3, 3)
    # a weight of the twin's own search: kv-aware's strategy, but not the rule that ran live
    weighted = {"name": "kv-aware overlap 2", "strategy": "kv-aware", "ttft_p50_ms": 40.0}
    tune["rules"].append(weighted | {"params": {"overlap_weight": 2.0}})
    row = next(r for r in prove(tune, _result(LIVE), []).rules if r.name == weighted["name"])
    assert row.variant is None and row.within is None


def _pick_tune(recommended: str) -> dict[str, Any]:
    rules = [{"name": n, "strategy": n, "ttft_p50_ms": 100.0} for n in ("a", "b")]
    return {"rules": rules, "running": "a", "best": {"name": recommended}}


@pytest.mark.parametrize(
    ("table", "want", "noise"),
    [
        # 102 against 100: within 5 %
        ({"a": [100, 104], "b": [99, 101]}, "yes", 4),
        # 12 % behind, but b's own repetitions spread by 20 and a's best is inside them
        ({"a": [108, 116], "b": [90, 110]}, "within noise", 20),
        # 12 % behind and behind in every repetition: no floor helps
        ({"a": [111, 113], "b": [90, 110]}, "no", 0),
        # 30 % behind, the widest spread (a's) 21: outside it though a's best ties b's worst
        ({"a": [110, 130, 131], "b": [90, 100, 110]}, "no", 21),
        # a round-robin-like variant's spread (30) is the floor when it ran twice
        ({"a": [100, 124], "b": [99, 101], "round-robin": [150, 180]}, "within noise", 30),
    ],
)
def test_the_recommended_rule_is_within_5_percent_of_the_live_best_or_inside_the_noise(
    table: dict[str, list[float]], want: str, noise: float
) -> None:
    result = _result({v: {"ttft_p50_ms": vals} for v, vals in table.items()})
    proof = prove(_pick_tune("a"), result, [])
    (pick,) = [p for p in proof.picks if p.metric == "ttft_p50_ms"]
    assert (pick.best, pick.verdict, pick.noise_ms) == ("b", want, noise)


@pytest.mark.parametrize(
    ("recommended", "a_p50", "b_p90", "want"),
    [
        # a (running) is behind b at p50 by 25 %, ahead at p90: b scores (0.8 + 1.3) / 2 =
        # 1.05 against a's 1.0, so a, the best by the objective, is a "yes" there
        ("a", [100, 100], [260, 260], ("a", "yes", 1.0)),
        # b recommended: 1.05 of the best, within 5 %
        ("b", [100, 100], [260, 260], ("a", "yes", 1.05)),
        # b at (0.8 + 1.5) / 2 = 1.15, behind in every repetition
        ("b", [100, 100], [300, 300], ("a", "no", 1.15)),
        # b's repetitions spread (1.05 and 1.25, a's 0.95 and 1.05): 1.15 against 1.0 is inside
        ("b", [90, 110], [260, 340], ("a", "within noise", 1.15)),
        # the same spread, but b behind in every repetition (a's at 1.0): no
        ("b", [100, 100], [260, 340], ("a", "no", 1.15)),
    ],
)
def test_the_pick_is_also_judged_by_what_the_twin_minimizes(
    recommended: str, a_p50: list[float], b_p90: list[float], want: tuple[str, str, float]
) -> None:
    table = {
        "a": {"ttft_p50_ms": a_p50, "ttft_p90_ms": [200, 200]},
        "b": {"ttft_p50_ms": [80, 80], "ttft_p90_ms": b_p90},
    }
    proof = prove(_pick_tune(recommended), _result(table), [])
    by_metric = {p.metric: (p.best, p.verdict) for p in proof.picks}
    assert by_metric["ttft_p50_ms"] == ("b", "yes" if recommended == "b" else "no")
    o = proof.objective
    assert o is not None and (o.best, o.verdict, o.ratio) == want
    assert f"live best `a` 1.00 (ratio {want[2]:.2f}" in markdown(proof)


def test_the_twins_own_word_on_its_margin_is_kept_and_shown() -> None:
    tune = _pick_tune("b")
    tune["best"] = {"name": "b", "beyond_noise": False}
    result = _result({"a": {"ttft_p50_ms": [100, 101]}, "b": {"ttft_p50_ms": [99, 100]}})
    proof = prove(tune, result, [])
    assert proof.beyond_noise is False and proof.recommended == "b" and proof.running == "a"
    assert "it says keep the running rule" in markdown(proof)
    tune["best"]["beyond_noise"] = True
    assert "keep the running rule" not in markdown(prove(tune, result, []))


def test_a_recommendation_that_did_not_run_live_has_no_verdict() -> None:
    tune = _pick_tune("a")
    tune["rules"].append({"name": "z", "strategy": "z", "ttft_p50_ms": 1.0})
    tune["best"] = {"name": "z"}
    result = _result({"a": {"ttft_p50_ms": [100, 101]}, "b": {"ttft_p50_ms": [90, 91]}})
    (pick,) = [p for p in prove(tune, result, []).picks if p.metric == "ttft_p50_ms"]
    assert (pick.recommended, pick.best, pick.verdict) == ("z", "b", "not run live")


def test_the_replay_is_judged_against_the_captured_ttfts_only() -> None:
    got = captured_ttft(_capture([None, 30.0, 10.0, True, 20.0]))  # no TTFT, a bool: skipped
    assert got == {"requests": 5.0, "with_ttft": 3.0, "ttft_p50_ms": 20.0, "ttft_p90_ms": 30.0}
    tune = json.loads(FIXTURE.read_text())
    far = prove(tune, _result(LIVE), _capture([40.0] * 10))  # twin 52 against 40: 1.30
    assert far.replay["ratio"]["ttft_p50_ms"] == 1.3 and far.replay["within"] is False
    tune["running"] = "nope"
    assert "twin" not in prove(tune, _result(LIVE), _capture([40.0])).replay


def test_the_markdown_names_every_rule_and_the_three_verdicts() -> None:
    proof = prove(json.loads(FIXTURE.read_text()), _result(LIVE), _capture([50.0] * 10))
    text = markdown(proof)
    assert "| least-request | 95 | 78 (76-80) | 1.22 |" in text
    assert "rules within 15%: 3 of 4 at p50 and p90, 3 of 4 at p50" in text
    assert "the twin recommends `kv-aware`, live 50 ms; live best `kv-aware` 50 ms" in text
    assert "replay of `kv-aware` against the capture (10 TTFTs): p50 52 / 50 ms (1.04)" in text


def test_a_live_runs_inputs_are_kept_so_a_fresh_clone_tunes_the_same(tmp_path: Path) -> None:
    # What (b) and (c) read, kept beside the committed figures: the capture gzipped, its
    # config and result.json; `--skip-live` on the kept directory finds the same capture.
    run = tmp_path / "results" / "multiturn"
    run.mkdir(parents=True)
    capture = run / "capture-kv-aware-rep0.jsonl"
    capture.write_text("".join(json.dumps(row) + "\n" for row in _capture([40.0, 55.5])))
    (run / "capture-kv-aware-rep0.config.yaml").write_text("routing: {}\n")
    (run / "result.json").write_text(json.dumps(_result(LIVE)))
    kept = keep_inputs("multiturn", run, capture_in(run, 0), tmp_path / "kept")
    assert kept is not None
    again = capture_in(kept, 0)
    assert again.name == "capture-kv-aware-rep0.jsonl.gz"
    assert read_capture(again) == read_capture(capture)
    assert (kept / "capture-kv-aware-rep0.config.yaml").read_text() == "routing: {}\n"
    assert json.loads((kept / "result.json").read_text()) == _result(LIVE)
    assert again.read_bytes()[:2] == b"\x1f\x8b"  # gzipped
    # A trace from another repository (bench/data/external/) stays out of the commits.
    assert keep_inputs("mooncake", run, capture, tmp_path / "kept") is None


def test_more_live_repetitions_join_the_matrix_the_twin_is_judged_against() -> None:
    # A later run of the same rules (no capture) becomes repetitions 2 and 3: the live medians,
    # ranges and the summary cover all four; the capture tuned is untouched.
    def run(table: dict[str, dict[str, list[float]]], started: int) -> dict[str, Any]:
        result = _result(table)
        return result | {
            "started_unix": started,
            "runs": [r | {"errors": 0} for r in result["runs"]],
        }

    first = run(LIVE, 100)
    later = {
        "kv-aware": {"ttft_p50_ms": [70, 80], "ttft_p90_ms": [150, 160], "cache_hit_rate": [0.7, 0.7]},
        "least-request": {"ttft_p50_ms": [77, 79], "ttft_p90_ms": [171, 175], "cache_hit_rate": [0.3, 0.3]},
    }  # fmt: skip
    merged = add_repetitions(first, run(later, 200))
    reps = sorted(r["rep"] for r in merged["runs"] if r["variant"] == "kv-aware")
    assert reps == [0, 1, 2, 3]
    assert merged["merged_from"] == [100, 200]
    summary = {row["variant"]: row for row in merged["summary"]}
    assert summary["kv-aware"]["reps"] == 4 and summary["kv-aware"]["ttft_p50_ms"] == 61
    assert summary["prefix-cache"]["reps"] == 2  # not run again
    proof = prove(json.loads(FIXTURE.read_text()), merged, _capture([50.0] * 10))
    rows = {r.name: r for r in proof.rules}
    assert rows["kv-aware"].live["ttft_p50_ms"] == 61  # median of 48, 52, 70, 80
    assert rows["kv-aware"].live_range["ttft_p50_ms"] == (48, 80)
    assert first == run(LIVE, 100)  # the input is not changed
    again = add_repetitions(merged, run(later, 300))
    assert again["merged_from"] == [100, 200, 300]
    assert max(r["rep"] for r in again["runs"]) == 5


def test_a_rule_run_again_replaces_its_live_runs_and_only_its() -> None:
    # A rule changed since the live matrix ran (a default of its moved): its runs are replaced
    # by a later run of it alone; the other rules' runs, and so their medians, stay.
    first = _result(LIVE) | {"started_unix": 100}
    first["runs"] = [r | {"errors": 0} for r in first["runs"]]
    later = _result(
        {"prefix-cache": {"ttft_p50_ms": [90, 94, 98], "ttft_p90_ms": [190, 200, 210],
                          "cache_hit_rate": [0.6, 0.6, 0.6]}}
    ) | {"started_unix": 200}  # fmt: skip
    later["runs"] = [r | {"errors": 0} for r in later["runs"]]
    merged = replace_runs(first, later)
    summary = {row["variant"]: row for row in merged["summary"]}
    assert summary["prefix-cache"]["reps"] == 3 and summary["prefix-cache"]["ttft_p50_ms"] == 94
    assert summary["kv-aware"]["reps"] == 2 and summary["kv-aware"]["ttft_p50_ms"] == 50
    assert sorted(r["rep"] for r in merged["runs"] if r["variant"] == "prefix-cache") == [0, 1, 2]
    assert merged["rerun"] == {"prefix-cache": 200} and merged["merged_from"] == [100, 200]
    rows = {
        r.name: r
        for r in prove(json.loads(FIXTURE.read_text()), merged, _capture([50.0] * 10)).rules
    }
    assert rows["prefix-cache"].live_range["ttft_p50_ms"] == (90, 98)
    assert first["started_unix"] == 100 and len(first["runs"]) == len(_result(LIVE)["runs"])
    # A rule run beside the one run again (to warm what it learns) is not kept.
    beside = _result(
        {"prefix-cache": {"ttft_p50_ms": [90, 94, 98], "ttft_p90_ms": [190, 200, 210],
                          "cache_hit_rate": [0.6, 0.6, 0.6]},
         "kv-aware": {"ttft_p50_ms": [10, 10, 10], "ttft_p90_ms": [20, 20, 20],
                      "cache_hit_rate": [0.9, 0.9, 0.9]}}
    ) | {"started_unix": 300}  # fmt: skip
    beside["runs"] = [r | {"errors": 0} for r in beside["runs"]]
    kept = replace_runs(first, beside, only=["prefix-cache"])
    summary = {row["variant"]: row for row in kept["summary"]}
    assert summary["kv-aware"]["ttft_p50_ms"] == 50 and summary["prefix-cache"]["ttft_p50_ms"] == 94
    assert kept["rerun"] == {"prefix-cache": 300}


@pytest.mark.parametrize(
    ("rep", "name"),
    [
        (0, "twin-proof-docqa.json"),
        (1, "twin-proof-docqa-rep1.json"),
        (2, "twin-proof-docqa-rep2.json"),
    ],
)
def test_each_repetitions_capture_has_a_proof_file_of_its_own(rep: int, name: str) -> None:
    # the first repetition's keeps the name earlier proofs were committed under
    assert proof_path(Path("data"), "docqa", rep) == Path("data") / name


def _proof_rule(name: str, p50: float, p90: float, seeds: tuple[float, float]) -> dict[str, Any]:
    return {
        "name": name,
        "variant": name,
        "twin": {"ttft_p50_ms": p50, "ttft_p90_ms": p90, "hit_rate": 0.5},
        "twin_range": list(seeds),
    }


def test_several_captures_twins_pool_into_one_tuning_the_live_medians_are_judged_against() -> None:
    # Three captures of one scenario, one per repetition (each a draw of the workload): a
    # rule's twin figure is the median of the three, its seeds' range spans them all, and the
    # pick is the lowest by the twin's own score against the running rule's pooled figures.
    draws = [
        [("kv-aware", 40, 100, (38, 42)), ("least-request", 90, 300, (85, 99))],
        [("kv-aware", 50, 120, (47, 55)), ("least-request", 45, 110, (44, 46))],
        [("kv-aware", 44, 90, (40, 49)), ("least-request", 80, 250, (70, 90))],
    ]
    proofs = [{"running": "kv-aware", "rules": [_proof_rule(*r) for r in rules]} for rules in draws]
    tune = pooled_tune(proofs)
    rules = {r["name"]: r for r in tune["rules"]}
    assert (rules["kv-aware"]["ttft_p50_ms"], rules["kv-aware"]["ttft_p90_ms"]) == (44, 100)
    assert (rules["least-request"]["ttft_p50_ms"], rules["least-request"]["ttft_p90_ms"]) == (
        80,
        250,
    )
    assert rules["kv-aware"]["ttft_p50_ms_seeds"] == [38, 55]
    assert tune["running"] == "kv-aware" and tune["best"] == {"name": "kv-aware"}
    # One draw alone would have picked least-request (the second's 45 / 110 ms).
    assert pooled_tune(proofs[1:2])["best"] == {"name": "least-request"}
    result = {
        "scenario": "s",
        "runs": [
            {"variant": v, "load": "c", "rep": k, "ttft_p50_ms": p50, "ttft_p90_ms": 2 * p50}
            for k in range(3)
            for v, p50 in (("kv-aware", 45 + k), ("least-request", 78 + k))
        ],
    }
    proof = prove(tune, result, [])
    assert [r.p50_within for r in proof.rules] == [True, True]  # 44 / 46, 80 / 79
    with pytest.raises(ValueError, match="no proof"):
        pooled_tune([])
