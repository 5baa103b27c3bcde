"""`extproc tune CAPTURE`: which rule, with which weights, the captured traffic runs best under.

1. Fit each pod's engine to the capture (`fit.py`).
2. Fidelity: replay the capture under the rule that ran and compare with what the capture
   measured (TTFT p50 / p90, prefix hit rate). Every replay's gateway starts with the running
   gateway's latency models, as a switch to `predicted-latency` would: those the capture
   carries (where they stood when it was taken), else those a replay under the running rule
   learned (`learned_latency`).
3. Replay it under every candidate (the built-in rules and a small search over kv-aware's
   weights), with several seeds (the routing's random draws and a jitter of the arrivals:
   the spread a live rerun would show), on `workers` processes. A rule whose seeds disagree
   (`unsettled`: a rule that learns online, a cache on the edge of a cliff) is replayed with
   more seeds, up to `max_seeds`, so its median is not the luck of three draws.
4. The table, the best rule, its margin over the running rule against the seeds' spread, and
   the config to apply.

Every replay runs in virtual time (`vtime.py`), so the results depend on the capture and the
seeds only, never on the machine.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import multiprocessing
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from extproc.accounting.latency_model import LearnedModels
from extproc.twin.fit import JITTER_GRID, FitReport, fit_pods, pods_of
from extproc.twin.replay import PodProfile, Served, TwinSetup, learned_latency, replay
from extproc.twin.trace import PromptIds, TwinRequest

__all__ = [
    "Candidate",
    "RuleResult",
    "Stats",
    "TuneReport",
    "candidates",
    "reuse_ceiling",
    "score",
    "stats_of",
    "tune",
    "unsettled",
]

DEFAULT_RULE = "kv-aware"
_A = TypeVar("_A")
_R = TypeVar("_R")
# Arrivals move by at least this much per seed (a live rerun never repeats the exact
# timings), more where the fit says (`fit_jitter`: a closed loop's clients desynchronized as
# live): about one decode step, so that a closed-loop client's next request, sent as its last
# answer ended (at a step's end), reaches its engine at a random point of the step under way,
# as a host's and a network's noise places it live. With 2 ms (until 2026-12-07) it came at
# the same point every time and a saving before the engine shorter than the step's rest
# vanished into the wait for the next (higress: session-affinity's skipped tokenizing, 3.7 ms,
# moved the twin's TTFT p50 by 0.2 ms; 10 ms of jitter: 2 ms, 15 ms: 3 ms).
JITTER_S = JITTER_GRID[0]
# A rule's seeds agree when the standard error of their mean TTFT p50 is within this share of
# their median: then a few seeds place it to a few percent; beyond, it gets more seeds.
SETTLED = 0.05


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    strategy: str
    params: Mapping[str, Any] = field(default_factory=dict)
    # Replayed with the gateway's latency models cold, as a process that has just started
    # (every other replay starts from the models the running gateway has learned): the rule
    # after a restart under this traffic. Shown, never recommended (`TuneReport.best`).
    cold: bool = False

    def apply(self) -> str:
        """The config to run it (YAML), and the route annotation when it has no parameters."""
        lines = [f"routing:\n  default_strategy: {self.strategy}"]
        if self.params:
            lines.append(f"  strategy_params:\n    {self.strategy}:")
            lines += [f"      {k}: {v}" for k, v in self.params.items()]
        text = "\n".join(lines)
        if not self.params:
            text += f"\n# or per route: lb.extproc.io/strategy: {self.strategy}"
        return text


def candidates(requests: Sequence[TwinRequest]) -> list[Candidate]:
    """The built-in rules worth comparing, kv-aware's weights searched a little, and
    session-affinity when the traffic names sessions."""
    out = [
        Candidate("kv-aware", "kv-aware"),
        Candidate("kv-aware overlap 0.5", "kv-aware", {"overlap_weight": 0.5}),
        Candidate("kv-aware overlap 2", "kv-aware", {"overlap_weight": 2.0}),
        Candidate("kv-aware-dynamo", "kv-aware-dynamo"),
        Candidate("prefix-cache", "prefix-cache"),
        Candidate("predicted-latency", "predicted-latency"),
        # Its models learn online: after a restart it starts cold and, on a load rising past
        # the pods' capacity, may fit the wrong turn (the bench's kvwins: 10 of 16 seeds cold
        # against 0 of 12 warm; docs/strategies.md, predicted-latency).
        Candidate("predicted-latency, cold start", "predicted-latency", cold=True),
        Candidate("gaie", "gaie"),
        Candidate("least-request", "least-request"),
        Candidate("round-robin", "round-robin"),
    ]
    if any(r.session for r in requests):
        out.append(Candidate("session-affinity", "session-affinity"))
    return out


@dataclass(frozen=True, slots=True)
class Stats:
    requests: int
    errors: int  # answered by the gateway (shed) or not served
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    hit_rate: float  # cached prompt tokens / prompt tokens
    goodput_rps: float  # requests per second that met both SLOs
    spread: float  # the busiest pod's requests over the mean pod's

    def row(self) -> dict[str, float | None]:
        """JSON-ready (NaN, a figure the capture cannot give, as null)."""
        out: dict[str, float | None] = {
            "ttft_p50_ms": round(self.ttft_p50_ms, 2),
            "ttft_p90_ms": round(self.ttft_p90_ms, 2),
            "ttft_p99_ms": round(self.ttft_p99_ms, 2),
            "tpot_p50_ms": round(self.tpot_p50_ms, 3),
            "hit_rate": round(self.hit_rate, 4),
            "goodput_rps": round(self.goodput_rps, 3),
            "spread": round(self.spread, 3),
            "errors": self.errors,
        }
        return {k: None if v is not None and math.isnan(v) else v for k, v in out.items()}


def _pct(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _spread(served_by: Iterable[str | None], pods: Iterable[str]) -> float:
    """The busiest pod's requests over the mean pod's, every pod of `pods` counted (one that
    served nothing too: a rule that sends everything to one pod of two spreads it 2.0, not
    1.0)."""
    per_pod = Counter(served_by)
    for pod in pods:
        per_pod.setdefault(pod, 0)
    mean = statistics.fmean(per_pod.values()) if per_pod else 0.0
    return max(per_pod.values()) / mean if mean else 0.0


def stats_of(
    served: Sequence[Served],
    duration_s: float,
    *,
    slo_ttft_s: float,
    slo_tpot_s: float,
    pods: Iterable[str] = (),
) -> Stats:
    ok = [s for s in served if s.status == 200 and s.ttft_s is not None]
    ttft = sorted(s.ttft_s for s in ok if s.ttft_s is not None)
    tpot = sorted(s.tpot_s for s in ok if s.tpot_s is not None)
    prompt = sum(s.prompt_tokens for s in ok)
    good = sum(
        1
        for s in ok
        if s.ttft_s is not None and s.ttft_s <= slo_ttft_s and (s.tpot_s or 0.0) <= slo_tpot_s
    )
    return Stats(
        requests=len(served),
        errors=len(served) - len(ok),
        ttft_p50_ms=1e3 * _pct(ttft, 0.5),
        ttft_p90_ms=1e3 * _pct(ttft, 0.9),
        ttft_p99_ms=1e3 * _pct(ttft, 0.99),
        tpot_p50_ms=1e3 * _pct(tpot, 0.5),
        hit_rate=sum(s.cached_tokens for s in ok) / prompt if prompt else 0.0,
        goodput_rps=good / duration_s if duration_s > 0 else 0.0,
        spread=_spread((s.pod for s in ok), pods),
    )


def score(ttft_ms: tuple[float, float], running_ms: tuple[float, float]) -> float:
    """What the twin ranks rules by (lower is better): the mean of a rule's TTFT p50 and p90,
    each relative to the running rule's. bench/twin_proof.py judges a pick live by it too."""
    return 0.5 * (ttft_ms[0] / max(running_ms[0], 1e-9) + ttft_ms[1] / max(running_ms[1], 1e-9))


