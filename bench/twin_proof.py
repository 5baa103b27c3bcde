"""Does the twin tell the truth? `extproc tune` on a live run's capture, against the live run.

For each named scenario (bench/scenarios/*.yaml):

(a) live: `python -m bench run SCENARIO --variants RULES --repetitions R --capture kv-aware`
    (each rule a variant of the scenario; default kv-aware, least-request, prefix-cache,
    predicted-latency, kv-aware-dynamo, plus session-affinity for higress), so RESULTS/SCENARIO/
    holds result.json and the joined capture of each of kv-aware's runs
    (`capture-kv-aware-repN.jsonl`, bench/scenario.py);
(b) twin: `python -m extproc tune RESULTS/SCENARIO/capture-kv-aware-rep0.jsonl --json
    RESULTS/SCENARIO/tune-kv-aware-rep0.json --rules RULES`: the capture of the first
    repetition replayed under every rule run live, so that its recommendation is one the live
    run can judge (`--all-candidates`: the twin's own candidates, weights searched too);
(c) the proof, three questions:
    - per rule, the twin's TTFT p50 and p90 against the live medians of the repetitions:
      ratio twin / live, within `--tolerance` (15 %)?
    - the rule the twin recommends (`best`), as it did live: its live p50 and p90 against the
      live best rule's at each (the lowest median among the rules), within 5 % or within the
      noise floor (bench/compare.py's: the widest spread over the repetitions of the
      round-robin-like variants if any ran, else of the two rules compared; none when the
      recommended rule was behind in every repetition)?
    - the twin's replay of the rule that ran in the capture (`running`) against the TTFTs
      the capture recorded (the gateway's own: first token from the request's first byte).

A Markdown table on stdout, the whole comparison in bench/data/twin-proof-SCENARIO.json.

    flock /tmp/bench.lock .venv/bin/python -m bench.twin_proof multiturn hetero --repetitions 2
    .venv/bin/python -m bench.twin_proof multiturn --skip-live bench/results/twin-proof   # (b), (c)
    .venv/bin/python -m bench.twin_proof multiturn --skip-live bench/data/twin-captures  # any clone

`--rep N` tunes the capture of repetition N instead (its proof in
bench/data/twin-proof-SCENARIO-repN.json): a later repetition's capture is of a gateway that has
served the earlier runs, whose latency models (which the capture carries) are warm, as an
operator's running gateway's are; the first's is of a gateway's first minutes.

`--pool 0,1,2` (with `--skip-live`, after each capture's proof) judges the twin over those
repetitions' captures, pooled (`pooled_tune`: per rule the median of the captures' twins),
against the live repetitions: each repetition is a draw of the workload, live and captured
alike, and one capture's twin is one draw set against three (bench/data/twin-proof-SCENARIO-
pooled.json).

A live run keeps what (b) and (c) read in bench/data/twin-captures/SCENARIO/ (`--keep`; the
capture gzipped, about 20 KB a scenario; not for a trace from elsewhere), so that the
committed figures can be re-derived on a fresh clone without the live run.

Without `extproc tune` (an older checkout) it says so and stops after (a). Only (a) loads the
machine; (b) replays in virtual time (on `extproc tune`'s worker processes), stopped with its
workers after `--tune-timeout` (900 s): a replay whose virtual clock runs on without end must
not hold the bench lock.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import logging
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.compare import _values, noise_floor
from bench.scenario import aggregate, config_of_capture, load_scenario
from bench.stats import percentile
from extproc.twin.tune import score

__all__ = [
    "DEFAULT_RULES",
    "Proof",
    "add_repetitions",
    "captured_ttft",
    "main",
    "markdown",
    "objective",
    "pooled_tune",
    "proof_path",
    "prove",
]

log = logging.getLogger("bench.twin_proof")

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "bench" / "scenarios"
PYTHON = ROOT / ".venv" / "bin" / "python"
DEFAULT_RULES = (
    "kv-aware",
    "least-request",
    "prefix-cache",
    "predicted-latency",
    "kv-aware-dynamo",
)
EXTRA_RULES = {"higress": ("session-affinity",)}  # scenarios where another rule is in the running
CAPTURED = "kv-aware"  # the variant whose traffic is captured (the rule "running" in the capture)
METRICS = ("ttft_p50_ms", "ttft_p90_ms")
TOLERANCE = 0.15  # twin against live, per rule and percentile
BEST_TOLERANCE = 0.05  # the recommended rule's live TTFT against the live best's
TUNE_TIMEOUT_S = (
    900.0  # a replay that never ends (its virtual clock runs on) must not hold the lock
)


@dataclass(frozen=True, slots=True)
class RuleRow:
    """One rule: what the twin predicts and what the repetitions measured (medians, ranges)."""

    name: str
    variant: str | None  # the live variant it was matched to (None: not run live)
    twin: dict[str, float | None]
    live: dict[str, float | None]
    live_range: dict[str, tuple[float, float] | None]
    ratio: dict[str, float | None]  # twin / live
    within: bool | None  # every metric within the tolerance (None: nothing to compare)
    p50_within: bool | None  # the p50 alone (issue 37's bar for other rules than the captured)
    # The twin's p50 within the tolerance of the live repetitions' range (from the lowest
    # less 15 % to the highest plus 15 %): a miss of the median that the live runs' own spread
    # covers, where a rule's repetitions disagree by more than the bar (kvwins'
    # `predicted-latency`, 2026-12-07: 122-344 ms in three runs). Context, not the bar.
    p50_in_spread: bool | None = None
    # The twin's seeds' p50s, lowest to highest (the tuning's `ttft_p50_ms_seeds`), and whether
    # that range meets the live runs' (each widened by the tolerance): where a rule has two
    # modes, live and in the twin (kvwins' `predicted-latency`), a median on each side is one of
    # them and the ranges are what can be compared. Context, not the bar.
    twin_range: tuple[float, float] | None = None
    ranges_meet: bool | None = None


@dataclass(frozen=True, slots=True)
class Pick:
    """The twin's recommendation, judged live at one metric."""

    metric: str
    recommended: str
    recommended_live: float | None
    best: str
    best_live: float
    ratio: float | None
    noise_ms: float  # in the metric's unit (ms; the objective's: none)
    verdict: str  # yes | within noise | no | not run live


