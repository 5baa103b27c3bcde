"""Replica state sync: do 2 and 4 server processes route like one?

The routing scenarios `multiturn`, `tenants` and `docqa` (bench/scenarios/*.yaml: their
simulators, workload and concurrency) run through five setups of our ext_proc servers, each
behind its own Envoy over the same simulators:

- `1p`: one server process (the reference);
- `2p`, `4p`: two or four processes, each routing from its own memory only;
- `2p+sync`, `4p+sync`: the same, sharing state over one embedded NATS server (in-flight load
  per pod, approximate prefix-index blocks, VTC charges, engine metrics; docs/architecture.md
  "Many replicas, one view"), on a subject of their own.

Strategy per scenario: `prefix-cache` for multiturn and docqa (prefix reuse is the point),
the scenario's own `least-request` for tenants; `--strategy SCENARIO=NAME` overrides.

Per run: the engines' prefix-cache hit rate (the simulators' own token counters, delta over
the run), imbalance (max/mean of requests each simulator finished), client-side TTFT p50/p90;
and, to explain a miss, what the servers saw: the share of the gateway's in-flight requests a
process counted (sampled from /debug/endpoints and /debug/sync every 0.5 s; 1/N without
sharing, ~1 with it), peers heard, sync messages and lag (`extproc_sync_lag_seconds`).

Fresh state per run: every server group is started for its run and stopped after it (only the
measured group runs, and it starts cold, as every other did); the engines' prefix caches are
reset before each run (`/reset_prefix_cache`, as the scenario runner does); and each run's
prompts carry their own salt, with the workload seed fixed, so every setup and repetition
sees the same shape (lengths, Zipf picks, turns) in content no index has seen before.
Setups run interleaved in each repetition, order rotated per repetition. Targets, each setup
against `1p`, deltas paired within a repetition, then the median: with sharing, hit rate
within 0.02, imbalance within 0.05, TTFT p50 and p90 within the noise floor, the spread
(max - min) of `1p` over the repetitions.

    .venv/bin/python -m bench.replicas --quick          # one scenario, smaller, ~4 minutes
    .venv/bin/python -m bench.replicas --json bench/data/replicas.json   # all three, ~20 min
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.loadgen import Arrival, LoadGenerator
from bench.scenario import Scenario, load_scenario, machine_info
from bench.stats import imbalance, summarize_records
from bench.targets import HOST, Cluster, FrontDoor
from bench.workloads import TextFactory, build_workload
from extproc.stack.nats_server import NatsServer, write_password_file

__all__ = [
    "SETUPS",
    "Setup",
    "aggregate",
    "bucket_quantile",
    "checks",
    "main",
    "markdown",
    "scaled",
    "sim_delta",
    "visibility",
]

log = logging.getLogger("bench.replicas")

ROOT = Path(__file__).resolve().parent.parent
SCENARIO_DIR = ROOT / "bench" / "scenarios"
SCENARIOS = ("multiturn", "tenants", "docqa")
QUICK_SCENARIOS = ("multiturn",)
STRATEGIES = {"multiturn": "prefix-cache", "tenants": "least-request", "docqa": "prefix-cache"}
# Full runs: the scenario's request counts times this (the three at full size, 5 setups and
# FULL_REPS repetitions take ~20 minutes on 2 cores; server start-up is ~1/3 of it).
FULL_SCALE = 1.0
FULL_REPS, QUICK_REPS = 3, 2
HIT_RATE_TOL = 0.02
IMBALANCE_TOL = 0.05
NATS_USER = "extproc"
SAMPLE_S = 0.5
MESH_TIMEOUT_S = 20.0
READY_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Setup:
    processes: int
    sync: bool

    @property
    def key(self) -> str:
        return f"{self.processes}p" + ("+sync" if self.sync else "")


SETUPS = (Setup(1, False), Setup(2, False), Setup(2, True), Setup(4, False), Setup(4, True))
REFERENCE = SETUPS[0].key


# -- pure parts (tested in tests/bench/test_replicas.py) -----------------------------------------


def scaled(params: Mapping[str, Any], factor: float) -> dict[str, Any]:
    """Workload params with the request count (`requests`, or `sessions` for multi-turn) times
    `factor`, at least 1; every other parameter (lengths, Zipf, tenants) unchanged."""
    out = dict(params)
    for key in ("requests", "sessions"):
        if key in out:
            out[key] = max(1, round(int(out[key]) * factor))
    return out


def sim_delta(
    before: Mapping[str, Mapping[str, Any]], after: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """Two readings of every simulator's /debug/stats -> requests finished per simulator, the
    engines' prefix-cache hit rate (hit tokens / looked-up tokens) and imbalance (max/mean)."""
    per_pod = {
        a: sum(after[a]["finished"].values()) - sum(before[a]["finished"].values()) for a in after
    }
    queries = sum(
        after[a]["prefix_cache_queries"] - before[a]["prefix_cache_queries"] for a in after
    )
    hits = sum(after[a]["prefix_cache_hits"] - before[a]["prefix_cache_hits"] for a in after)
    imb = imbalance(list(per_pod.values()))
    return {
        "per_pod_requests": per_pod,
        "engine_hit_rate": round(hits / queries, 4) if queries > 0 else None,
        "imbalance": None if imb is None else round(imb, 4),
    }