def captured_stats(
    requests: Sequence[TwinRequest], duration_s: float, pods: Iterable[str] = ()
) -> Stats | None:
    """What the capture itself measured (None without outcomes); `spread` over `pods`."""
    timed = [r for r in requests if r.measured]
    if not timed:
        return None
    ttft = sorted(r.ttft_s for r in timed if r.ttft_s is not None)
    tpot = sorted(r.tpot_s for r in timed if r.tpot_s is not None)
    cached = [r for r in timed if r.cached_tokens is not None]
    prompt = sum(r.input_length for r in cached)
    return Stats(
        requests=len(requests),
        errors=sum(1 for r in requests if r.status is not None and r.status >= 400),
        ttft_p50_ms=1e3 * _pct(ttft, 0.5),
        ttft_p90_ms=1e3 * _pct(ttft, 0.9),
        ttft_p99_ms=1e3 * _pct(ttft, 0.99),
        tpot_p50_ms=1e3 * _pct(tpot, 0.5),
        hit_rate=sum(r.cached_tokens or 0 for r in cached) / prompt if prompt else math.nan,
        goodput_rps=math.nan,
        spread=_spread((r.pod for r in timed), pods),
    )


def reuse_ceiling(requests: Sequence[TwinRequest]) -> float:
    """The share of prompt tokens an infinite cache shared by every pod would serve: each
    prompt's longest run of leading windows an earlier prompt had (at the capture's
    granularity, as the twin sees it), or, for a continuation, the earlier prompt and answer
    it resends."""
    seen: set[int] = set()
    total = hit = 0
    for r in requests:
        total += r.input_length
        left = r.input_length
        matching = True
        before = hit
        key = hash(r.unit)
        for h in r.hash_ids:
            key = hash((key, h))  # the prefix so far (a 64-bit hash: collisions negligible)
            size = min(r.unit, left)
            if matching and key in seen:
                hit += size
            else:
                matching = False
                seen.add(key)
            left -= r.unit
        if r.parent is not None:  # the earlier prompt and its answer: seen, so cacheable
            hit += max(0, r.continues - (hit - before))
    return hit / total if total else 0.0