@dataclass(frozen=True, slots=True)
class Proof:
    scenario: str
    load: str
    reps: int
    tolerance: float
    rules: list[RuleRow]
    recommended: str | None
    # The twin's own word on its pick: ahead of the running rule by more than its seeds'
    # spread (False: "keep the running rule"; None: not said)
    beyond_noise: bool | None
    picks: list[Pick]
    running: str | None
    replay: dict[str, Any]  # the twin's running rule against the capture's own TTFTs
    fidelity: Any
    # The pick judged by what the twin minimizes (`objective`): no single rule can be the
    # live best at p50 and at p90 where two rules share those, and the twin picks by both.
    objective: Pick | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def _tally(self, flag: str) -> tuple[int, int]:
        """(rules whose `flag` is True, rules judged on it: not None)."""
        judged = [v for r in self.rules if (v := getattr(r, flag)) is not None]
        return sum(judged), len(judged)

    @property
    def rules_within(self) -> tuple[int, int]:
        return self._tally("within")

    @property
    def rules_within_p50(self) -> tuple[int, int]:
        return self._tally("p50_within")

    @property
    def rules_in_spread_p50(self) -> tuple[int, int]:
        return self._tally("p50_in_spread")

    @property
    def rules_ranges_meet(self) -> tuple[int, int]:
        return self._tally("ranges_meet")


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 4)


