"""Micro-benchmark: time one routing decision per strategy for 4 to 512 pods.

Usage: .venv/bin/python bench/routing_bench.py [--iterations N] [--pods 4,16,64,256,512]
       [--json out.json] [--tree DIR]
       .venv/bin/python bench/routing_bench.py --plot before.json after.json out.png

Pure CPU (no I/O); numbers are per decision, median and p99 over the iterations. Two parts:

- `route`: the strategy's own `route(req, snap, rng)` on a prepared snapshot of `PodState`
  rows (an 8k-token prompt; every pod holds a random prefix of it: 0, 256, 1k, 2k or 4k
  tokens). Every rule reads numpy columns, so this includes building them from the rows; the
  director's snapshot hands them over as arrays (`--director`).
- `snapshot`: what the director does per request before the strategy runs, with the real
  parts: the ready endpoints from the metrics store, the in-flight counts, the gateway's pod
  stats, and the prefix lookup for every pod over the 8k-token prompt's 512 block hashes in
  the exact (KV-event) index; for a rule that reads load signals only (no prefix lookup is
  needed: the prompt is not even tokenized) and for one that reads prefix and accounting.

`--tree DIR` runs the same benchmark against another checkout (e.g. a `git worktree` of the
commit before a change): the before/after numbers then come from one script.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TREE_ENV = "ROUTING_BENCH_TREE"  # set by --tree for the child process
sys.path.insert(0, os.environ.get(TREE_ENV) or str(ROOT))

from extproc.accounting.inflight import InflightTracker  # noqa: E402
from extproc.accounting.latency_model import LatencyModels  # noqa: E402
from extproc.accounting.podstats import PodStatsTracker  # noqa: E402
from extproc.kvcache.exact import ExactIndex  # noqa: E402
from extproc.kvcache.hashing import block_hashes  # noqa: E402
from extproc.kvcache.prefix import IndexMode, PrefixIndex  # noqa: E402
from extproc.metrics.store import EndpointStore  # noqa: E402
from extproc.routing.base import (  # noqa: E402
    Capabilities,
    PodState,
    PodStats,
    RoutingRequest,
    Snapshot,
)
from extproc.routing.builtin import BUILTIN_PROFILES, default_plugins  # noqa: E402
from extproc.routing.predicted import latency_features  # noqa: E402
from extproc.routing.registry import StrategyRegistry  # noqa: E402
from extproc.types import Endpoint, EndpointRole, EngineMetrics  # noqa: E402

EXTRA_SPECS = [
    "prefix-cache:3,least-request:1",
    "queue:2,kv-cache-utilization:2,prefix:3,latency:1",
]
PODS = (4, 16, 64, 256, 512)
SNAPSHOT_LABELS = ("(snapshot: load signals)", "(snapshot: prefix + accounting)")
# The snapshot for a rule reading load signals only, and for one reading everything.
SNAPSHOT_KINDS = [
    (SNAPSHOT_LABELS[0], Capabilities()),
    (
        SNAPSHOT_LABELS[1],
        Capabilities(prompt_tokens=True, prefix_matches=True, accounting=True),
    ),
]
PROMPT_TOKENS = 8192
BLOCK_SIZE = 16


class _Fairness:
    def tokens(self, user: str) -> float:
        return 12_000.0

    def active_min(self) -> float:
        return 3_000.0


def _address(i: int) -> str:
    return f"10.0.{i // 250}.{i % 250 + 1}:8000"


def _role(i: int, n: int) -> EndpointRole:
    return (EndpointRole.PREFILL, EndpointRole.DECODE)[i % 2] if n > 1 else EndpointRole.BOTH


def _metrics(i: int, rng: random.Random) -> EngineMetrics:
    return EngineMetrics(
        updated_at=1.0,
        running=float(rng.randint(0, 40)),
        waiting=float(rng.randint(0, 8)),
        kv_cache_usage=rng.random(),
        ttft_avg_s=rng.uniform(0.05, 0.5),
        itl_avg_s=rng.uniform(0.01, 0.05),
        running_lora_adapters=("a1",) if i % 3 == 0 else (),
        max_lora=4,
    )


def make_snapshot(n: int, rng: random.Random) -> Snapshot:
    pods = []
    for i in range(n):
        metrics = _metrics(i, rng)
        pods.append(
            PodState(
                endpoint=Endpoint(address=_address(i), model="m", role=_role(i, n)),
                metrics=metrics,
                in_flight=rng.randint(0, 30),
                in_flight_tokens=rng.randint(0, 60_000),
                prefix_match_tokens=rng.choice([0, 0, 256, 1024, 2048, 4096]),
                cached_blocks=rng.randint(0, 30_000),
                stats=PodStats(
                    requests_total=100,
                    throughput_tokens_per_s=rng.uniform(100, 5000),
                    busy_time_s=rng.uniform(0, 60),
                    ttft_avg_s=0.2,
                    tpot_avg_s=0.02,
                ),
            )
        )
    return Snapshot(now=2.0, pods=tuple(pods), fairness=_Fairness())


def warm_latency_models(req: RoutingRequest, rng: random.Random, sizes: list[int]) -> Any:
    """Models with enough samples for every pod of every snapshot: predicted-latency is timed
    predicting, not on its cold-start cost rule."""
    models = LatencyModels()
    for n in sizes:
        for pod in make_snapshot(n, random.Random(n)).pods:
            f = latency_features(req, pod)
            for _ in range(models.min_samples):
                models.observe("m", pod.address, f, ttft_s=rng.uniform(0.05, 0.5), tpot_s=0.02)
    return models


def _percentiles(samples: list[float]) -> dict[str, float]:
    samples.sort()
    p99 = samples[max(0, int(len(samples) * 0.99) - 1)]
    return {
        "p50_us": round(statistics.median(samples), 2),
        "p99_us": round(p99, 2),
        "max_us": round(samples[-1], 2),
    }


def _time(fn: Callable[[], object], iterations: int) -> dict[str, float]:
    for _ in range(min(100, iterations)):  # warm-up
        fn()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(iterations):
        t0 = clock()
        fn()
        samples.append((clock() - t0) / 1000.0)
    return _percentiles(samples)


class _SnapshotFixture:
    """The director's per-request inputs for `n` pods, built from the real components."""

    def __init__(self, n: int, rng: random.Random) -> None:
        self.now = 2.0
        endpoints = [
            Endpoint(address=_address(i), model="m", metrics_url=f"http://{_address(i)}/metrics")
            for i in range(n)
        ]
        self.store = EndpointStore(stale_after=10.0, clock=lambda: self.now)
        self.store.set_endpoints({"m": endpoints})
        for i, ep in enumerate(endpoints):
            self.store.record_success(ep, _metrics(i, rng))
        self.podstats = PodStatsTracker()
        self.inflight = InflightTracker(clock=lambda: self.now, stats=self.podstats)
        self.leases = []
        for ep in endpoints:
            for _ in range(rng.randint(0, 4)):
                self.leases.append(self.inflight.start(ep, rng.randint(100, 9000)))
            self.podstats.observe_response(
                ep.address, now=1.5, latency_s=1.0, ttft_s=0.2, decode_s=0.8,
                tokens=2000, completion_tokens=100,
            )  # fmt: skip
        tokens = [rng.randrange(150_000) for _ in range(PROMPT_TOKENS)]
        self.hashes = block_hashes(tokens, BLOCK_SIZE)
        exact = ExactIndex(block_size=BLOCK_SIZE)
        nblocks = len(self.hashes)
        for i, ep in enumerate(endpoints):
            held = rng.choice([0, 0, 16, 64, 128, 256, nblocks])
            if held:
                engine = [i * 1_000_000 + b for b in range(held)]
                exact.stored(ep.address, engine, None, tokens[: held * BLOCK_SIZE])
        self.prefix = PrefixIndex(
            mode=IndexMode.EXACT, block_size=BLOCK_SIZE, exact=exact, approximate=None
        )
        self.build = self._director_build()

    def _director_build(self) -> Callable[[Capabilities], Sequence[PodState]]:
        """The snapshot builder the director uses at this tree's commit."""
        try:
            from extproc.director.snapshot import pod_states
        except ImportError:  # before `extproc.director.snapshot`: everything for every rule
            return lambda caps: self._head_build(self.hashes if caps.needs_tokens else ())

        def build(caps: Capabilities) -> Sequence[PodState]:
            pods = pod_states(
                self.store.ready("m"),
                prefix=self.prefix,
                block_hashes=self.hashes if caps.needs_tokens else (),
                now=self.now,
                inflight=self.inflight,
                podstats=self.podstats,
                capabilities=caps,
            )
            _read_columns(pods, caps)
            return pods

        return build

    def _head_build(self, hashes: Sequence[int]) -> tuple[PodState, ...]:
        """The director's loop before `extproc.director.snapshot` existed (commit 372daa0)."""
        candidates = self.store.ready("m")
        now = self.now
        matches = self.prefix.match((e.address for e, _ in candidates), hashes, now)
        return tuple(
            PodState(
                endpoint=ep,
                metrics=metrics,
                in_flight=(load := self.inflight.load(ep.address)).requests,
                in_flight_tokens=load.tokens,
                prefix_match_tokens=matches[ep.address].tokens,
                prefix_exact=matches[ep.address].exact,
                cached_blocks=self.prefix.cached_blocks(ep.address),
                stats=self.podstats.stats(ep.address, now),
            )
            for ep, metrics in candidates
        )