@dataclass
class RuleResult:
    candidate: Candidate
    seeds: list[Stats]

    def median(self, key: str) -> float:
        return float(statistics.median(float(getattr(s, key)) for s in self.seeds))

    def spread(self, key: str) -> float:
        values = [float(getattr(s, key)) for s in self.seeds]
        return max(values) - min(values)


@dataclass
class TuneReport:
    requests: int
    duration_s: float
    running: str  # the rule that ran in the capture
    fit: FitReport
    captured: Stats | None
    fidelity: Stats | None  # the twin's replay under the running rule (first seed)
    ceiling: float
    results: list[RuleResult]
    seeds: int  # per rule; a rule whose seeds disagreed has more (`unsettled`)
    # Where every replay's latency models started: "capture" (the gateway's, as the capture
    # carries them), "replay" (learned by replaying the capture under the running rule).
    models_from: str = "replay"

    def best(self) -> RuleResult:
        """The rule to run: the lowest score of those that are a choice (not a cold start)."""
        return min((r for r in self.results if not r.candidate.cold), key=self._score)

    def current(self) -> RuleResult | None:
        for r in self.results:
            if r.candidate.name == self.running:
                return r
        return None

    def _score(self, r: RuleResult) -> float:
        """Mean of TTFT p50 and p90, each relative to the running rule's (lower is better);
        errors count as the worst."""
        cur = self.current() or self.results[0]
        if r.median("errors") > 0:
            return math.inf
        return score(
            (r.median("ttft_p50_ms"), r.median("ttft_p90_ms")),
            (cur.median("ttft_p50_ms"), cur.median("ttft_p90_ms")),
        )

    def verdict(self) -> dict[str, Any]:
        best, cur = self.best(), self.current()
        out: dict[str, Any] = {"name": best.candidate.name, "apply": best.candidate.apply()}
        if cur is None or cur is best:
            out["margin"] = "the running rule is the best"
            out["beyond_noise"] = False
            return out
        gains = {}
        beyond = True
        for key in ("ttft_p50_ms", "ttft_p90_ms"):
            gain = cur.median(key) - best.median(key)
            noise = max(cur.spread(key), best.spread(key))
            gains[key] = {"gain_ms": round(gain, 2), "noise_ms": round(noise, 2)}
            beyond = beyond and gain > noise
        out["margin"] = gains
        out["beyond_noise"] = beyond
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "duration_s": round(self.duration_s, 3),
            "running": self.running,
            "seeds": self.seeds,
            "reuse_ceiling": round(self.ceiling, 4),
            "models_from": self.models_from,
            "fit": {
                "rounds": self.fit.rounds,
                "jitter_ms": round(self.fit.jitter_s * 1e3, 3),
                "unfitted": self.fit.unfitted,
                "speed_only": self.fit.speed_only,
                "pods": [p.summary() for p in self.fit.pods],
                "check": self.fit.check,
            },
            "captured": self.captured.row() if self.captured else None,
            "fidelity": self.fidelity.row() if self.fidelity else None,
            "rules": [
                {
                    "name": r.candidate.name,
                    "strategy": r.candidate.strategy,
                    "params": dict(r.candidate.params),
                    **({"cold": True} if r.candidate.cold else {}),
                    **{
                        key: round(r.median(key), 3)
                        for key in (
                            "ttft_p50_ms",
                            "ttft_p90_ms",
                            "ttft_p99_ms",
                            "tpot_p50_ms",
                            "hit_rate",
                            "goodput_rps",
                            "spread",
                            "errors",
                        )
                    },
                    "ttft_p50_ms_seeds": [round(s.ttft_p50_ms, 2) for s in r.seeds],
                    "ttft_p90_ms_seeds": [round(s.ttft_p90_ms, 2) for s in r.seeds],
                }
                for r in self.results
            ],
            "best": self.verdict(),
        }

    def text(self) -> str:
        """What `extproc tune` prints: the fit, the fidelity check, the table, the verdict."""
        out = [
            f"{self.requests} requests over {self.duration_s:.0f} s; running rule: "
            f"{self.running}; reuse ceiling {self.ceiling:.3f}; {self.seeds} seeds per rule"
            + self._more_seeds(),
            "latency models (predicted-latency's) start "
            + (
                "where the gateway's stood when the capture was taken"
                if self.models_from == "capture"
                else f"from a replay under {self.running} (the capture carries none)"
            ),
            "",
            f"pods fitted in {self.fit.rounds} rounds, arrivals jittered by up to "
            f"{self.fit.jitter_s * 1e3:.0f} ms"
            + (f" (no timed request, defaults kept: {', '.join(self.fit.unfitted)})"
               if self.fit.unfitted else "")
            + (f" (few timed requests, one speed: {', '.join(self.fit.speed_only)})"
               if self.fit.speed_only else "")
            + ":",
        ]  # fmt: skip
        for pod in self.fit.pods:
            s = pod.summary()
            out.append(
                f"  {s['address']:<22} step {s['step_base_ms']:.2f} ms + "
                f"{s['prefill_us_per_token']:.1f} us/prefill token + "
                f"{s['kv_read_ns_per_token']:.1f} ns/context token; path {s['overhead_ms']:.1f} ms"
            )
        if self.captured is not None and self.fidelity is not None:
            c, f = self.captured, self.fidelity
            out += [
                "",
                f"fidelity (the twin under {self.running} against the capture): "
                f"TTFT p50 {f.ttft_p50_ms:.1f} / {c.ttft_p50_ms:.1f} ms "
                f"({f.ttft_p50_ms / c.ttft_p50_ms:.2f}x), p90 {f.ttft_p90_ms:.1f} / "
                f"{c.ttft_p90_ms:.1f} ms ({f.ttft_p90_ms / c.ttft_p90_ms:.2f}x), "
                f"hit rate {f.hit_rate:.3f} / {c.hit_rate:.3f}",
            ]
        out += ["", self.table(), ""]
        v = self.verdict()
        if isinstance(v["margin"], str):
            out.append(f"best: {v['name']}: {v['margin']}")
        else:
            m = v["margin"]
            out.append(
                f"best: {v['name']}, ahead of {self.running} by "
                f"{m['ttft_p50_ms']['gain_ms']:.1f} ms at p50 and "
                f"{m['ttft_p90_ms']['gain_ms']:.1f} ms at p90 (seeds' spread "
                f"{m['ttft_p50_ms']['noise_ms']:.1f} / {m['ttft_p90_ms']['noise_ms']:.1f} ms): "
                + ("beyond noise" if v["beyond_noise"] else "within noise: keep the running rule")
            )
            if v["beyond_noise"]:
                out += ["to apply:", *("  " + line for line in v["apply"].splitlines())]
        return "\n".join(out)

    def _more_seeds(self) -> str:
        more = [f"{r.candidate.name} {len(r.seeds)}" for r in self.results
                if len(r.seeds) > self.seeds]  # fmt: skip
        if not more:
            return ""
        return f" (more where they disagreed: {', '.join(more)})"

    def table(self) -> str:
        w = max([22, *(len(r.candidate.name) for r in self.results)])
        head = (
            f"{'rule':<{w}} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'TPOT p50':>9} "
            f"{'hit rate':>9} {'goodput/s':>10} {'spread':>7} {'errors':>7} {'seeds':>6}"
        )
        lines = [head, "-" * len(head)]
        best = self.best()
        for r in sorted(self.results, key=self._score):
            mark = (
                " *" if r is best else ("  (running)" if r.candidate.name == self.running else "")
            )
            lines.append(
                f"{r.candidate.name:<{w}} {r.median('ttft_p50_ms'):>7.1f}ms "
                f"{r.median('ttft_p90_ms'):>6.1f}ms {r.median('ttft_p99_ms'):>6.1f}ms "
                f"{r.median('tpot_p50_ms'):>7.2f}ms {r.median('hit_rate'):>9.3f} "
                f"{r.median('goodput_rps'):>10.2f} {r.median('spread'):>7.2f} "
                f"{r.median('errors'):>7.0f} {len(r.seeds):>6}{mark}"
            )
        return "\n".join(lines)


