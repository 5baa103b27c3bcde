"""Fit each pod's simulated engine to what the capture measured of it.

The simulator's step model (`extproc.sim.config.StepTimeModel`) prices a step as a fixed part
(scheduling, reading the weights), a part per prefill token and a part per context token
read. A pod of another GPU, model or load differs from the default by how much each costs.
The fit replays the capture *pinned* (every request on the pod that served it: no routing,
so only the engines are tested) and moves each pod's model until its answers match the
capture's, a few rounds:

- the decode speed: the median time per output token (TPOT) of the pod's requests, twin
  against capture, scales the fixed and per-context parts (a decode step is mostly those);
- the prefill speed and the path's fixed cost: the pod's TTFTs, twin against capture: their
  slope over uncached prompt tokens (each side with its own cached counts: what a token of
  prefill costs, the queueing it causes included; the median of the slopes between pairs of
  requests, so the few that waited on something else do not tilt it) scales the per-token
  prefill cost. Where the uncached counts hardly vary, nothing says what a token of prefill
  costs: against the decode cost it costs what it does on the pods whose slope says (their
  median), else it moves with the decode cost (the spread of the TTFTs, read instead until
  2026-12-07, is queueing and a busy host's noise: on higress's capture it priced a pod's
  prefill at 2.8x its engine's). What is left at the median is the time the path adds to
  every first token (the gateway, Envoy, the engine's HTTP handler, a busy host's own
  delays). Every first token pays it, so it is at most what the pod's fastest tenth of
  requests took: a pod whose median request waited behind long prefills live, a queue the
  pinned replay does not rebuild as deep, is not given that wait as a path every cache hit
  then pays (docqa, 2026-12-07: a 142 ms path on a pod whose fastest answers took 17-21 ms;
  now 21 ms).

Every replay of the fit jitters the arrivals as the tuning's replays will (`fit_jitter`: as
much as spaces each pod's arrivals as the capture did; a closed loop replayed without noise
locks into step, and its batched prefills would be read as a dear engine).

Every round's step is checked: if the pods' answers moved further from the capture's (TTFT p50
and p90, TPOT p50 per pod: what the fidelity check compares), the pods go back to their last
profiles, and each pod that moved away takes half the step the next round. Where TTFTs are
mostly queueing (a few long prompts, each waiting for the last: document Q&A), their slope
over uncached tokens overstates what a token of prefill costs, and followed blindly it pushes
the pod into a queue the capture never had.

The cache size and scheduler limits are the simulator's defaults unless the caller knows the
pods' (`PodProfile`). Fitting needs the capture's outcomes: a pod with fewer than
`MIN_SAMPLES` timed requests gets one speed factor for all its costs (from its median time
per token, else its median TTFT), one with none keeps the defaults; `FitReport` says which.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from extproc.twin.replay import PodProfile, Served, TwinSetup, replay
from extproc.twin.trace import PromptIds, TwinRequest

__all__ = ["JITTER_GRID", "MIN_SAMPLES", "FitReport", "fit_jitter", "fit_pods", "pods_of"]

MIN_SAMPLES = 8
# Each round measures how a pod's answers move when its prefill or decode cost is nudged by
# this factor, then solves for both; a correction is bounded (a factor of e^_MAX_LOG_STEP) so
# one noisy round cannot throw a pod's model far off; rounds repeat until every correction is
# small (in log terms).
_NUDGE = 1.25
_MAX_LOG_STEP = math.log(3.0)
_CONVERGED = 0.03
# Uncached prompt tokens must vary by this much (standard deviation) across a pod's requests
# for their TTFTs' slope to say what a token of prefill costs. (64, one window, until
# 2026-12-07: a hetero capture at 60-61 was fitted without its slope, a pod 10x cheap to
# prefill with a 19 ms path; no other capture of the bench's nine sits between 48 and 64.)
_MIN_UNCACHED_SPREAD = 48.0
# The path's cost is at most this quantile of a pod's captured TTFTs.
_FASTEST = 0.1
# The slope's pairs: requests whose uncached counts differ by at least _MIN_UNCACHED_SPREAD
# (pairs a block apart read the TTFTs' noise as a slope: higress, whose prompts mostly sit
# within a few tokens of one another, got 450-560 us a token from them, its engines' 130 from
# pairs 48 apart); at most _MAX_PAIRED requests a pod (a sample spread over its uncached
# counts), so a long capture costs O(_MAX_PAIRED^2) a pod, not O(n^2).
_MAX_PAIRED = 600
# A pod's slope is read only where the capture pins it down: resampled `_RESAMPLES` times,
# its log spreads by at most this much (a factor of 1.65 either way at one standard
# deviation). On the bench's captures of 2026-12-07 (eight scenarios, 31 pods) the slopes
# that spread by 0.01-0.26 read 0.97-1.5x their engines' prefill cost; of the five that
# spread by 0.47-0.89 (28-118 requests each), one read 3.9x (tenants), the others 0.72-1.27x.
_RESAMPLES = 60
_SLOPE_SPREAD = 0.45
# The arrivals' jitter a replay gives every request (uniform in [0, J)), the one of these
# whose pinned replay spaces each pod's arrivals as the capture did (median gap): a
# closed-loop client sends as its last answer ends, and without noise the twin's answers
# that end at one step send their next requests at one instant, batch their prefills in one
# step and end together again (multiturn, 2026-12-07: each pod's arrivals 1.4 ms apart at
# the median where live had 12, the engine's TTFT p50 56 ms where live's was 33, and the fit
# cut the prefill cost 9x to make up). The least is about a decode step (see `JITTER_S`).
JITTER_GRID = (0.015, 0.03, 0.05, 0.08, 0.12)


@dataclass
class FitReport:
    pods: tuple[PodProfile, ...]
    rounds: int = 0
    jitter_s: float = JITTER_GRID[0]  # every replay's arrival jitter (`fit_jitter`)
    unfitted: list[str] = field(default_factory=list)  # pods with no timed request
    speed_only: list[str] = field(default_factory=list)  # fewer than MIN_SAMPLES: one speed
    # Per pod: capture's and twin's TTFT p50 / TPOT p50 (ms) after the last round.
    check: dict[str, dict[str, float]] = field(default_factory=dict)


def pods_of(
    requests: Sequence[TwinRequest],
    default_model: str,
    facts: Mapping[str, Mapping[str, int]] | None = None,
) -> tuple[PodProfile, ...]:
    """A default profile for every pod the capture names, with the model it served most and,
    where `facts` (the capture's `pods`) know them, its block size and number of KV blocks."""
    models: dict[str, Counter[str]] = {}
    for r in requests:
        if r.pod is not None:
            models.setdefault(r.pod, Counter())[r.model or default_model] += 1
    out = []
    for pod, count in sorted(models.items()):
        known = (facts or {}).get(pod, {})
        profile = PodProfile(address=pod, model=count.most_common(1)[0][0])
        out.append(
            dataclasses.replace(
                profile,
                block_size=known.get("block_size", profile.block_size),
                num_gpu_blocks=known.get("num_gpu_blocks", profile.num_gpu_blocks),
            )
        )
    return tuple(out)


def _quantile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _scaled(pod: PodProfile, decode: float, prefill: float, overhead_s: float) -> PodProfile:
    s = pod.step
    step = dataclasses.replace(
        s,
        overhead_s=s.overhead_s * decode,
        weights_read_s=s.weights_read_s * decode,
        kv_read_per_token_s=s.kv_read_per_token_s * decode,
        prefill_per_token_s=s.prefill_per_token_s * prefill,
    )
    return dataclasses.replace(pod, step=step, overhead_s=overhead_s)


def _slope(points: Sequence[tuple[float, float]]) -> float | None:
    """The Theil-Sen slope of TTFT over uncached prompt tokens (the median of the slopes
    between pairs of requests whose uncached counts differ by _MIN_UNCACHED_SPREAD); None
    when the uncached counts hardly vary (nothing to read a per-token cost from) or the slope
    is not positive. A median, not
    least squares: a few requests that waited behind a long prefill (or a busy host) would
    pull a least-squares line up and read as a dear prefill (hetero, 2026-12-07: 98 and 83 us
    a token on two pods of one speed whose pairs' median said 55 and 44)."""
    if len(points) < MIN_SAMPLES:
        return None
    x = np.fromiter((p[0] for p in points), float, len(points))
    if float(x.std()) < _MIN_UNCACHED_SPREAD:
        return None
    y = np.fromiter((p[1] for p in points), float, len(points))
    if len(x) > _MAX_PAIRED:  # every k-th point by uncached count: the pairs stay spread
        keep = np.argsort(x, kind="stable")[:: -(-len(x) // _MAX_PAIRED)]
        x, y = x[keep], y[keep]
    dx = x[None, :] - x[:, None]
    apart = dx >= _MIN_UNCACHED_SPREAD
    if not apart.any():
        return None
    slope = float(np.median((y[None, :] - y[:, None])[apart] / dx[apart]))
    return slope if slope > 0 else None


def _read_slope(points: Sequence[tuple[float, float]]) -> float | None:
    """A pod's slope (`_slope`) where the capture pins it down, else None: over `_RESAMPLES` resamples of its
    requests (with replacement, seeded), the slope exists in most and its log spreads by at
    most `_SLOPE_SPREAD` (standard deviation). Uncached counts that vary by 60 tokens leave
    it to a handful of requests: hetero's fast pods (40 us a token) read 16-66 us and 9-66 us
    between their resamples' tenth and ninetieth percentiles (2026-12-07), and the fit priced
    them at 33 and 26. A slope not pinned down is not read: the pod's prefill then moves with
    its decode as on the pods whose slope is."""
    slope = _slope(points)
    if slope is None:
        return None
    rng = np.random.default_rng(0)
    n = len(points)
    slopes = [_slope([points[i] for i in rng.integers(0, n, n)]) for _ in range(_RESAMPLES)]
    read = [math.log(s) for s in slopes if s is not None]
    pinned = len(read) > _RESAMPLES // 2 and float(np.std(read)) <= _SLOPE_SPREAD
    return slope if pinned else None


def _targets(
    rows: Sequence[TwinRequest], served: Mapping[int, Served], overhead_s: float, by_slope: bool
) -> tuple[float, float | None, float] | None:
    """(TPOT p50, the TTFTs' slope over uncached tokens, TTFT p50) of the twin's answers to
    `rows`, the TTFT without the path's cost, the slope only `by_slope`; None when too few
    were timed (or, `by_slope`, there is no slope to read)."""
    tpot = [t for r in rows if (t := served[r.index].tpot_s) is not None and t > 0]
    points = [
        (s.prompt_tokens - s.cached_tokens, s.ttft_s - overhead_s)
        for r in rows
        if (s := served[r.index]).ttft_s is not None
    ]
    slope = _slope(points) if by_slope else None
    if len(tpot) < MIN_SAMPLES or len(points) < MIN_SAMPLES or (by_slope and slope is None):
        return None
    return statistics.median(tpot), slope, statistics.median(y for _, y in points)


def _solve(jac: list[list[float]], r: Sequence[float]) -> tuple[float, float]:
    """(prefill, decode) steps x with jac @ x = r; for a near-singular system, the TPOT by the
    decode knob and the TTFTs' slope by the prefill knob, each alone."""
    (a, b), (c, d) = jac
    det = a * d - b * c
    if abs(det) > 0.05 * max(abs(a * d), abs(b * c), 1e-9):
        return (d * r[0] - b * r[1]) / det, (a * r[1] - c * r[0]) / det
    return (r[1] / c if abs(c) > 1e-3 else 0.0), (r[0] / b if abs(b) > 1e-3 else 0.0)


def _median_gap(arrivals: Mapping[str, list[float]]) -> float:
    """The median time between one request's arrival at its pod and the next's there."""
    gaps = [float(g) for times in arrivals.values() for g in np.diff(np.sort(times))]
    return statistics.median(gaps) if gaps else 0.0


def fit_jitter(
    requests: Sequence[TwinRequest], setup: TwinSetup, prompts: PromptIds | None = None
) -> float:
    """The arrivals' jitter (of `JITTER_GRID`) under which a pinned replay of `requests`
    spaces each pod's arrivals as the capture did (their median gap; the least jitter of those
    within 2 % of the closest). Open-loop traffic keeps its captured spacing under any of them
    (the least is taken); a closed loop's depends on them."""
    prompts = prompts or PromptIds(requests)
    captured: dict[str, list[float]] = {}
    for r in requests:
        if r.pod is not None:
            captured.setdefault(r.pod, []).append(r.at_s)
    want = _median_gap(captured)
    if want <= 0 or not any(r.after is not None for r in requests):
        return JITTER_GRID[0]
    misses = []
    for jitter in JITTER_GRID:
        out = replay(
            setup, requests, strategy="round-robin", pinned=True, prompts=prompts, seed=1,
            jitter_s=jitter,
        )  # fmt: skip
        sent: dict[str, list[float]] = {}
        for s in out:
            if s.pod is not None and s.sent_s >= 0:
                sent.setdefault(s.pod, []).append(s.sent_s)
        got = _median_gap(sent)
        misses.append(abs(math.log(got / want)) if got > 0 else math.inf)
    best = min(misses)
    return next(j for j, m in zip(JITTER_GRID, misses, strict=True) if m <= best + 0.02)


def fit_pods(
    requests: Sequence[TwinRequest],
    setup: TwinSetup,
    *,
    max_rounds: int = 5,
    window_s: float | None = 600.0,
    prompts: PromptIds | None = None,
) -> FitReport:
    """`setup`'s pods fitted to the capture's timed requests (see the module docstring); with
    `window_s`, to the first `window_s` seconds of the capture only (each round replays them
    three times)."""
    prompts = prompts or PromptIds(requests)
    if window_s is not None:
        requests = [r for r in requests if r.at_s <= window_s]
    jitter = fit_jitter(requests, setup, prompts)
    pods = {p.address: p for p in setup.pods}
    start = dict(pods)
    timed: dict[str, list[TwinRequest]] = {}
    for r in requests:
        if r.measured and r.pod in pods:
            timed.setdefault(r.pod, []).append(r)
    report = FitReport(pods=setup.pods, jitter_s=jitter)
    report.unfitted = sorted(a for a in pods if len(timed.get(a, ())) < MIN_SAMPLES)
    want: dict[str, tuple[float, float | None, float]] = {}
    for address, rows in timed.items():
        tpots = [r.tpot_s for r in rows if r.tpot_s is not None and r.tpot_s > 0]
        ttfts = [r.ttft_s for r in rows if r.ttft_s is not None]
        if address in report.unfitted or len(tpots) < MIN_SAMPLES:
            continue
        points = [
            (r.input_length - r.cached_tokens, r.ttft_s)
            for r in rows
            if r.ttft_s is not None and r.cached_tokens is not None
        ]
        if len(ttfts) >= MIN_SAMPLES:
            want[address] = (
                statistics.median(tpots),
                _read_slope(points),
                statistics.median(ttfts),
            )
    # A pod with a few timed requests only (a rule that avoided it): one speed for all its
    # costs, from the median time per token (else the median TTFT), and the path's cost of
    # the others: a pod a rule shunned is usually a slow one, and the defaults would say fast.
    few: dict[str, tuple[float | None, float]] = {}
    for address, rows in timed.items():
        if address in want:
            continue
        tpots = [r.tpot_s for r in rows if r.tpot_s is not None and r.tpot_s > 0]
        ttfts = [r.ttft_s for r in rows if r.ttft_s is not None]
        few[address] = (statistics.median(tpots) if tpots else None, statistics.median(ttfts))
    report.unfitted = sorted(a for a in pods if a not in want and a not in few)
    report.speed_only = sorted(few)
    if not want and not few:  # nothing was timed (a plain trace): the defaults, no replay
        return report

    def run(scale_decode: float, scale_prefill: float) -> dict[int, Served]:
        trial = dataclasses.replace(
            setup,
            pods=tuple(
                _scaled(p, scale_decode, scale_prefill, p.overhead_s) for p in pods.values()
            ),
        )
        out = replay(
            trial, requests, strategy="round-robin", pinned=True, prompts=prompts, seed=1,
            jitter_s=jitter,
        )  # fmt: skip
        return {r.index: s for r, s in zip(requests, out, strict=True)}

    aims = {a: _aims(timed[a]) for a in (*want, *few)}
    fastest = {
        a: _quantile([r.ttft_s for r in timed[a] if r.ttft_s is not None], _FASTEST) for a in want
    }
    # The closest pods so far, as a whole (a closed-loop client's next request waits for its
    # last one, so one pod's speed moves the others' arrivals): the profiles, their answers,
    # their total misfit and each pod's own.
    best: tuple[dict[str, PodProfile], dict[int, Served], float, dict[str, float]] | None = None
    radius = dict.fromkeys(aims, _MAX_LOG_STEP)

    def settle(served: dict[int, Served]) -> dict[int, Served]:
        """The pods' answers if they are closer to the capture than the best so far; else the
        best pods are restored, each pod that moved away will take half the step, and the
        best's answers are returned."""
        nonlocal best
        misses = {a: _misfit(timed[a], served, aim) for a, aim in aims.items()}
        total = sum(misses.values())
        if best is not None and total > best[2]:
            for address, miss in misses.items():
                if miss > best[3][address]:
                    radius[address] /= 2
            pods.update(best[0])
            return best[1]
        best = (dict(pods), served, total, misses)
        return served

    nudge = math.log(_NUDGE)
    for rnd in range(1, max_rounds + 1):
        report.rounds = rnd
        base = settle(run(1.0, 1.0))
        by_prefill, by_decode = run(1.0, _NUDGE), run(_NUDGE, 1.0)
        worst = 0.0
        # Pods with a slope first: a pod without one takes their prefill cost against decode.
        for address, (tpot, slope, ttft) in sorted(want.items(), key=lambda w: w[1][1] is None):
            pod, rows = pods[address], timed[address]
            f0 = _targets(rows, base, pod.overhead_s, slope is not None)
            fp = _targets(rows, by_prefill, pod.overhead_s, slope is not None)
            fd = _targets(rows, by_decode, pod.overhead_s, slope is not None)
            if f0 is None or fp is None or fd is None:
                continue
            # d log(target i) / d log(knob j): targets TPOT, TTFT slope; knobs prefill, decode.
            jac = [
                [(math.log(f[i] or 1.0) - math.log(f0[i] or 1.0)) / nudge for f in (fp, fd)]
                for i in (0, 1)
            ]
            tpot_off = math.log(tpot) - math.log(f0[0])
            if slope is not None and f0[1] is not None:
                dp, dd = _solve(jac, (tpot_off, math.log(slope) - math.log(f0[1])))
            else:
                # Nothing says what a token of prefill costs here: against the decode cost, what
                # it costs on the pods whose slope says (their median), else what it did.
                both = jac[0][0] + jac[0][1]
                dd = tpot_off / both if abs(both) > 1e-3 else 0.0
                said = [
                    _prefill_for_decode(pods[a], start[a])
                    for a, w in want.items()
                    if w[1] is not None
                ]
                aim = statistics.median(said) if said else 0.0
                dp = dd + aim - _prefill_for_decode(pod, start[address])
            bound = radius[address]
            dp, dd = max(-bound, min(bound, dp)), max(-bound, min(bound, dd))
            prefill, decode = math.exp(dp), math.exp(dd)
            # What the path adds: the capture's median TTFT over the twin's engine-only one,
            # as the twin will answer after this round's correction (to first order).
            ttft_after = f0[2] * (1.0 + (prefill - 1.0) * _share(f0[2], fp[2], nudge))
            overhead = max(0.0, min(ttft - ttft_after, fastest[address]))
            pods[address] = _scaled(pod, decode, prefill, overhead)
            worst = max(worst, abs(dp), abs(dd))
        path = statistics.median(pods[a].overhead_s for a in want) if want else 0.0
        for address, (tpot_or_none, ttft) in few.items():
            pod, rows = pods[address], timed[address]
            if tpot_or_none is not None:
                twin = [t for r in rows if (t := base[r.index].tpot_s) is not None and t > 0]
                target = tpot_or_none
            else:
                twin = [t - pod.overhead_s for r in rows if (t := base[r.index].ttft_s) is not None]
                target = max(1e-4, ttft - path)
            if not twin or statistics.median(twin) <= 0:
                continue
            bound = radius[address]
            step = max(-bound, min(bound, math.log(target / statistics.median(twin))))
            pods[address] = _scaled(pod, math.exp(step), math.exp(step), path)
            worst = max(worst, abs(step))
        if worst < _CONVERGED:
            break
    final = settle(run(1.0, 1.0))  # the last round's step too
    report.pods = tuple(pods.values())
    for address, (tpot, slope, ttft) in want.items():
        got = _targets(timed[address], final, 0.0, slope is not None)
        report.check[address] = {
            "capture_ttft_p50_ms": 1e3 * ttft,
            "twin_ttft_p50_ms": 1e3 * got[2] if got else -1.0,
            "capture_tpot_p50_ms": 1e3 * tpot,
            "twin_tpot_p50_ms": 1e3 * got[0] if got else -1.0,
        }
    return report


def _share(ttft: float, nudged: float, nudge: float) -> float:
    """How much of the median TTFT scales with the prefill cost (its log-derivative)."""
    return max(0.0, min(1.0, (math.log(nudged) - math.log(ttft)) / nudge))


def _prefill_for_decode(pod: PodProfile, start: PodProfile) -> float:
    """How far a pod's prefill cost moved from where the fit started, against its decode cost
    (log ratio: 0 when both moved alike)."""
    now, then = pod.step, start.step
    return math.log(now.prefill_per_token_s / then.prefill_per_token_s) - math.log(
        now.weights_read_s / then.weights_read_s
    )


def _aims(rows: Sequence[TwinRequest]) -> tuple[float, float, float | None]:
    """What the capture measured of a pod: TTFT p50 and p90, TPOT p50 (None: not timed)."""
    ttft = [r.ttft_s for r in rows if r.ttft_s is not None]
    tpot = [r.tpot_s for r in rows if r.tpot_s is not None and r.tpot_s > 0]
    return _quantile(ttft, 0.5), _quantile(ttft, 0.9), statistics.median(tpot) if tpot else None


def _misfit(
    rows: Sequence[TwinRequest],
    served: Mapping[int, Served],
    aim: tuple[float, float, float | None],
) -> float:
    """How far the twin's answers to a pod's requests are from the capture's: the squared log
    ratios of TTFT p50 and p90 and TPOT p50 (what the fidelity check compares), summed."""
    ttft = [t for r in rows if (t := served[r.index].ttft_s) is not None and t > 0]
    if not ttft:
        return math.inf
    pairs = [(_quantile(ttft, 0.5), aim[0]), (_quantile(ttft, 0.9), aim[1])]
    tpot = [t for r in rows if (t := served[r.index].tpot_s) is not None and t > 0]
    if aim[2] is not None and tpot:
        pairs.append((statistics.median(tpot), aim[2]))
    return sum(math.log(max(got, 1e-6) / max(want, 1e-6)) ** 2 for got, want in pairs)
