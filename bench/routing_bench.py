"""Micro-benchmark: time one routing decision per strategy for 4, 16 and 64 pods.

Usage: .venv/bin/python bench/routing_bench.py [--iterations N] [--json out.json]
Pure CPU (no I/O); numbers are per decision, median and p99 over the iterations.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from extproc.accounting.latency_model import LatencyModels
from extproc.routing.base import PodState, PodStats, RoutingRequest, Snapshot
from extproc.routing.builtin import BUILTIN_PROFILES, default_plugins
from extproc.routing.predicted import latency_features
from extproc.routing.registry import StrategyRegistry
from extproc.types import Endpoint, EndpointRole, EngineMetrics

EXTRA_SPECS = [
    "prefix-cache:3,least-request:1",
    "queue:2,kv-cache-utilization:2,prefix:3,latency:1",
]


class _Fairness:
    def tokens(self, user: str) -> float:
        return 12_000.0

    def active_min(self) -> float:
        return 3_000.0


def make_snapshot(n: int, rng: random.Random) -> Snapshot:
    pods = []
    for i in range(n):
        role = (EndpointRole.PREFILL, EndpointRole.DECODE)[i % 2] if n > 1 else EndpointRole.BOTH
        metrics = EngineMetrics(
            updated_at=1.0,
            running=float(rng.randint(0, 40)),
            waiting=float(rng.randint(0, 8)),
            kv_cache_usage=rng.random(),
            ttft_avg_s=rng.uniform(0.05, 0.5),
            itl_avg_s=rng.uniform(0.01, 0.05),
            running_lora_adapters=("a1",) if i % 3 == 0 else (),
            max_lora=4,
        )
        pods.append(
            PodState(
                endpoint=Endpoint(
                    address=f"10.0.{i // 250}.{i % 250 + 1}:8000", model="m", role=role
                ),
                metrics=metrics,
                in_flight=rng.randint(0, 30),
                in_flight_tokens=rng.randint(0, 60_000),
                prefix_match_tokens=rng.choice([0, 0, 256, 1024, 2048]),
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


def warm_latency_models(req: RoutingRequest, rng: random.Random) -> LatencyModels:
    """Models with enough samples for every pod of every snapshot: predicted-latency is timed
    predicting, not on its cold-start cost rule."""
    models = LatencyModels()
    for n in (4, 16, 64):
        for pod in make_snapshot(n, random.Random(n)).pods:
            f = latency_features(req, pod)
            for _ in range(models.min_samples):
                models.observe("m", pod.address, f, ttft_s=rng.uniform(0.05, 0.5), tpot_s=0.02)
    return models


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iterations", type=int, default=2000)
    ap.add_argument("--json", help="write results to this file")
    args = ap.parse_args()
    req = RoutingRequest(
        request_id="bench",
        model="m",
        prompt_tokens=2048,
        max_tokens=256,
        user="u",
        lora="a1",
        session_id="10.0.0.3:8000",
    )
    plugins = default_plugins(latency=warm_latency_models(req, random.Random(0)))
    reg = StrategyRegistry(plugins, builtin=BUILTIN_PROFILES)
    results: dict[str, dict[str, dict[str, float]]] = {}
    names = [*reg.names(), *EXTRA_SPECS]
    print(f"{'strategy':<52} {'pods':>4} {'p50 us':>8} {'p99 us':>8}")
    for name in names:
        strategy = reg.resolve(name)
        results[name] = {}
        for n in (4, 16, 64):
            rng = random.Random(n)
            snap = make_snapshot(n, rng)
            for _ in range(100):  # warm-up
                strategy.route(req, snap, rng)
            samples = []
            for _ in range(args.iterations):
                t0 = time.perf_counter_ns()
                strategy.route(req, snap, rng)
                samples.append((time.perf_counter_ns() - t0) / 1000.0)
            samples.sort()
            p50 = statistics.median(samples)
            p99 = samples[int(len(samples) * 0.99) - 1]
            results[name][str(n)] = {"p50_us": round(p50, 2), "p99_us": round(p99, 2)}
            print(f"{name:<52} {n:>4} {p50:>8.1f} {p99:>8.1f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