_JobArgs = tuple[
    TwinSetup, Sequence[TwinRequest], Candidate, int, float, float, float,
    LearnedModels | None, float,
]  # fmt: skip


def _job(args: _JobArgs) -> Stats:
    setup, requests, cand, seed, duration, slo_ttft, slo_tpot, latency, jitter = args
    served = replay(
        setup, requests, strategy=cand.strategy, params=cand.params, seed=seed,
        jitter_s=jitter, latency=latency,
    )  # fmt: skip
    pods = [p.address for p in setup.pods]
    return stats_of(served, duration, slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot, pods=pods)


def unsettled(p50s: Sequence[float], *, within: float = SETTLED) -> bool:
    """Whether one rule's TTFT p50 over its seeds is too scattered for their median to place
    it: the standard error of the mean (sd / sqrt(n)) above `within` of the median. Measured on
    the bench's captures (`extproc tune --seeds 12`): `kv-aware`'s p50 moves by 1-2 % between
    seeds, `predicted-latency`'s by up to 30 % (what its online models learn first steers the
    rest), `prefix-cache` on a cache cliff by 6x. Fewer than two seeds, or a seed without a
    figure (every request shed): nothing to tell, settled."""
    if len(p50s) < 2 or not all(math.isfinite(v) for v in p50s):
        return False
    error = statistics.stdev(p50s) / math.sqrt(len(p50s))
    return error > within * statistics.median(p50s)