def visibility(samples: Sequence[Sequence[tuple[int, int]]]) -> float | None:
    """The share of the gateway's in-flight requests a process counted, averaged over samples.

    A sample holds, per process, (requests in flight it counted over all pods, of which its
    peers' share). A process's own share is counted minus peers'; the gateway's total is the
    sum of own shares. Without sharing a process sees its own share (1/N on average); with
    sharing, all of it. Samples with nothing in flight are skipped. The processes are read
    one after another, so a sample is not one instant: values a little off 1 are expected.
    """
    shares = []
    for procs in samples:
        total = sum(seen - remote for seen, remote in procs)
        if total > 0 and procs:
            shares.append(statistics.mean(seen for seen, _ in procs) / total)
    return round(statistics.mean(shares), 3) if shares else None


def bucket_quantile(buckets: Mapping[float, float], q: float) -> float | None:
    """Upper bound of the bucket that holds quantile `q` of a Prometheus histogram given as
    cumulative counts per `le` (including +Inf); None without observations."""
    items = sorted(buckets.items())
    if not items or items[-1][1] <= 0:
        return None
    rank = q * items[-1][1]
    return next(le for le, count in items if count >= rank)


def _median(values: Sequence[float | None]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return round(statistics.median(vals), 4) if vals else None


def _spread(values: Sequence[float | None]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return round(max(vals) - min(vals), 4) if len(vals) >= 2 else None


_MEDIAN_KEYS = (
    "engine_hit_rate", "imbalance", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms",
    "cache_hit_rate", "req_per_s", "visibility", "sync_lag_mean_ms", "sync_lag_p99_ms",
    "duration_s",
)  # fmt: skip
_SPREAD_KEYS = ("engine_hit_rate", "imbalance", "ttft_p50_ms", "ttft_p90_ms")


def aggregate(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per (scenario, setup): the median over repetitions of every figure, and the spread
    (max - min) of the ones the targets compare."""
    rows = []
    for sc in dict.fromkeys(r["scenario"] for r in runs):
        for setup in dict.fromkeys(r["setup"] for r in runs if r["scenario"] == sc):
            mine = [r for r in runs if r["scenario"] == sc and r["setup"] == setup]
            row: dict[str, Any] = {
                "scenario": sc,
                "setup": setup,
                "strategy": mine[0]["strategy"],
                "reps": len(mine),
                "requests": sum(int(r["requests"]) for r in mine),
                "errors": sum(int(r["errors"]) for r in mine),
                "timed_out": any(r.get("timed_out") for r in mine),
            }
            for k in _MEDIAN_KEYS:
                row[k] = _median([r.get(k) for r in mine])
            for k in _SPREAD_KEYS:
                row[f"{k}_spread"] = _spread([r.get(k) for r in mine])
            peers = [r["min_peers"] for r in mine if r.get("min_peers") is not None]
            row["min_peers"] = min(peers) if peers else None
            rows.append(row)
    return rows


def _paired(
    runs: Sequence[Mapping[str, Any]], scenario: str, setup: str, key: str, ref: str
) -> float | None:
    """Median over repetitions of (setup - reference) in the same repetition."""
    base = {r["rep"]: r for r in runs if r["scenario"] == scenario and r["setup"] == ref}
    diffs = []
    for r in runs:
        if r["scenario"] != scenario or r["setup"] != setup:
            continue
        b = base.get(r["rep"])
        if b is not None and r.get(key) is not None and b.get(key) is not None:
            diffs.append(float(r[key]) - float(b[key]))
    return _median(diffs)


def _within(delta: float | None, bound: float | None) -> bool | None:
    if delta is None or bound is None:
        return None
    return abs(delta) <= bound + 1e-9


def checks(runs: Sequence[Mapping[str, Any]], ref: str = REFERENCE) -> list[dict[str, Any]]:
    """Every setup against `ref`, per scenario: hit rate within HIT_RATE_TOL, imbalance within
    IMBALANCE_TOL, TTFT p50/p90 within the noise floor (the spread of `ref` over repetitions).
    `target` says whether the issue's bounds apply (sharing setups); the others are the
    contrast. `met` is None when a figure is missing (e.g. one repetition: no noise floor)."""
    out = []
    for sc in dict.fromkeys(r["scenario"] for r in runs):
        mine = [r for r in runs if r["scenario"] == sc]
        ref_runs = [r for r in mine if r["setup"] == ref]
        noise = {k: _spread([r.get(k) for r in ref_runs]) for k in ("ttft_p50_ms", "ttft_p90_ms")}
        for setup in dict.fromkeys(r["setup"] for r in mine):
            if setup == ref:
                continue
            c: dict[str, Any] = {
                "scenario": sc,
                "setup": setup,
                "target": any(r["sync"] for r in mine if r["setup"] == setup),
            }
            for key, name in (("engine_hit_rate", "hit_rate"), ("imbalance", "imbalance")):
                c[f"d_{name}"] = _paired(runs, sc, setup, key, ref)
            c["hit_rate_ok"] = _within(c["d_hit_rate"], HIT_RATE_TOL)
            c["imbalance_ok"] = _within(c["d_imbalance"], IMBALANCE_TOL)
            for q in ("p50", "p90"):
                key = f"ttft_{q}_ms"
                c[f"d_ttft_{q}_ms"] = _paired(runs, sc, setup, key, ref)
                c[f"noise_ttft_{q}_ms"] = noise[key]
                c[f"ttft_{q}_ok"] = _within(c[f"d_ttft_{q}_ms"], noise[key])
            oks = [c[k] for k in ("hit_rate_ok", "imbalance_ok", "ttft_p50_ok", "ttft_p90_ok")]
            # Missed as soon as one bound is; met only when every one was decided and held.
            c["met"] = False if False in oks else (None if None in oks else True)
            out.append(c)
    return out


def _fmt(v: float | None, digits: int = 3, sign: str = "") -> str:
    """A figure for the table: `digits` decimals below 100, none above; `sign="+"` signs it."""
    if v is None:
        return "-"
    return f"{v:{sign}.{digits}f}" if abs(v) < 100 else f"{v:{sign}.0f}"


def _signed(v: float | None, digits: int = 3) -> str:
    return _fmt(v, digits, "+")


def _mark(ok: bool | None) -> str:
    return "" if ok is None else (" ✓" if ok else " ✗")


def markdown(result: Mapping[str, Any]) -> str:
    """One table per scenario (medians, deltas against 1 process, ✓/✗ per target), then the
    verdict per sharing setup."""
    lines: list[str] = []
    rows, cks = result["summary"], result["checks"]
    for sc in dict.fromkeys(r["scenario"] for r in rows):
        here = [r for r in rows if r["scenario"] == sc]
        ref = next((r for r in here if r["setup"] == REFERENCE), None)
        lines.append(
            f"\n**replicas / {sc}** ({here[0]['strategy']}; median of {here[0]['reps']} "
            f"repetitions; deltas against {REFERENCE}, paired per repetition; "
            f"noise floor = {REFERENCE} spread: TTFT p50 "
            f"{_fmt(ref and ref.get('ttft_p50_ms_spread'), 1)} ms, p90 "
            f"{_fmt(ref and ref.get('ttft_p90_ms_spread'), 1)} ms)\n"
        )
        lines.append(
            "| setup | hit rate | Δ hit (≤0.02) | imbalance | Δ imb (≤0.05) | TTFT p50 ms "
            "| Δ p50 ms | TTFT p90 ms | Δ p90 ms | in-flight seen | sync lag p99 ms "
            "| errors | targets |"
        )
        lines.append("|---|" + "---|" * 12)
        for r in here:
            c: Mapping[str, Any] = next(
                (c for c in cks if c["scenario"] == sc and c["setup"] == r["setup"]), {}
            )
            verdict = "reference"
            if c:
                verdict = ("met" if c["met"] else "missed") if c["met"] is not None else "-"
                if not c["target"]:
                    verdict = f"({verdict}; no sharing)"
            lines.append(
                f"| {r['setup']} | {_fmt(r['engine_hit_rate'])} "
                f"| {_signed(c.get('d_hit_rate'))}{_mark(c.get('hit_rate_ok'))} "
                f"| {_fmt(r['imbalance'])} "
                f"| {_signed(c.get('d_imbalance'))}{_mark(c.get('imbalance_ok'))} "
                f"| {_fmt(r['ttft_p50_ms'], 1)} "
                f"| {_signed(c.get('d_ttft_p50_ms'), 1)}{_mark(c.get('ttft_p50_ok'))} "
                f"| {_fmt(r['ttft_p90_ms'], 1)} "
                f"| {_signed(c.get('d_ttft_p90_ms'), 1)}{_mark(c.get('ttft_p90_ok'))} "
                f"| {_fmt(r['visibility'], 2)} | {_fmt(r['sync_lag_p99_ms'], 1)} "
                f"| {r['errors']}{' (timed out)' if r['timed_out'] else ''} | {verdict} |"
            )
    targets = [c for c in cks if c["target"]]
    if targets:
        met = [f"{c['scenario']} {c['setup']}" for c in targets if c["met"]]
        missed = [
            f"{c['scenario']} {c['setup']} ("
            + ", ".join(
                name
                for name, k in (
                    ("hit rate", "hit_rate_ok"),
                    ("imbalance", "imbalance_ok"),
                    ("TTFT p50", "ttft_p50_ok"),
                    ("TTFT p90", "ttft_p90_ok"),
                )
                if c[k] is False
            )
            + ")"
            for c in targets
            if c["met"] is False
        ]
        open_ = [f"{c['scenario']} {c['setup']}" for c in targets if c["met"] is None]
        lines.append(f"\n**Sharing setups meeting every target**: {', '.join(met) or 'none'}.")
        lines.append(f"**Missing one or more**: {', '.join(missed) or 'none'}.")
        if open_:
            lines.append(
                f"**Not decided** (a figure or the noise floor missing): {', '.join(open_)}."
            )
    for note in result.get("notes", ()):
        lines.append(f"\n{note}")
    return "\n".join(lines) + "\n"


# -- measurement ---------------------------------------------------------------------------------


def _get_json(client: httpx.Client, url: str) -> Any:
    return client.get(url).json()


@dataclass(frozen=True, slots=True)
class _Ports:
    grpc: tuple[int, ...]
    metrics: tuple[int, ...]
    listen: int
    admin: int


@dataclass(slots=True)
class Group:
    """One setup's server processes and the Envoy in front of them."""

    setup: Setup
    door: FrontDoor
    pids: tuple[int, ...]
    metrics_ports: tuple[int, ...]

    def url(self, i: int, path: str) -> str:
        return f"http://{HOST}:{self.metrics_ports[i]}{path}"


@dataclass(slots=True)
class _Bus:
    nats: NatsServer
    password_file: Path


def _server_config(
    cluster: Cluster,
    *,
    grpc_port: int,
    metrics_port: int,
    strategy: str,
    index: str,
    extra: Mapping[str, Any],
    sync: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """LocalStack's server config (same models, endpoints, KV events, polling) with this
    process's ports, the strategy, and `sync:` for a sharing group."""
    cfg = cluster.stack.server_config()
    cfg["server"] = {
        **cfg["server"],
        "grpc_port": grpc_port,
        "metrics_port": metrics_port,
        # Envoy is stopped first: nothing to announce, nothing to drain.
        "shutdown_announce_s": 0.0,
        "shutdown_grace_s": 2.0,
    }
    cfg["routing"] = {**cfg.get("routing", {}), "default_strategy": strategy}
    if index != "auto":
        cfg["kv_events"] = {"mode": index}
    for k, v in extra.items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, Mapping) else v
    if sync is not None:
        cfg["sync"] = dict(sync)
    return cfg


def start_group(
    cluster: Cluster,
    setup: Setup,
    ports: _Ports,
    *,
    strategy: str,
    index: str,
    extra: Mapping[str, Any],
    bus: _Bus | None,
    subject: str,
) -> Group:
    sync = None
    if setup.sync:
        assert bus is not None
        sync = {
            "url": bus.nats.url,
            "subject": subject,
            "user": NATS_USER,
            "password_file": str(bus.password_file),
        }
    procs = []
    for i in range(setup.processes):
        cfg = _server_config(
            cluster,
            grpc_port=ports.grpc[i],
            metrics_port=ports.metrics[i],
            strategy=strategy,
            index=index,
            extra=extra,
            sync=sync,
        )
        path = cluster.workdir / f"config-{setup.key}-{i}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        args = [sys.executable, "-m", "extproc", "serve", "--config", str(path)]
        procs.append((f"extproc-{setup.key}-{i}", args, f"http://{HOST}:{ports.metrics[i]}/readyz"))
    pids = cluster.spawn_group(procs, env={"PYTHONUNBUFFERED": "1"})
    try:
        door = cluster.envoy_for(
            setup.key,
            ports.grpc[: setup.processes],
            listen=ports.listen,
            admin=ports.admin,
            server_pids=pids,
            metrics_ports=ports.metrics[: setup.processes],
        )
    except BaseException:
        cluster.stop_spawned(pids)
        raise
    return Group(setup, door, pids, ports.metrics[: setup.processes])


def stop_group(cluster: Cluster, group: Group) -> None:
    cluster.stop_door(group.door)
    cluster.stop_spawned(group.pids)


def wait_mesh(group: Group, timeout_s: float = MESH_TIMEOUT_S) -> float:
    """Until every process of a sharing group hears all its peers; seconds it took."""
    t0 = time.monotonic()
    want = group.setup.processes - 1
    with httpx.Client(timeout=2.0) as client:
        while True:
            heard = []
            for i in range(group.setup.processes):
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    state = _get_json(client, group.url(i, "/debug/sync"))
                    heard.append(len(state["peers_last_heard_s"]))
            if len(heard) == group.setup.processes and min(heard) >= want:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"{group.setup.key}: peers heard {heard}, want {want} each")
            time.sleep(0.1)


class InflightSampler:
    """Every SAMPLE_S, per process: in-flight requests it counts over all pods and its peers'
    share of them (for `visibility`), and how many peers it hears."""

    def __init__(self, group: Group) -> None:
        self._group = group
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inflight-sampler", daemon=True)
        self.samples: list[list[tuple[int, int]]] = []
        self.peers: list[int] = []

    def __enter__(self) -> InflightSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        g = self._group
        with httpx.Client(timeout=2.0) as client:
            while not self._stop.wait(SAMPLE_S):
                sample = []
                try:
                    for i in range(g.setup.processes):
                        eps = _get_json(client, g.url(i, "/debug/endpoints"))
                        state = _get_json(client, g.url(i, "/debug/sync"))
                        remote = sum(int(v[0]) for v in state.get("remote_in_flight", {}).values())
                        sample.append((sum(int(e["in_flight"]) for e in eps), remote))
                        if state.get("enabled"):
                            self.peers.append(len(state["peers_last_heard_s"]))
                except (httpx.HTTPError, ValueError, KeyError):
                    continue  # a missed sample, not a failed run
                self.samples.append(sample)


_LAG = "extproc_sync_lag_seconds"
_SUMMARY_KEYS = (
    "requests", "ok", "errors", "error_kinds", "duration_s", "req_per_s", "ttft_p50_ms",
    "ttft_p90_ms", "ttft_p99_ms", "e2e_p50_ms", "cache_hit_rate",
)  # fmt: skip


def _scrape(client: httpx.Client, urls: Sequence[str]) -> dict[str, Any]:
    """What a run reads from the servers' /metrics, summed over processes: routed requests per
    process, sync messages by direction, drops, and the lag histogram."""
    out: dict[str, Any] = {"routed": [], "sent": 0.0, "received": 0.0, "dropped": 0.0}
    out["lag_sum"] = out["lag_count"] = 0.0
    buckets: dict[float, float] = {}
    for url in urls:
        routed = 0.0
        for fam in text_string_to_metric_families(client.get(url).text):
            for s in fam.samples:
                if s.name == "extproc_routed_requests_total":
                    routed += s.value
                elif s.name == "extproc_sync_messages_total":
                    key = str(s.labels.get("direction"))
                    if key in ("sent", "received"):
                        out[key] += s.value
                elif s.name == "extproc_sync_dropped_total":
                    out["dropped"] += s.value
                elif s.name == f"{_LAG}_sum":
                    out["lag_sum"] += s.value
                elif s.name == f"{_LAG}_count":
                    out["lag_count"] += s.value
                elif s.name == f"{_LAG}_bucket":
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + s.value
        out["routed"].append(routed)
    out["lag_buckets"] = buckets
    return out


def _sync_figures(m0: Mapping[str, Any], m1: Mapping[str, Any]) -> dict[str, Any]:
    n = m1["lag_count"] - m0["lag_count"]
    buckets = {le: c - m0["lag_buckets"].get(le, 0.0) for le, c in m1["lag_buckets"].items()}
    p99 = bucket_quantile(buckets, 0.99)
    return {
        "routed_per_process": [
            round(b - a) for a, b in zip(m0["routed"], m1["routed"], strict=True)
        ],
        "sync_sent": round(m1["sent"] - m0["sent"]),
        "sync_received": round(m1["received"] - m0["received"]),
        "sync_dropped": round(m1["dropped"] - m0["dropped"]),
        "sync_lag_mean_ms": round((m1["lag_sum"] - m0["lag_sum"]) * 1000 / n, 3) if n else None,
        "sync_lag_p99_ms": None if p99 is None else round(p99 * 1000, 3),
    }


def wait_endpoints(group: Group, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until every process has fresh metrics for every pod (its own scrape or, sharing, a
    peer's): /readyz only needs one, and a busy machine can leave the others stale."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while True:
            ready = []
            for i in range(group.setup.processes):
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    eps = _get_json(client, group.url(i, "/debug/endpoints"))
                    ready.append(bool(eps) and all(e["ready"] for e in eps))
            if len(ready) == group.setup.processes and all(ready):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{group.setup.key}: endpoints not all ready: {ready}")
            time.sleep(0.1)


def _warm(group: Group, text: TextFactory, model: str, attempts: int = 3) -> None:
    """A few short requests through every process (first-request costs: Envoy's connections to
    each server, lazy imports), before the caches are reset."""
    n = 4 * group.setup.processes
    convs = build_workload(
        "fixed_chat",
        {"requests": n, "prompt_tokens": 40, "output_tokens": 4, "distinct": 4},
        text=text,
        seed=99,
        salt=f"warm.{group.setup.key}",
    )
    for attempt in range(1, attempts + 1):
        gen = LoadGenerator(group.door.base_url, model=model, max_duration_s=60.0)
        res = asyncio.run(gen.run(convs, Arrival(concurrency=group.setup.processes)))
        bad = [r for r in res.records if not r.ok]
        if not bad:
            return
        log.warning("%s: warm-up attempt %d: %d failed, e.g. %s %s", group.setup.key, attempt,
                    len(bad), bad[0].status, bad[0].error)  # fmt: skip
        if attempt == attempts:
            raise RuntimeError(f"{group.setup.key}: warm-up failed: {bad[0].status} {bad[0].error}")
        time.sleep(1.0)
        wait_endpoints(group)


@dataclass(slots=True)
class _Ctx:
    cluster: Cluster
    sc: Scenario
    base_name: str
    strategy: str
    index: str
    bus: _Bus
    ports: dict[str, _Ports]
    text: TextFactory
    params: Mapping[str, Any]
    model: str
    extra: Mapping[str, Any] = field(default_factory=dict)


def one_run(ctx: _Ctx, setup: Setup, rep: int) -> dict[str, Any]:
    sc, cluster = ctx.sc, ctx.cluster
    load = sc.loads[0]
    convs = build_workload(
        sc.workload_kind,
        ctx.params,
        text=ctx.text,
        seed=sc.seed,  # the same shape for every setup and repetition ...
        salt=f"replicas.{ctx.base_name}.{rep}.{setup.key}",  # ... in content never seen
    )
    t0 = time.monotonic()
    group = start_group(
        cluster,
        setup,
        ctx.ports[setup.key],
        strategy=ctx.strategy,
        index=ctx.index,
        extra=ctx.extra,
        bus=ctx.bus if setup.sync else None,
        subject=f"extproc.sync.{ctx.base_name}.g{setup.processes}.r{rep}",
    )
    try:
        mesh_s = wait_mesh(group) if setup.sync else None
        wait_endpoints(group)
        start_s = time.monotonic() - t0
        _warm(group, ctx.text, ctx.model)
        cluster.wait_idle()
        cluster.reset_caches()
        time.sleep(0.3)  # the AllBlocksCleared events reach the servers before traffic
        urls = group.door.metrics_urls
        with httpx.Client(timeout=5.0) as client:
            sims0, m0 = cluster.sim_stats(), _scrape(client, urls)
            gen = LoadGenerator(
                group.door.base_url, model=ctx.model, max_duration_s=sc.max_duration_s, seed=rep
            )
            with InflightSampler(group) as sampler:
                result = asyncio.run(gen.run(convs, load.arrival))
            sims1, m1 = cluster.sim_stats(), _scrape(client, urls)
            debug_sync = [
                _get_json(client, group.url(i, "/debug/sync")) for i in range(setup.processes)
            ]
    finally:
        stop_group(cluster, group)
    summary = summarize_records(result.records, result.duration_s)
    run: dict[str, Any] = {
        "scenario": ctx.base_name,
        "setup": setup.key,
        "processes": setup.processes,
        "sync": setup.sync,
        "rep": rep,
        "strategy": ctx.strategy,
        "timed_out": result.timed_out,
        "group_start_s": round(start_s, 2),
        "mesh_s": None if mesh_s is None else round(mesh_s, 2),
        **{k: summary[k] for k in _SUMMARY_KEYS},
        **sim_delta(sims0, sims1),
        # Other work on the machine during the run (a shared machine's noise).
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "visibility": visibility(sampler.samples),
        "inflight_samples": len(sampler.samples),
        "min_peers": min(sampler.peers) if sampler.peers else None,
        **_sync_figures(m0, m1),
        "sync_after": [
            {k: s.get(k) for k in ("enabled", "connected", "peers_last_heard_s")}
            for s in debug_sync
        ],
    }
    log.info(
        "%s rep%d %-8s ok=%d/%d %.1fs hit %s imb %s ttft p50 %s p90 %s ms seen %s peers %s "
        "lag p99 %s ms routed %s",
        ctx.base_name, rep, setup.key, run["ok"], run["requests"], run["duration_s"],
        run["engine_hit_rate"], run["imbalance"], run["ttft_p50_ms"], run["ttft_p90_ms"],
        run["visibility"], run["min_peers"], run["sync_lag_p99_ms"], run["routed_per_process"],
    )  # fmt: skip
    return run


@contextlib.contextmanager
def _bus(cluster: Cluster) -> Iterator[_Bus]:
    (port,) = cluster.ports(1)
    password_file = cluster.workdir / "nats.password"
    nats = NatsServer(port, cluster.workdir, NATS_USER, write_password_file(password_file))
    nats.start()
    try:
        yield _Bus(nats, password_file)
    finally:
        nats.stop()


def _plan_ports(cluster: Cluster) -> dict[str, _Ports]:
    """Fixed ports per setup, reused by each of its runs (one group runs at a time)."""
    out = {}
    for s in SETUPS:
        ports = cluster.ports(2 * s.processes + 2)
        n = s.processes
        out[s.key] = _Ports(tuple(ports[:n]), tuple(ports[n : 2 * n]), ports[-2], ports[-1])
    return out


def run_scenario(
    name: str,
    *,
    quick: bool,
    reps: int,
    scale: float,
    strategy: str,
    index: str,
    workdir: Path,
    on_run: Callable[[dict[str, Any]], None],
) -> None:
    """Every (setup, repetition) of one scenario; each run's record (or, for a run that
    failed, `{"failed": reason, ...}`) goes to `on_run` as soon as it is known."""
    sc = load_scenario(SCENARIO_DIR / f"{name}.yaml", quick=quick)
    c = sc.cluster
    cluster = Cluster(
        workdir=workdir / name,
        sims=int(c.get("sims", 4)),
        sim_args=tuple(str(a) for a in c.get("sim_args", ())),
        kv_events=index != "approximate",  # an approximate index reads no KV events
        servers=False,
        repo_root=ROOT,
    )
    with cluster, _bus(cluster) as bus:
        ctx = _Ctx(
            cluster=cluster,
            sc=sc,
            base_name=name,
            strategy=strategy,
            index=index,
            bus=bus,
            ports=_plan_ports(cluster),
            text=TextFactory.qwen(sc.seed),
            params=scaled(sc.loads[0].workload_params, scale),
            model=str(c.get("model", "qwen3")),
            extra=dict(c.get("server_config", {})),
        )
        for rep in range(reps):
            k = rep % len(SETUPS)
            for setup in SETUPS[k:] + SETUPS[:k]:  # rotated: no setup always first or last
                try:
                    on_run(one_run(ctx, setup, rep))
                except Exception as exc:  # one failed run is reported, not fatal to the rest
                    log.exception("%s rep%d %s failed", name, rep, setup.key)
                    on_run({"scenario": name, "setup": setup.key, "rep": rep, "failed": str(exc)})


def run(
    *,
    quick: bool,
    scenarios: Sequence[str],
    reps: int,
    scale: float,
    strategies: Mapping[str, str],
    index: str,
    workdir: Path,
    on_run: Callable[[dict[str, Any]], None] = lambda _run: None,
) -> dict[str, Any]:
    started = time.time()
    records: list[dict[str, Any]] = []

    def keep(record: dict[str, Any]) -> None:
        records.append(record)
        on_run(record)

    for name in scenarios:
        t0 = time.monotonic()
        try:
            run_scenario(
                name,
                quick=quick,
                reps=reps,
                scale=scale,
                strategy=strategies[name],
                index=index,
                workdir=workdir,
                on_run=keep,
            )
        except Exception as exc:  # e.g. its simulators did not start: the others still run
            log.exception("scenario %s failed", name)
            keep({"scenario": name, "setup": None, "rep": None, "failed": str(exc)})
        log.info("%s done in %.0f s", name, time.monotonic() - t0)
    runs = [r for r in records if "failed" not in r]
    failures = [r for r in records if "failed" in r]
    notes = [
        "Hit rate: the simulators' prefix-cache hit tokens / looked-up tokens over the run; "
        "imbalance: max/mean of requests each simulator finished; TTFT: client side. "
        "`in-flight seen`: the share of the gateway's in-flight requests a server process "
        "counted (sampled every 0.5 s; 1/N without sharing). Every group starts cold for its "
        "run; engine caches are reset and prompts salted per run.",
        _INDEX_NOTES[index],
    ]
    if failures:
        notes.append(
            "Failed runs (left out of the figures): "
            + "; ".join(
                f"{f['scenario']} {f['setup']} rep{f['rep']}: {f['failed']}" for f in failures
            )
        )
    rows = aggregate(runs)
    return {
        "scenario": "replicas" + ("-quick" if quick else ""),
        "description": __doc__.split("\n\n")[0],
        "machine": machine_info(),
        "started_unix": int(started),
        "wall_s": round(time.time() - started, 1),
        "config": {
            "quick": quick,
            "scenarios": list(scenarios),
            "reps": reps,
            "scale": scale,
            "strategies": {s: strategies[s] for s in scenarios},
            "index": index,
            "setups": [s.key for s in SETUPS],
            "hit_rate_tol": HIT_RATE_TOL,
            "imbalance_tol": IMBALANCE_TOL,
        },
        "summary": rows,
        "checks": checks(runs),
        "notes": notes,
        "failures": failures,
        "runs": runs,
    }


_INDEX_NOTES = {
    "auto": "Index: auto, as the scenarios run: exact from every pod's KV events, which each "
    "process reads itself; shared prefix-index blocks (for pods without KV events) stay idle, "
    "so sharing acts through in-flight load and engine metrics.",
    "approximate": "Index: approximate (no KV events): each process learns the prefix index "
    "from routing decisions, its own and, sharing, its peers'.",
}


def _strategies(items: Sequence[str]) -> dict[str, str]:
    out = dict(STRATEGIES)
    for item in items:
        name, sep, strategy = item.partition("=")
        if not sep or name not in SCENARIOS:
            raise SystemExit(f"--strategy wants SCENARIO=NAME with SCENARIO in {SCENARIOS}")
        out[name] = strategy
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.replicas",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="one scenario at its quick size (CI)")
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument("--scenarios", nargs="+", choices=SCENARIOS, help="default: all (quick: 1)")
    ap.add_argument(
        "--reps", type=int, help=f"repetitions per setup (default {FULL_REPS}; quick: {QUICK_REPS})"
    )
    ap.add_argument(
        "--scale", type=float, help=f"request count factor (default {FULL_SCALE}; quick: 1.0)"
    )
    ap.add_argument("--strategy", action="append", default=[], metavar="SCENARIO=NAME")
    ap.add_argument(
        "--index",
        choices=("auto", "approximate"),
        default="auto",
        help="prefix index: auto (KV events, as the scenarios) or approximate (no KV events)",
    )
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    reps = args.reps if args.reps is not None else (QUICK_REPS if args.quick else FULL_REPS)
    if reps < 1:
        raise SystemExit("--reps must be at least 1")
    name = "replicas" + ("-quick" if args.quick else "")
    out_dir = args.results / name
    out_dir.mkdir(parents=True, exist_ok=True)
    scenarios = args.scenarios or (QUICK_SCENARIOS if args.quick else SCENARIOS)
    scale = args.scale if args.scale is not None else (1.0 if args.quick else FULL_SCALE)
    partial = out_dir / "runs.jsonl"  # each run as it ends: a crash keeps what was measured
    partial.write_text("")

    def save(record: dict[str, Any]) -> None:
        with partial.open("a") as f:
            f.write(json.dumps(record, default=str) + "\n")

    result = run(
        quick=args.quick,
        scenarios=scenarios,
        reps=reps,
        scale=scale,
        strategies=_strategies(args.strategy),
        index=args.index,
        workdir=out_dir / "run",
        on_run=save,
    )
    table = markdown(result)
    text = json.dumps(result, indent=1, default=str) + "\n"
    (out_dir / "result.json").write_text(text)
    (out_dir / "table.md").write_text(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    print(table)
    log.info("done in %.0f s", result["wall_s"])
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
