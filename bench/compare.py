"""Side-by-side verdicts from scenario results: each of our rules against one peer, with the noise floor.

    .venv/bin/python -m bench compare bench/results/multiturn/result.json ... \
        [--against vllm-router-cache_aware] [--metrics ttft_p50_ms,ttft_p90_ms]

A difference counts only when it is larger than the noise floor of its scenario and metric:
the widest spread (max - min over repetitions) among the variants that route like round robin
(`envoy-rr`, `round-robin`, `vllm-router-rr`), whose differences are noise by construction; or,
if none of them ran twice, the wider spread of the two variants compared. A verdict is `win`
(ours lower by more than the floor), `loss` (higher by more) or `level`; one repetition gives
no floor and so no verdict. Latency metrics only:
lower is better. Pure functions over the result dicts `bench.scenario.run_scenario` writes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["NOISE_VARIANTS", "Verdict", "main", "markdown", "noise_floor", "verdicts"]

NOISE_VARIANTS = ("envoy-rr", "round-robin", "vllm-router-rr")
PEER_PREFIX = "vllm-router-"
DEFAULT_METRICS = ("ttft_p50_ms", "ttft_p90_ms")


@dataclass(frozen=True, slots=True)
class Verdict:
    scenario: str
    load: str
    metric: str
    variant: str
    ours: float  # median over repetitions
    ours_range: tuple[float, float]
    theirs: float
    theirs_range: tuple[float, float]
    noise: float
    reps: int

    @property
    def ratio(self) -> float:
        return self.ours / self.theirs if self.theirs else float("inf")

    @property
    def outcome(self) -> str:
        if self.reps < 2:
            return "no verdict (1 repetition: no noise floor)"
        diff = self.ours - self.theirs
        if diff < -self.noise:
            return "win"
        if diff > self.noise:
            return "loss"
        return "level"


def _values(runs: Sequence[Mapping[str, Any]], load: str, variant: str, metric: str) -> list[float]:
    return [
        float(r[metric])
        for r in runs
        if r.get("load") == load and r.get("variant") == variant and r.get(metric) is not None
    ]


def _spread(values: Sequence[float]) -> float:
    return max(values) - min(values) if len(values) > 1 else 0.0


def noise_floor(
    runs: Sequence[Mapping[str, Any]], load: str, metric: str, fallback: Sequence[str] = ()
) -> float:
    """The widest repetition spread among the round-robin-like variants (else among `fallback`)."""
    spreads = [
        _spread(v) for name in NOISE_VARIANTS if len(v := _values(runs, load, name, metric)) > 1
    ]
    if not spreads:
        spreads = [_spread(_values(runs, load, name, metric)) for name in fallback]
    return max(spreads, default=0.0)


def verdicts(
    result: Mapping[str, Any], *, against: str, metrics: Sequence[str] = DEFAULT_METRICS
) -> list[Verdict]:
    """One verdict per (load, metric, our variant) of one scenario result."""
    runs: list[Mapping[str, Any]] = result["runs"]
    names = list(dict.fromkeys(r["variant"] for r in runs))
    ours = [n for n in names if n not in NOISE_VARIANTS and not n.startswith(PEER_PREFIX)]
    out = []
    for load in dict.fromkeys(r["load"] for r in runs):
        for metric in metrics:
            theirs = _values(runs, load, against, metric)
            if not theirs:
                continue
            for name in ours:
                mine = _values(runs, load, name, metric)
                if not mine:
                    continue
                out.append(
                    Verdict(
                        scenario=str(result["scenario"]),
                        load=str(load),
                        metric=metric,
                        variant=name,
                        ours=statistics.median(mine),
                        ours_range=(min(mine), max(mine)),
                        theirs=statistics.median(theirs),
                        theirs_range=(min(theirs), max(theirs)),
                        noise=noise_floor(runs, load, metric, fallback=(name, against)),
                        reps=min(len(mine), len(theirs)),
                    )
                )
    return out


def _range(lo_hi: tuple[float, float]) -> str:
    return f"{lo_hi[0]:.0f}-{lo_hi[1]:.0f}"


def markdown(found: Sequence[Verdict], *, against: str) -> str:
    """A table of verdicts, then a line per scenario and metric naming our best variant."""
    lines = [
        f"| scenario | metric | variant | ours ms (range) | {against} ms (range) | ratio | noise ms | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v in found:
        lines.append(
            f"| {v.scenario}/{v.load} | {v.metric} | {v.variant} | {v.ours:.0f} ({_range(v.ours_range)}) "
            f"| {v.theirs:.0f} ({_range(v.theirs_range)}) | {v.ratio:.2f} | {v.noise:.0f} "
            f"| {v.outcome} |"
        )
    lines.append("")
    best: dict[tuple[str, str, str], Verdict] = {}
    for v in found:
        key = (v.scenario, v.load, v.metric)
        if key not in best or v.ours < best[key].ours:
            best[key] = v
    for (scenario, load, metric), v in best.items():
        lines.append(
            f"- {scenario}/{load} {metric}: best of ours `{v.variant}` {v.ours:.0f} ms against "
            f"{v.theirs:.0f} ms ({v.ratio:.2f}x, noise {v.noise:.0f} ms, {v.reps} reps): {v.outcome}"
        )
    return "\n".join(lines) + "\n"


def default_table(
    results: Sequence[Mapping[str, Any]], *, default: str, against: str, tolerance: float = 0.05
) -> str:
    """Per scenario and load: the default rule's TTFT p50 / p90 (medians of the repetitions)
    as a ratio of our best rule's and of `against`'s, its hit rate beside the reuse ceilings,
    and whether it is within `tolerance` of our best at both percentiles and ahead of
    `against`: "yes"; where not, "within noise" when every shortfall is inside that metric's
    noise floor (`noise_floor` over the result's repetitions, falling back to the spreads of the
    default, the best and the peer) and the repetitions overlap, else "no"."""
    lines = [
        f"| scenario | `{default}` p50 / p90 ms | best of ours p50 / p90 | ratio to best | "
        f"`{against}` p50 / p90 | ratio to it | hit rate (`{default}`, `{against}`) | "
        "ceiling seen / capacity | within 5 % of best, ahead of the peer |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        rows: list[Mapping[str, Any]] = result["summary"]
        for load in dict.fromkeys(r["load"] for r in rows):
            mine = {r["variant"]: r for r in rows if r["load"] == load}
            d, peer = mine.get(default), mine.get(against)
            ours = {
                n: r
                for n, r in mine.items()
                if n not in NOISE_VARIANTS and not n.startswith(PEER_PREFIX) and n != "random"
            }
            if d is None or not ours:
                continue
            cells, ok = [], True
            best: list[str] = []
            ratios: list[str] = []
            short: dict[str, float] = {}  # how far past each target, ms (<= 0: met)
            floors: dict[str, float] = {}
            runs: list[Mapping[str, Any]] = result.get("runs", [])
            for k in DEFAULT_METRICS:
                b = min(ours, key=lambda n: ours[n].get(k) or float("inf"))
                best.append(f"{ours[b][k]:.0f} (`{b}`)")
                ratio = d[k] / ours[b][k]
                ratios.append(f"{ratio:.2f}")
                ok = ok and ratio <= 1 + tolerance
                short[k] = d[k] - (1 + tolerance) * ours[b][k]
                if peer is not None:
                    short[k] = max(short[k], d[k] - peer[k])
                floors[k] = noise_floor(runs, load, k, fallback=(default, b, against))
                # Noise needs the repetitions to overlap: the default's best one at most the
                # other's worst; behind in every repetition is a loss, whatever the spread.
                mine_k = _values(runs, load, default, k)
                for other in (b, against):
                    theirs_k = _values(runs, load, other, k)
                    if mine_k and theirs_k and min(mine_k) > max(theirs_k):
                        floors[k] = 0.0
            cells.append(" / ".join(f"{d[k]:.0f}" for k in DEFAULT_METRICS))
            cells.append(" / ".join(best))
            cells.append(" / ".join(ratios))
            if peer is not None:
                cells.append(" / ".join(f"{peer[k]:.0f}" for k in DEFAULT_METRICS))
                cells.append(" / ".join(f"{d[k] / peer[k]:.2f}" for k in DEFAULT_METRICS))
                ok = ok and all(d[k] <= peer[k] for k in DEFAULT_METRICS)
            else:
                cells += ["-", "-"]

            def num(r: Mapping[str, Any] | None, k: str) -> str:
                return f"{r[k]:.2f}" if r is not None and r.get(k) is not None else "-"

            cells.append(f"{num(d, 'cache_hit_rate')}, {num(peer, 'cache_hit_rate')}")
            cells.append(f"{num(d, 'ceiling_seen')} / {num(d, 'ceiling_capacity')}")
            if ok:
                cells.append("yes")
            elif all(short[k] <= floors[k] for k in DEFAULT_METRICS) and any(floors.values()):
                floor = " / ".join(f"{floors[k]:.0f}" for k in DEFAULT_METRICS)
                cells.append(f"within noise (floor {floor} ms)")
            else:
                cells.append("no")
            lines.append(f"| {result['scenario']}/{load} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench compare", description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="result.json files of `bench run`")
    p.add_argument("--against", default="vllm-router-cache_aware")
    p.add_argument("--metrics", default=",".join(DEFAULT_METRICS))
    p.add_argument(
        "--default",
        default=None,
        help="also print this rule against our best rule and the peer, with the ceilings",
    )
    args = p.parse_args(argv)
    found: list[Verdict] = []
    results = []
    for path in args.results:
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            print(f"{path}: {err}", file=sys.stderr)
            return 2
        results.append(result)
        found.extend(verdicts(result, against=args.against, metrics=args.metrics.split(",")))
    if args.default:
        print(default_table(results, default=args.default, against=args.against))
    if not found:
        print(f"no run of {args.against} to compare against", file=sys.stderr)
        return 2
    print(markdown(found, against=args.against))
    return 0


if __name__ == "__main__":
    sys.exit(main())