def running_rule(requests: Sequence[TwinRequest]) -> str:
    names = Counter(r.strategy for r in requests if r.strategy)
    return names.most_common(1)[0][0] if names else DEFAULT_RULE


class _Runner:
    """Runs jobs in order, here or on worker processes (forked once, for every round)."""

    def __init__(self, pool: concurrent.futures.Executor | None) -> None:
        self._pool = pool

    def map(self, fn: Callable[[_A], _R], jobs: Sequence[_A]) -> list[_R]:
        if self._pool is None:
            return [fn(job) for job in jobs]
        return list(self._pool.map(fn, jobs))


@contextlib.contextmanager
def _runner(workers: int) -> Iterator[_Runner]:
    if workers <= 1:
        yield _Runner(None)
        return
    ctx = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        yield _Runner(pool)


def _learn(args: tuple[TwinSetup, Sequence[TwinRequest], str, float]) -> LearnedModels:
    setup, requests, strategy, jitter = args
    return learned_latency(setup, requests, strategy=strategy, jitter_s=jitter)


def tune(
    requests: Sequence[TwinRequest],
    *,
    base_config: Mapping[str, Any] | None = None,
    default_model: str = "model",
    rules: Sequence[Candidate] | None = None,
    seeds: int = 3,
    max_seeds: int = 12,
    settled: float = SETTLED,
    workers: int = 2,
    slo_ttft_s: float = 0.5,
    slo_tpot_s: float = 0.1,
    fit_window_s: float | None = 600.0,
    default_pods: int = 0,
    pod_facts: Mapping[str, Mapping[str, int]] | None = None,
    gateway_models: Sequence[Any] = (),
) -> TuneReport:
    if not requests:
        raise ValueError("the capture holds no request")
    pods = pods_of(requests, default_model, pod_facts)
    if not pods and default_pods > 0:  # a plain Mooncake trace: default engines, no fit
        pods = tuple(
            PodProfile(f"10.0.0.{k}:8000", default_model) for k in range(1, default_pods + 1)
        )
    if not pods:
        raise ValueError(
            "the capture names no pod (a plain Mooncake trace): say how many with --pods N"
        )
    setup = TwinSetup(pods=pods, base_config=dict(base_config or {}), default_model=default_model)
    prompts = PromptIds(requests)
    fit = fit_pods(requests, setup, window_s=fit_window_s, prompts=prompts)
    setup = TwinSetup(pods=fit.pods, base_config=setup.base_config, default_model=default_model)
    last = requests[-1]
    duration = max(1e-3, last.at_s + (last.latency_s or 0.0))
    running = running_rule(requests)
    rules = list(rules or candidates(requests))
    if not any(c.name == running for c in rules):
        rules.insert(0, Candidate(running, running))
    per_rule: list[list[Stats]] = [[] for _ in rules]
    pending = [(i, seed) for i in range(len(rules)) for seed in range(seeds)]
    with _runner(workers) as runner:
        # Every replay starts with the latency models the running gateway has: they learn
        # from every request whatever rule routes it, so a switch to `predicted-latency`
        # starts warm. The capture's (`gateway_models`: the gateway's own, learned from all
        # it has served, not only the capture's window), else a replay's under the running
        # rule (on a worker: an hour's replay would stay in this process's memory, and the
        # workers are forked from it).
        jitter = fit.jitter_s  # at least JITTER_S: the least of the grid
        if gateway_models:
            latency = LearnedModels(tuple(list(row) for row in gateway_models))
        else:
            latency = runner.map(_learn, [(setup, requests, running, jitter)])[0]
        while pending:  # the first round: every rule `seeds` times; then the unsettled ones
            jobs = [
                (setup, requests, rules[i], seed, duration, slo_ttft_s, slo_tpot_s,
                 None if rules[i].cold else latency, jitter)
                for i, seed in pending
            ]  # fmt: skip
            for (i, _seed), stats in zip(pending, runner.map(_job, jobs), strict=True):
                per_rule[i].append(stats)
            pending = [
                (i, len(done) + k)
                for i, done in enumerate(per_rule)
                if unsettled([s.ttft_p50_ms for s in done], within=settled)
                for k in range(min(seeds, max_seeds - len(done)))
            ]
    results = [RuleResult(cand, per_rule[i]) for i, cand in enumerate(rules)]
    fidelity = next((r.seeds[0] for r in results if r.candidate.name == running), None)
    return TuneReport(
        requests=len(requests),
        duration_s=duration,
        running=running,
        fit=fit,
        captured=captured_stats(requests, duration, [p.address for p in setup.pods]),
        fidelity=fidelity,
        ceiling=reuse_ceiling(requests),
        results=results,
        seeds=seeds,
        models_from="capture" if gateway_models else "replay",
    )