def _read_columns(pods: Sequence[PodState], caps: Capabilities) -> None:
    """A snapshot that defers work to first read (a `PodTable`) is timed with the columns a
    rule with `caps` reads built: the snapshot row then counts what the rows counted before."""
    try:
        from extproc.routing.columns import PodTable
    except ImportError:
        return
    if isinstance(pods, PodTable):
        cols = pods.columns
        cols.in_flight  # noqa: B018
        if caps.prefix_matches:
            cols.prefix_match_tokens  # noqa: B018
            cols.cached_blocks  # noqa: B018
        if caps.accounting:
            cols.busy_time  # noqa: B018


def _director(
    fixture: _SnapshotFixture, strategy: Any, req: RoutingRequest
) -> Callable[[], object]:
    """The director's snapshot for `strategy` and its decision on it, as one request pays."""
    rng = random.Random(7)

    def decide() -> object:
        pods = fixture.build(strategy.capabilities)
        return strategy.route(req, Snapshot(now=fixture.now, pods=pods, fairness=_Fairness()), rng)

    return decide


def _server_gc() -> None:
    """The server's garbage-collector settings (extproc/gctune.py), applied once the fixtures
    (the server's start-up state) exist. A tree from before that module gets the same values."""
    try:
        from extproc.gctune import tune_gc
    except ImportError:  # an older tree (--tree): the same settings, spelled out
        gc.collect()
        gc.freeze()
        gc.set_threshold(3_000, 10, 10)
    else:
        tune_gc()