def captured_ttft(lines: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """TTFT p50 / p90 (ms) the capture recorded, over its lines with a TTFT (nearest rank, as
    the live summaries)."""
    ttft = [float(x) for line in lines if (x := _num(line.get("ttft_ms"))) is not None]
    return {
        "requests": float(len(lines)),
        "with_ttft": float(len(ttft)),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p90_ms": percentile(ttft, 90),
    }


def objective(
    runs: Sequence[Mapping[str, Any]], load: str, variant: str, running: tuple[float, float]
) -> list[float]:
    """What the twin minimizes (`extproc.twin.tune.score`), per live repetition of `variant`:
    the mean of its TTFT p50 and p90, each relative to `running` (the running rule's live
    medians)."""
    out = []
    for r in runs:
        if r.get("load") != load or r.get("variant") != variant:
            continue
        p50, p90 = (_num(r.get(m)) for m in METRICS)
        if p50 is not None and p90 is not None:
            out.append(score((p50, p90), running))
    return out


def _judge_objective(
    runs: Sequence[Mapping[str, Any]],
    load: str,
    recommended: str,
    rec_variant: str | None,
    running_variant: str | None,
    variants: Sequence[str],
    best_tolerance: float,
) -> Pick | None:
    """The recommendation against the live best by the twin's objective: within
    `best_tolerance`, else within the wider spread of the two rules' repetitions (unless
    behind in every one), else no."""
    if running_variant is None:
        return None
    base = [_values(runs, load, running_variant, m) for m in METRICS]
    if not all(base):
        return None
    running = (statistics.median(base[0]), statistics.median(base[1]))
    scores = {v: s for v in variants if (s := objective(runs, load, v, running))}
    if not scores:
        return None
    medians = {v: statistics.median(s) for v, s in scores.items()}
    top = min(medians, key=lambda v: medians[v])
    if rec_variant is None or rec_variant not in scores:
        return Pick("objective", recommended, None, top, medians[top], None, 0.0, "not run live")
    mine, theirs = medians[rec_variant], medians[top]
    spread = max(max(s) - min(s) for s in (scores[rec_variant], scores[top]))
    spread, verdict = _verdict(scores[rec_variant], scores[top], spread, best_tolerance)
    return Pick(
        "objective", recommended, round(mine, 4), top, round(theirs, 4), _ratio(mine, theirs),
        round(spread, 4), verdict,
    )  # fmt: skip


def _verdict(
    mine: Sequence[float], theirs: Sequence[float], floor: float, best_tolerance: float
) -> tuple[float, str]:
    """(the noise floor that applies, the verdict) of a recommended rule's live repetitions
    against the live best's: "yes" within `best_tolerance` of it (medians), "within noise"
    within `floor` of it unless behind in every repetition (then no noise excuses it, and the
    floor is 0), else "no"."""
    if min(mine) > max(theirs):
        floor = 0.0
    a, b = statistics.median(mine), statistics.median(theirs)
    if a <= (1 + best_tolerance) * b:
        return floor, "yes"
    return floor, "within noise" if a - b <= floor else "no"


def _variant_of(rule: Mapping[str, Any], variants: Mapping[str, str | None]) -> str | None:
    """The live variant a twin rule stands for: the same name, else the same strategy with its
    default parameters (a twin candidate with weights of its own, or replayed from a cold
    start, never ran live)."""
    name = str(rule.get("name"))
    if name in variants:
        return name
    strategy = rule.get("strategy")
    if not strategy or rule.get("params") or rule.get("cold"):
        return None
    return next((v for v, s in variants.items() if s == strategy), None)


def prove(
    tune: Mapping[str, Any],
    result: Mapping[str, Any],
    capture: Sequence[Mapping[str, Any]],
    *,
    load: str | None = None,
    tolerance: float = TOLERANCE,
    best_tolerance: float = BEST_TOLERANCE,
) -> Proof:
    """The three comparisons (module docstring, (c)) from `extproc tune`'s JSON, the live
    `result.json` of `bench run` and the capture's lines. Pure."""
    runs: list[Mapping[str, Any]] = list(result["runs"])
    if load is None:
        load = str(runs[0]["load"]) if runs else ""
    strategies = {
        str(v.get("name")): v.get("strategy")
        for v in (result.get("config") or {}).get("variants", ())
        if isinstance(v, Mapping)
    }
    live_variants = {str(r["variant"]): strategies.get(str(r["variant"])) for r in runs}
    rows: list[RuleRow] = []
    for rule in tune.get("rules", ()):
        variant = _variant_of(rule, live_variants)
        twin = {m: _num(rule.get(m)) for m in METRICS}
        twin["hit_rate"] = _num(rule.get("hit_rate"))
        live: dict[str, float | None] = {}
        spans: dict[str, tuple[float, float] | None] = {}
        for m in (*METRICS, "cache_hit_rate"):
            vals = _values(runs, load, variant, m) if variant else []
            live[m] = statistics.median(vals) if vals else None
            spans[m] = (min(vals), max(vals)) if vals else None
        ratio = {m: _ratio(twin[m], live[m]) for m in METRICS}
        judged = [r for r in ratio.values() if r is not None]
        within = all(abs(r - 1) <= tolerance for r in judged) if judged else None
        p50 = ratio["ttft_p50_ms"]
        span, mine = spans["ttft_p50_ms"], twin["ttft_p50_ms"]
        in_spread = meet = None
        seeds = [v for x in rule.get("ttft_p50_ms_seeds") or () if (v := _num(x)) is not None]
        mine_span = (min(seeds), max(seeds)) if seeds else None
        if span is not None and mine is not None:
            in_spread = _meets((mine, mine), span, tolerance)
        if span is not None and mine_span is not None:
            meet = _meets(mine_span, span, tolerance)
        rows.append(
            RuleRow(
                name=str(rule.get("name")),
                variant=variant,
                twin=twin,
                live=live,
                live_range=spans,
                ratio=ratio,
                within=within,
                p50_within=None if p50 is None else abs(p50 - 1) <= tolerance,
                p50_in_spread=in_spread,
                twin_range=mine_span,
                ranges_meet=meet,
            )
        )

    best = tune.get("best") or {}
    recommended = str(best["name"]) if best.get("name") is not None else None
    picks: list[Pick] = []
    matched = {r.variant for r in rows if r.variant is not None}
    rec_variant = next((r.variant for r in rows if r.name == recommended), None)
    for m in METRICS:
        medians = {
            v: statistics.median(vals) for v in matched if (vals := _values(runs, load, v, m))
        }
        if recommended is None or not medians:
            continue
        top = min(medians, key=lambda v: medians[v])
        if rec_variant is None or rec_variant not in medians:
            picks.append(Pick(m, recommended, None, top, medians[top], None, 0.0, "not run live"))
            continue
        mine, theirs = medians[rec_variant], medians[top]
        floor, verdict = _verdict(
            _values(runs, load, rec_variant, m),
            _values(runs, load, top, m),
            noise_floor(runs, load, m, fallback=(rec_variant, top)),
            best_tolerance,
        )
        picks.append(Pick(m, recommended, mine, top, theirs, _ratio(mine, theirs), floor, verdict))

    running = tune.get("running")
    running = str(running) if running is not None else None
    twin_running = next((r for r in rows if r.name == running), None)
    by_objective = None
    if recommended is not None:
        by_objective = _judge_objective(
            runs, load, recommended, rec_variant, twin_running.variant if twin_running else None,
            sorted(matched), best_tolerance,
        )  # fmt: skip
    captured = captured_ttft(capture)
    replay: dict[str, Any] = {"captured": captured}
    if twin_running is not None:
        replay["twin"] = {m: twin_running.twin[m] for m in METRICS}
        replay["ratio"] = {m: _ratio(twin_running.twin[m], captured[m]) for m in METRICS}
        judged = [r for r in replay["ratio"].values() if r is not None]
        replay["within"] = all(abs(r - 1) <= tolerance for r in judged) if judged else None
    return Proof(
        scenario=str(result.get("scenario", "")),
        load=load,
        reps=max((int(r.get("rep", 0)) + 1 for r in runs), default=0),
        tolerance=tolerance,
        rules=rows,
        recommended=recommended,
        beyond_noise=best.get("beyond_noise")
        if isinstance(best.get("beyond_noise"), bool)
        else None,
        picks=picks,
        running=running,
        replay=replay,
        fidelity=tune.get("fidelity"),
        objective=by_objective,
    )


def _meets(a: tuple[float, float], b: tuple[float, float], tolerance: float) -> bool:
    """Whether range `a` meets range `b` widened by `tolerance` (from its lowest less the
    share to its highest plus it)."""
    return a[0] <= b[1] * (1 + tolerance) and a[1] >= b[0] * (1 - tolerance)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _r(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _span(v: tuple[float, float] | None) -> str:
    return "" if v is None else f" ({v[0]:.0f}-{v[1]:.0f})"


def markdown(proof: Proof) -> str:
    """The per-rule table, then a line for the recommendation and one for the replay."""
    pct = f"{proof.tolerance:.0%}"
    lines = [
        f"**{proof.scenario} / {proof.load}**: twin against live ({proof.reps} repetitions, "
        f"median and range)",
        "",
        f"| rule | twin p50 ms | live p50 ms | ratio | twin p90 ms | live p90 ms | ratio | "
        f"within {pct} | twin hit | live hit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in proof.rules:
        within = "-" if r.within is None else ("yes" if r.within else "no")
        lines.append(
            f"| {r.name} | {_ms(r.twin['ttft_p50_ms'])}{_span(r.twin_range)} "
            f"| {_ms(r.live['ttft_p50_ms'])}"
            f"{_span(r.live_range['ttft_p50_ms'])} | {_r(r.ratio['ttft_p50_ms'])} "
            f"| {_ms(r.twin['ttft_p90_ms'])} | {_ms(r.live['ttft_p90_ms'])}"
            f"{_span(r.live_range['ttft_p90_ms'])} | {_r(r.ratio['ttft_p90_ms'])} | {within} "
            f"| {_r(r.twin['hit_rate'])} | {_r(r.live['cache_hit_rate'])} |"
        )
    n, total = proof.rules_within
    n50, total50 = proof.rules_within_p50
    spread, judged = proof.rules_in_spread_p50
    meet, compared = proof.rules_ranges_meet
    lines += [
        "",
        f"- rules within {pct}: {n} of {total} at p50 and p90, {n50} of {total50} at p50; "
        f"{spread} of {judged} at p50 within {pct} of the live repetitions' range; "
        f"the twin's seeds' p50 range meets the live runs' (within {pct}) for {meet} of "
        f"{compared}",
    ]
    if proof.beyond_noise is False and proof.recommended != proof.running:
        lines.append(
            f"- the twin's best `{proof.recommended}` is within its seeds' spread of "
            f"`{proof.running}`: it says keep the running rule"
        )
    for p in proof.picks:
        lines.append(
            f"- {p.metric}: the twin recommends `{p.recommended}`, live {_ms(p.recommended_live)} ms;"
            f" live best `{p.best}` {_ms(p.best_live)} ms (ratio {_r(p.ratio)}, noise "
            f"{p.noise_ms:.0f} ms): {p.verdict}"
        )
    if (o := proof.objective) is not None:
        mine = "-" if o.recommended_live is None else f"{o.recommended_live:.2f}"
        lines.append(
            f"- by the twin's objective (the mean of p50 and p90, each against the running "
            f"rule's live median): `{o.recommended}` live {mine}; live best `{o.best}` "
            f"{o.best_live:.2f} (ratio {_r(o.ratio)}, spread {o.noise_ms:.2f}): {o.verdict}"
        )
    rp = proof.replay
    cap = rp["captured"]
    if "twin" in rp:
        within = {True: "yes", False: "no", None: "-"}[rp["within"]]
        lines.append(
            f"- replay of `{proof.running}` against the capture ({cap['with_ttft']:.0f} TTFTs): "
            f"p50 {_ms(rp['twin']['ttft_p50_ms'])} / {_ms(cap['ttft_p50_ms'])} ms "
            f"({_r(rp['ratio']['ttft_p50_ms'])}), p90 {_ms(rp['twin']['ttft_p90_ms'])} / "
            f"{_ms(cap['ttft_p90_ms'])} ms ({_r(rp['ratio']['ttft_p90_ms'])}), within {pct}: "
            f"{within}"
        )
    else:
        lines.append(f"- replay: the twin has no rule `{proof.running}` (the capture's)")
    return "\n".join(lines) + "\n"


# -- the three steps ---------------------------------------------------------------------------


def rules_for(scenario: str, rules: Sequence[str] | None) -> list[str]:
    """The rules to run: those given, else the defaults (and the scenario's extras), kept to
    the scenario's variants."""
    sc = load_scenario(SCENARIOS / f"{scenario}.yaml")
    have = {v.name for v in sc.variants}
    wanted = list(rules) if rules else [*DEFAULT_RULES, *EXTRA_RULES.get(scenario, ())]
    missing = [r for r in wanted if r not in have]
    if missing:
        log.warning("%s has no variants %s: left out", scenario, missing)
    return [r for r in wanted if r in have]


def run_live(
    scenario: str, rules: Sequence[str], *, repetitions: int, results: Path, quick: bool
) -> float:
    """(a): the scenario over the rules, kv-aware captured; its wall time (s)."""
    cmd = [
        str(PYTHON), "-m", "bench", "run", scenario, "--variants", ",".join(rules),
        "--repetitions", str(repetitions), "--capture", CAPTURED, "--results", str(results),
        "--no-docs", *(["--quick"] if quick else []),
    ]  # fmt: skip
    log.info("live: %s", " ".join(cmd))
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, cwd=ROOT)
    return round(time.monotonic() - t0, 1)


def add_repetitions(result: Mapping[str, Any], more: Mapping[str, Any]) -> dict[str, Any]:
    """`result` (a `bench run`'s result.json) with `more`'s runs (another run of the same
    scenario, without a capture) appended as its next repetitions, the per-variant medians
    recomputed: the live matrix the twin is judged against grows (issue 37 asks for three
    repetitions) while the capture the twin was tuned on stays. Pure."""
    runs = [dict(r) for r in result["runs"]]
    base = max((int(r["rep"]) + 1 for r in runs), default=0)
    runs += [{**r, "rep": base + int(r["rep"])} for r in more["runs"]]
    return _merged(result, runs, more)


def replace_runs(
    result: Mapping[str, Any], more: Mapping[str, Any], only: Collection[str] | None = None
) -> dict[str, Any]:
    """`result` with the runs of every variant `more` ran (of `only`, when given: the others
    ran beside them and are not kept) replaced by `more`'s, the medians recomputed: a rule
    changed since the live matrix was run is run again, the other rules' runs and the capture
    the twin is tuned on stay. Pure."""
    again = {str(r["variant"]) for r in more["runs"]}
    if only is not None:
        again &= set(only)
    runs = [dict(r) for r in result["runs"] if str(r["variant"]) not in again]
    runs += [dict(r) for r in more["runs"] if str(r["variant"]) in again]
    rerun = {**result.get("rerun", {}), **{v: more.get("started_unix") for v in sorted(again)}}
    return {**_merged(result, runs, more), "rerun": rerun}


def _merged(
    result: Mapping[str, Any], runs: list[dict[str, Any]], more: Mapping[str, Any]
) -> dict[str, Any]:
    sc = load_scenario(SCENARIOS / f"{result['scenario']}.yaml")
    ran = {str(r["variant"]) for r in runs}
    sc = dataclasses.replace(sc, variants=tuple(v for v in sc.variants if v.name in ran))
    started = [*result.get("merged_from", [result.get("started_unix")]), more.get("started_unix")]
    return {**result, "summary": aggregate(sc, runs), "runs": runs, "merged_from": started}


def run_more(
    scenario: str,
    rules: Sequence[str],
    *,
    repetitions: int,
    into: Path,
    replace: bool = False,
    beside: Sequence[str] = (),
) -> float:
    """`repetitions` more live runs of the rules (no capture), appended to into/result.json
    (`add_repetitions`), or in place of those rules' runs there (`replace`: `replace_runs`);
    `beside`: rules run in the same repetitions whose runs are not kept; their wall time (s)."""
    with tempfile.TemporaryDirectory(prefix="twin-proof-more-") as tmp:
        ran = [*beside, *(r for r in rules if r not in beside)]
        cmd = [
            str(PYTHON), "-m", "bench", "run", scenario, "--variants", ",".join(ran),
            "--repetitions", str(repetitions), "--results", tmp, "--no-docs",
        ]  # fmt: skip
        log.info("live, %d more: %s", repetitions, " ".join(cmd))
        t0 = time.monotonic()
        subprocess.run(cmd, check=True, cwd=ROOT)
        more = json.loads((Path(tmp) / scenario / "result.json").read_text())
    path = into / "result.json"
    old = json.loads(path.read_text())
    merged = replace_runs(old, more, rules) if replace else add_repetitions(old, more)
    path.write_text(json.dumps(merged, indent=1, default=str) + "\n")
    return round(time.monotonic() - t0, 1)


def tune_available() -> bool:
    done = subprocess.run(
        [str(PYTHON), "-m", "extproc", "tune", "--help"],
        capture_output=True,
        cwd=ROOT,
        check=False,
    )
    return done.returncode == 0


def run_tune(
    capture: Path,
    out: Path,
    rules: Sequence[str] | None,
    *,
    seeds: int | None,
    timeout_s: float = TUNE_TIMEOUT_S,
) -> tuple[list[str], float]:
    """(b): `extproc tune` on the capture (None: the twin's own candidates); its command and
    wall time (s)."""
    # The gateway's config the capture ran under (flow control, polling), as an operator
    # passes theirs; a capture from before the bench kept it replays under the defaults.
    config = capture.with_name(config_of_capture(capture.name))
    cmd = [
        str(PYTHON), "-m", "extproc", "tune", str(capture), "--json", str(out),
        *(["--config", str(config)] if config.exists() else []),
        *(["--rules", ",".join(rules)] if rules else []),
        *(["--seeds", str(seeds)] if seeds else []),
    ]  # fmt: skip
    log.info("twin: %s", " ".join(cmd))
    t0 = time.monotonic()
    # Its own process group: on a timeout its worker processes go with it.
    with subprocess.Popen(cmd, cwd=ROOT, start_new_session=True) as proc:
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    if code != 0:
        raise subprocess.CalledProcessError(code, cmd)
    return cmd, round(time.monotonic() - t0, 1)


def read_capture(path: Path) -> list[dict[str, Any]]:
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


def capture_in(out_dir: Path, rep: int) -> Path:
    """The capture of `rep` in a scenario's results, as `bench run` wrote it or gzipped."""
    plain = out_dir / f"capture-{CAPTURED}-rep{rep}.jsonl"
    packed = plain.with_name(plain.name + ".gz")
    return packed if not plain.exists() and packed.exists() else plain


def pooled_tune(proofs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Several captures' twins of one scenario (one capture per repetition, each a draw of
    the workload, as each live repetition is) as one tuning for `prove`: per rule, the median
    of the captures' twin figures and its seeds' range over all of them; the pick, the rule
    the twin's own score (`score`: p50 and p90 against the running rule's) puts lowest. Set
    beside the live repetitions' medians it compares like with like, where one capture's twin
    is one draw against three. Built from each capture's proof (`twin-proof-*.json`)."""
    if not proofs:
        raise ValueError("no proof to pool")
    running = proofs[0].get("running")
    rules: list[dict[str, Any]] = []
    for first in proofs[0]["rules"]:
        same = [r for p in proofs for r in p["rules"] if r["name"] == first["name"]]
        rule: dict[str, Any] = {"name": first["name"], "strategy": first.get("variant")}
        for m in (*METRICS, "hit_rate"):
            vals = [v for r in same if (v := _num(r["twin"].get(m))) is not None]
            rule[m] = statistics.median(vals) if vals else None
        ends = [v for r in same for v in r.get("twin_range") or () if v is not None]
        rule["ttft_p50_ms_seeds"] = [min(ends), max(ends)] if ends else []
        rules.append(rule)
    cur = next((r for r in rules if r["name"] == running), None)

    def scored(r: Mapping[str, Any]) -> float:
        if cur is None or any(r[m] is None or cur[m] is None for m in METRICS):
            return math.inf
        return score((r[METRICS[0]], r[METRICS[1]]), (cur[METRICS[0]], cur[METRICS[1]]))

    best = min(rules, key=scored) if rules else None
    return {
        "running": running,
        "rules": rules,
        "best": {"name": best["name"]} if best is not None else {},
        "fidelity": None,
    }


def proof_path(data: Path, scenario: str, rep: int) -> Path:
    """Where the proof of `rep`'s capture goes: one file a capture tuned, the first
    repetition's under the name it always had."""
    return data / f"twin-proof-{scenario}{f'-rep{rep}' if rep else ''}.json"


def keep_inputs(scenario: str, out_dir: Path, capture: Path, dest: Path) -> Path | None:
    """What the tuning and the proof read (result.json, the capture gzipped, the config it
    ran under) copied to dest/SCENARIO, so that `--skip-live dest` gives the same figures on
    a fresh clone; None for a scenario that replays a trace from elsewhere
    (bench/data/external/: data fetched from other repositories is not committed here)."""
    if "data/external/" in (ROOT / "bench" / "scenarios" / f"{scenario}.yaml").read_text():
        return None
    into = dest / out_dir.name
    into.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(out_dir / "result.json", into / "result.json")
    config = capture.with_name(config_of_capture(capture.name))
    if config.exists():
        shutil.copyfile(config, into / config.name)
    packed = into / (capture.name.removesuffix(".gz") + ".gz")
    data = capture.read_bytes()
    packed.write_bytes(data if capture.suffix == ".gz" else gzip.compress(data, mtime=0))
    return into


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.twin_proof", description=__doc__.split("\n")[0]
    )
    p.add_argument("scenarios", nargs="+", help="scenario names (bench/scenarios/NAME.yaml)")
    p.add_argument("--rules", default=None, help="comma-separated rules (variants) to compare")
    p.add_argument("--repetitions", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="the scenarios' quick sizes")
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "twin-proof")
    p.add_argument(
        "--skip-live",
        type=Path,
        default=None,
        metavar="RESULTS_DIR",
        help="no live run: (b) and (c) from an earlier one's RESULTS_DIR/SCENARIO/",
    )
    p.add_argument("--seeds", type=int, default=None, help="passed to extproc tune")
    p.add_argument(
        "--all-candidates",
        action="store_true",
        help="let the twin choose among all its candidates, not only the rules run live",
    )
    p.add_argument(
        "--rep",
        type=int,
        default=0,
        help="the repetition whose capture is tuned (its proof: twin-proof-SCENARIO-repN.json "
        "where N > 0)",
    )
    p.add_argument(
        "--pool",
        default=None,
        metavar="REPS",
        help="with --skip-live: no tuning; judge the twin over these repetitions' captures "
        "(comma-separated; each tuned before, its twin-proof-SCENARIO[-repN].json in --data) "
        "against the live repetitions: twin-proof-SCENARIO-pooled.json",
    )
    p.add_argument("--tolerance", type=float, default=TOLERANCE)
    p.add_argument("--tune-timeout", type=float, default=TUNE_TIMEOUT_S, help="s per extproc tune")
    p.add_argument("--data", type=Path, default=ROOT / "bench" / "data")
    p.add_argument(
        "--keep",
        type=Path,
        default=ROOT / "bench" / "data" / "twin-captures",
        help="after a live run, copy what the tuning reads here (result.json, the capture "
        "gzipped, its config), so that --skip-live on it gives the same figures anywhere",
    )
    p.add_argument("--no-keep", dest="keep", action="store_const", const=None)
    p.add_argument(
        "--add-repetitions",
        type=int,
        default=0,
        metavar="N",
        help="with --skip-live: run the rules live N more times (no capture) and append them "
        "to RESULTS_DIR/SCENARIO/result.json before judging (the capture tuned stays)",
    )
    p.add_argument(
        "--rerun",
        default=None,
        metavar="RULES",
        help="with --skip-live: run these rules (comma-separated) live --repetitions times "
        "(no capture) in place of their runs in RESULTS_DIR/SCENARIO/result.json (a rule "
        "changed since; the other rules' runs and the capture tuned stay)",
    )
    p.add_argument(
        "--beside",
        default=None,
        metavar="RULES",
        help="with --rerun: run these rules too, in the same repetitions, without keeping "
        "their runs (predicted-latency learns from every rule's requests on the stack's "
        "server: beside kv-aware it starts warm, as in the matrix and as the twin starts it)",
    )
    args = p.parse_args(argv)
    if args.beside and not args.rerun:
        p.error("--beside goes with --rerun")
    if (args.add_repetitions or args.rerun) and args.quick:
        p.error("--add-repetitions and --rerun run the scenarios' full sizes: not with --quick")
    if args.rerun and (args.skip_live is None or args.add_repetitions):
        p.error(
            "--rerun replaces runs of an earlier run: give its --skip-live RESULTS_DIR "
            "(and not --add-repetitions)"
        )
    if args.pool and (args.skip_live is None or args.rerun or args.add_repetitions):
        p.error("--pool judges earlier tunings: give --skip-live RESULTS_DIR, nothing to run")
    if args.add_repetitions and args.skip_live is None:
        p.error("--add-repetitions appends to an earlier run: give its --skip-live RESULTS_DIR")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    results = args.skip_live or args.results
    given = args.rules.split(",") if args.rules else None
    has_tune: bool | None = None
    failed = 0
    for scenario in args.scenarios:
        rules = rules_for(scenario, given)
        name = scenario + ("-quick" if args.quick else "")
        out_dir = results / name
        live_s = None
        if args.skip_live is None:
            live_s = run_live(
                scenario, rules, repetitions=args.repetitions, results=results, quick=args.quick
            )
            log.info("%s live: %.0f s -> %s", name, live_s, out_dir)
        elif args.rerun:
            again = [r for r in args.rerun.split(",") if r in rules]
            live_s = run_more(
                scenario, again, repetitions=args.repetitions, into=out_dir, replace=True,
                beside=args.beside.split(",") if args.beside else (),
            )  # fmt: skip
            log.info("%s live, %s again: %.0f s -> %s", name, ",".join(again), live_s, out_dir)
        elif args.add_repetitions:
            live_s = run_more(scenario, rules, repetitions=args.add_repetitions, into=out_dir)
            log.info("%s live, %d more: %.0f s -> %s", name, args.add_repetitions, live_s, out_dir)
        if args.pool:
            reps = [int(r) for r in args.pool.split(",")]
            proofs = [json.loads(proof_path(args.data, name, r).read_text()) for r in reps]
            result = json.loads((out_dir / "result.json").read_text())
            lines = [line for r in reps for line in read_capture(capture_in(out_dir, r))]
            proof = prove(pooled_tune(proofs), result, lines, tolerance=args.tolerance)
            print(markdown(proof))
            path = args.data / f"twin-proof-{name}-pooled.json"
            pooled = {"scenario": name, "results": str(out_dir), "pooled_reps": reps}
            path.write_text(json.dumps({**pooled, **proof.as_dict()}, indent=1, default=str) + "\n")
            log.info("%s -> %s", name, path)
            continue
        if has_tune is None:
            has_tune = tune_available()
        if not has_tune:
            print(
                f"`extproc tune` does not exist in this checkout: stopping after the live run "
                f"({out_dir}: result.json, capture-{CAPTURED}-repN.jsonl)"
            )
            continue
        capture = capture_in(out_dir, args.rep)
        if args.skip_live is None and args.keep is not None:
            kept = keep_inputs(scenario, out_dir, capture, args.keep)
            log.info("%s: inputs kept in %s", name, kept or "(not: a trace from elsewhere)")
        tune_out = out_dir / f"tune-{CAPTURED}-rep{args.rep}.json"
        try:
            cmd, tune_s = run_tune(
                capture,
                tune_out,
                None if args.all_candidates else rules,
                seeds=args.seeds,
                timeout_s=args.tune_timeout,
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
            log.error("%s: extproc tune failed: %s", name, err)
            failed += 1
            continue
        result = json.loads((out_dir / "result.json").read_text())
        tuned = json.loads(tune_out.read_text())
        proof = prove(
            tuned,
            result,
            read_capture(capture),
            tolerance=args.tolerance,
        )
        print(markdown(proof))
        args.data.mkdir(parents=True, exist_ok=True)
        out = {
            "scenario": name,
            "results": str(out_dir),
            "capture": str(capture),
            "tune": str(tune_out),
            "tune_command": cmd,
            "tune_wall_s": tune_s,
            "live_wall_s": live_s,
            "rules_run": rules,
            "twin_best": tuned.get("best"),
            "twin_captured": tuned.get("captured"),  # the twin's reading of the capture
            **proof.as_dict(),
        }
        path = proof_path(args.data, name, args.rep)
        path.write_text(json.dumps(out, indent=1, default=str) + "\n")
        log.info("%s -> %s", name, path)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