def run(
    iterations: int, sizes: list[int], director: bool = False, server_gc: bool = True
) -> dict[str, dict[str, dict[str, float]]]:
    req = RoutingRequest(
        request_id="bench",
        model="m",
        prompt_tokens=PROMPT_TOKENS,
        max_tokens=256,
        user="u",
        lora="a1",
        session_id="10.0.0.3:8000",
    )
    plugins = default_plugins(latency=warm_latency_models(req, random.Random(0), sizes))
    reg = StrategyRegistry(plugins, builtin=BUILTIN_PROFILES)
    results: dict[str, dict[str, dict[str, float]]] = {}
    print(f"{'strategy':<52} {'pods':>4} {'p50 us':>8} {'p99 us':>8}", flush=True)
    fixtures = {n: _SnapshotFixture(n, random.Random(n)) for n in sizes}
    if server_gc:
        _server_gc()
    for label, caps in SNAPSHOT_KINDS:
        results[label] = {}
        for n in sizes:
            res = _time(partial(fixtures[n].build, caps), iterations)
            results[label][str(n)] = res
            print(f"{label:<52} {n:>4} {res['p50_us']:>8.1f} {res['p99_us']:>8.1f}", flush=True)
    for name in [*reg.names(), *EXTRA_SPECS]:
        strategy = reg.resolve(name)
        results[name] = {}
        for n in sizes:
            rng = random.Random(n)
            snap = make_snapshot(n, rng)
            res = _time(partial(strategy.route, req, snap, rng), iterations)
            results[name][str(n)] = res
            print(f"{name:<52} {n:>4} {res['p50_us']:>8.1f} {res['p99_us']:>8.1f}", flush=True)
    if director:  # snapshot + decision per rule, on the director's real inputs
        for name in [*reg.names(), *EXTRA_SPECS]:
            strategy = reg.resolve(name)
            label = f"(snapshot + route) {name}"
            results[label] = {}
            for n in sizes:
                res = _time(_director(fixtures[n], strategy, req), iterations)
                results[label][str(n)] = res
                print(f"{label:<52} {n:>4} {res['p50_us']:>8.1f} {res['p99_us']:>8.1f}", flush=True)
    return results


Results = dict[str, dict[str, dict[str, float]]]


def best_of(paths: str) -> Results:
    """Several runs' `--json` files (comma-separated) as one: per cell, the lowest p50 and the
    lowest p99 of the runs (on a shared machine the slowest run measures the neighbours)."""
    runs = [json.loads(Path(p).read_text()) for p in paths.split(",")]
    out: Results = {}
    for name in runs[0]:
        out[name] = {}
        for n in runs[0][name]:
            cells = [r[name][n] for r in runs if n in r.get(name, {})]
            out[name][n] = {k: min(c[k] for c in cells) for k in ("p50_us", "p99_us")}
    return out


def table(before: Results, after: Results) -> str:
    """Markdown: p50 / p99 ms per rule and pod count, before -> after."""
    sizes = sorted({n for row in after.values() for n in row}, key=int)
    lines = [
        "| rule | " + " | ".join(f"{n} pods" for n in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    for name, row in after.items():
        if name not in before:
            continue
        cells = []
        for n in sizes:
            b, a = before[name][n], row[n]
            cells.append(
                f"{b['p50_us'] / 1000:.3f} / {b['p99_us'] / 1000:.2f} → "
                f"**{a['p50_us'] / 1000:.3f} / {a['p99_us'] / 1000:.2f}**"
            )
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


DIRECTOR = "(snapshot + route) "  # the label prefix of `--director` rows


def plot(before_json: str, after_json: str, out: str) -> None:
    """Decision time against pods, one line per strategy, before (dashed) and after (solid):
    the director's snapshot + decision (median and p99, from `--director` runs) and the
    strategy's route alone (median); prints the table. Each argument may list several runs
    (comma-separated): see `best_of`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    before = best_of(before_json)
    after = best_of(after_json)
    print(table(before, after))
    both = [n for n in after if n in before]
    director = [n for n in both if n.startswith(DIRECTOR)]
    panels = [
        ("snapshot + decision, median", director, "p50_us"),
        ("snapshot + decision, p99", director, "p99_us"),
        ("route only, median", [n for n in both if not n.startswith("(")], "p50_us"),
    ]
    panels = [p for p in panels if p[1]]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 6), sharey=True)
    for ax, (title, rows, stat) in zip(np.atleast_1d(axes), panels, strict=True):
        colours = plt.get_cmap("tab20")
        for k, name in enumerate(rows):
            colour = colours(k % 20)
            for data, style in ((before, "--"), (after, "-")):
                pods = sorted(int(n) for n in data[name])
                ax.plot(
                    pods,
                    [data[name][str(n)][stat] / 1000 for n in pods],
                    style,
                    color=colour,
                    marker="o",
                    markersize=3,
                    label=name.removeprefix(DIRECTOR) if style == "-" else None,
                )
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("pods (candidates)")
        ax.set_title(f"{title}: dashed before, solid after", fontsize=10)
        ax.legend(fontsize=6, ncol=2)
    np.atleast_1d(axes)[0].set_ylabel("ms per request (best of the runs)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iterations", type=int, default=1000)
    ap.add_argument("--pods", default=",".join(map(str, PODS)), help="comma-separated pod counts")
    ap.add_argument("--json", help="write results to this file")
    ap.add_argument("--tree", help="run this script against the extproc package of DIR")
    ap.add_argument(
        "--director", action="store_true", help="also time snapshot + decision per rule"
    )
    ap.add_argument(
        "--default-gc",
        action="store_true",
        help="keep CPython's default GC thresholds (default: the server's, extproc/gctune.py)",
    )
    ap.add_argument(
        "--plot",
        nargs=3,
        metavar=("BEFORE", "AFTER", "PNG"),
        help="plot --json results (each a comma-separated list of runs) and print the table",
    )
    args = ap.parse_args()
    if args.plot:
        plot(*args.plot)
        return
    if args.tree:
        argv = list(sys.argv[1:])
        i = argv.index("--tree")
        del argv[i : i + 2]
        env = {**os.environ, TREE_ENV: str(Path(args.tree).resolve())}
        subprocess.run([sys.executable, __file__, *argv], env=env, check=True)
        return
    sizes = [int(x) for x in args.pods.split(",") if x]
    results = run(args.iterations, sizes, args.director, server_gc=not args.default_gc)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
