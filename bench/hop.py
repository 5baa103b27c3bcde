"""The hop's CPU budget: our server against the bare floor and vllm-router, side by side.

    python -m bench.hop [--reps 3] [--quick] [--counts] [--profile SECONDS] [--kv]

One simulated cluster (4 fast simulators, bench/targets.py) and, over the same engines:

- `envoy-rr`   Envoy alone, round robin (the latency baseline);
- `floor`      the bare grpc.aio server of the same message pattern (bench/hop_servers.py) behind
               the same Envoy as the default: what any grpc.aio server of this shape costs here;
- `edge`       our protocol edge (ExtProcServer, processor, access-log records) with a handler
               that decides nothing: the edge's own cost above the floor;
- `default`    the server as shipped (least-request, BUFFERED, access-log accounting);
- `vllm-router-rr`  the Rust router, round robin.

Each repetition runs every variant at one connection and at saturation (32), in an order that
rotates. Per run: the server's CPU per request from /proc (idle CPU subtracted), split by
thread; context switches per request (voluntary and not, summed over the process's threads);
Envoy's ext_proc messages per request (its `stream_msgs_*` counters); latency against Envoy
alone in the same repetition. `--counts` adds a pass under `perf stat --per-thread` (loop
wake-ups as epoll waits, futex calls, wake-ups each thread causes, context switches);
`--profile S` a py-spy `--native` profile of the default server at saturation, folded into
the budget's causes. `--kv` adds kv-aware on 8k-token multi-turn prompts (CPU per request
with tokenization, requests per second per core). Results: bench/results/hop[-quick]/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.loadgen import Arrival, ArrivalKind, LoadGenerator
from bench.report import pyplot
from bench.scenario import _steal, machine_info
from bench.stats import summarize_records
from bench.targets import HOST, Cluster, FrontDoor, cpu_seconds
from bench.workloads import TextFactory, build_workload
from extproc.stack.envoy_config import RequestBodyMode, ResponseAccounting

__all__ = ["main", "thread_counts"]

log = logging.getLogger("bench.hop")
ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")
SERVER_HISTOGRAMS = ("extproc_routing_decision_seconds", "extproc_tokenization_seconds")


# -- /proc -------------------------------------------------------------------------------------


def _group(comm: str) -> str:
    """A thread's group by its name: the asyncio thread, gRPC's threads, the rest."""
    if comm.startswith(("python", "extproc")):
        return "loop"
    if comm.startswith(("grpc", "event_engine", "default-executo", "EventEngine")):
        return "grpc"
    return comm.split("-")[0].rstrip("0123456789") or "other"


def thread_counts(pid: int) -> dict[str, dict[str, float]]:
    """Per thread group: CPU seconds and voluntary/involuntary context switches (live threads)."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            stat = (task / "stat").read_text().rpartition(")")[2].split()
            status = (task / "status").read_text()
        except OSError:
            continue  # the thread ended between listing and reading
        g = out[_group(comm)]
        g["cpu_s"] += (int(stat[11]) + int(stat[12])) / TICK
        g["threads"] += 1
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches"):
                g["vcs"] += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches"):
                g["ivcs"] += int(line.split()[1])
    return {k: dict(v) for k, v in out.items()}


def _delta(
    before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]
) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for g, vals in after.items():
        b = before.get(g, {})
        out[g] = {k: v - b.get(k, 0.0) for k, v in vals.items() if k != "threads"}
        out[g]["threads"] = vals.get("threads", 0.0)
    return out


def _envoy_stats(admin_url: str) -> dict[str, float]:
    text = httpx.get(f"{admin_url}/stats", params={"filter": "ext_proc"}, timeout=5).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if value.strip().isdigit():
            out[name.rsplit(".", 1)[-1]] = out.get(name.rsplit(".", 1)[-1], 0.0) + float(value)
    return out


def _server_sums(urls: Sequence[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for url in urls:
        for line in httpx.get(url, timeout=5).text.splitlines():
            for h in SERVER_HISTOGRAMS:
                for suffix in ("_sum", "_count"):
                    if line.startswith(h + suffix):
                        out[h + suffix] = out.get(h + suffix, 0.0) + float(line.split()[-1])
    return out


# -- variants ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Door:
    door: FrontDoor
    admin_url: str | None  # the Envoy in front (for its ext_proc counters)
    idle_util: float  # the server's own CPU share with no traffic (subtracted)


def _admin_of(cluster: Cluster, door: FrontDoor) -> str | None:
    """The admin URL of the Envoy in front of `door` (from the bootstrap the cluster wrote)."""
    cfg = cluster.workdir / f"envoy-{door.name}.yaml"
    if not cfg.exists():
        return None
    sock = yaml.safe_load(cfg.read_text())["admin"]["address"]["socket_address"]
    return f"http://{sock['address']}:{sock['port_value']}"


def _idle(pids: Sequence[int], seconds: float = 2.0) -> float:
    before = sum(cpu_seconds(p) for p in pids)
    time.sleep(seconds)
    return (sum(cpu_seconds(p) for p in pids) - before) / seconds


def _reference_server(
    cluster: Cluster, kind: str, accounting: ResponseAccounting, *, one_message: bool = False
) -> FrontDoor:
    grpc_port, ready_port, listen, admin = cluster.ports(4)
    name = f"{kind}-1msg" if one_message else kind
    pid = cluster.spawn(
        f"hop-{name}",
        [
            sys.executable, "-m", "bench.hop_servers", kind, "--grpc-port", str(grpc_port),
            "--ready-port", str(ready_port), "--destinations", ",".join(cluster.sim_addresses),
        ],
        ready_url=f"http://{HOST}:{ready_port}/",
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    time.sleep(1.0)  # Envoy's health check must see it ready before traffic
    return cluster.envoy_for(
        name, [grpc_port], listen=listen, admin=admin, server_pids=(pid,),
        body_mode=RequestBodyMode.BUFFERED, accounting=accounting, one_message=one_message,
    )  # fmt: skip


def _app_server(
    cluster: Cluster, name: str, *, poll: bool, kv_events: bool, tree: Path | None = None
) -> FrontDoor:
    """One more server process as shipped, from the stack's config, with engine metrics
    polling and/or KV events left out (an endpoint without a metrics URL is always fresh;
    one without a KV-event socket is never indexed): the budget's items by difference. With
    `tree`, the server of another checkout (`--old-tree`: the former default beside the new)."""
    grpc_port, metrics_port, listen, admin = cluster.ports(4)
    cfg = cluster.stack.server_config()
    cfg.pop("sync", None)
    cfg["server"] = {**cfg["server"], "grpc_port": grpc_port, "metrics_port": metrics_port}
    for model in cfg["models"]:
        for ep in model["endpoints"]:
            if not poll:
                ep.pop("metrics_url", None)
            if not kv_events:
                ep.pop("kv_events", None)
                ep.pop("kv_replay", None)
    path = cluster.workdir / f"{name}-config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    pid = cluster.spawn(
        f"extproc-{name}",
        [sys.executable, "-m", "extproc", "serve", "--config", str(path)],
        ready_url=f"http://{HOST}:{metrics_port}/readyz",
        env=None if tree is None else {"PYTHONPATH": str(tree)},
        cwd=tree,
    )
    time.sleep(1.0)  # Envoy's health check must see it ready before traffic
    return cluster.envoy_for(
        name, [grpc_port], listen=listen, admin=admin, server_pids=(pid,),
        metrics_ports=[metrics_port],
    )  # fmt: skip


Builder = Callable[[Cluster], FrontDoor]

VARIANTS: dict[str, Builder] = {
    "envoy-rr": lambda c: c.envoy("baseline", baseline=True),
    "floor": lambda c: _reference_server(c, "floor", ResponseAccounting.ACCESS_LOG),
    "edge": lambda c: _reference_server(c, "edge", ResponseAccounting.ACCESS_LOG),
    "app-bare": lambda c: _app_server(c, "app-bare", poll=False, kv_events=False),
    "app-kv": lambda c: _app_server(c, "app-kv", poll=False, kv_events=True),
    "default": lambda c: c.envoy("default"),
    "floor-1msg": lambda c: _reference_server(
        c, "floor", ResponseAccounting.ACCESS_LOG, one_message=True
    ),
    "default-1msg": lambda c: c.envoy("default-1msg", one_message=True),
    "vllm-router-rr": lambda c: c.peer("vllm-router-rr", "round_robin"),
}
BASELINE, PEER = "envoy-rr", "vllm-router-rr"


# -- one run -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Load:
    name: str
    concurrency: int
    requests: int


def _workload(text: TextFactory, load: Load, salt: str, kv: bool) -> list[Any]:
    if kv:
        params = {
            "sessions": max(load.concurrency, load.requests // 4), "turns": 4,
            "system_tokens": 7000, "user_tokens": 250, "output_tokens": 8, "output_spread": 0.5,
        }  # fmt: skip
        return build_workload("multi_turn", params, text=text, seed=0, salt=salt)
    params = {"requests": load.requests, "prompt_tokens": 2000, "output_tokens": 8, "distinct": 64}
    return build_workload("fixed_chat", params, text=text, seed=0, salt=salt)


def _run(
    cluster: Cluster,
    name: str,
    d: Door,
    load: Load,
    rep: int,
    text: TextFactory,
    *,
    kv: bool = False,
    strategy: str | None = None,
    during: Callable[[int], Any] | None = None,
) -> dict[str, Any]:
    door = d.door
    convs = _workload(text, load, f"hop.{rep}.{load.name}.{name}", kv)
    cluster.wait_idle()
    pids = door.cpu_pids
    t0 = {p: thread_counts(p) for p in pids}
    cpu0 = sum(cpu_seconds(p) for p in pids)
    proxy0 = sum(cpu_seconds(p) for p in door.proxy_pids)
    env0 = _envoy_stats(d.admin_url) if d.admin_url else {}
    srv0 = _server_sums(door.metrics_urls) if door.metrics_urls else {}
    steal0 = _steal()
    headers = door.headers if strategy is None else (("routing-strategy", strategy),)
    gen = LoadGenerator(door.base_url, model="qwen3", extra_headers=headers, max_duration_s=120)
    side = during(pids[0]) if during is not None and pids else None
    result = asyncio.run(
        gen.run(convs, Arrival(kind=ArrivalKind.CLOSED, concurrency=load.concurrency))
    )
    extra = side() if side is not None else None
    steal1 = _steal()
    cpu1 = sum(cpu_seconds(p) for p in pids)
    proxy1 = sum(cpu_seconds(p) for p in door.proxy_pids)
    t1 = {p: thread_counts(p) for p in pids}
    env1 = _envoy_stats(d.admin_url) if d.admin_url else {}
    srv1 = _server_sums(door.metrics_urls) if door.metrics_urls else {}
    s = summarize_records(result.records, result.duration_s)
    n = max(1, s["ok"])
    cpu = cpu1 - cpu0 - d.idle_util * result.duration_s
    threads: dict[str, dict[str, float]] = {}
    for p in pids:
        for g, vals in _delta(t0[p], t1[p]).items():
            acc = threads.setdefault(g, {})
            for k, v in vals.items():
                acc[k] = acc.get(k, 0.0) + v
    row: dict[str, Any] = {
        "variant": name, "load": load.name, "rep": rep, "ok": s["ok"], "errors": s["errors"],
        "error_kinds": s["error_kinds"], "req_per_s": s["req_per_s"],
        "e2e_p50_ms": s["e2e_p50_ms"], "e2e_p99_ms": s["e2e_p99_ms"],
        "ttft_p50_ms": s["ttft_p50_ms"],
        "cpu_ms_per_req": round(cpu * 1000 / n, 4) if pids else None,
        "cpu_util": round((cpu1 - cpu0) / result.duration_s, 3) if pids else None,
        "envoy_cpu_ms_per_req": round((proxy1 - proxy0) * 1000 / n, 4) if door.proxy_pids else None,
        "cs_per_req": round(sum(t.get("vcs", 0) + t.get("ivcs", 0) for t in threads.values()) / n, 2)
        if pids else None,
        "threads": {
            g: {
                "cpu_ms_per_req": round(v.get("cpu_s", 0.0) * 1000 / n, 4),
                "vcs_per_req": round(v.get("vcs", 0.0) / n, 2),
                "ivcs_per_req": round(v.get("ivcs", 0.0) / n, 2),
                "threads": int(v.get("threads", 0)),
            }
            for g, v in sorted(threads.items())
        },
        "steal_pct": round(100 * (steal1[0] - steal0[0]) / max(1.0, steal1[1] - steal0[1]), 1),
    }  # fmt: skip
    if env1:
        for k in ("stream_msgs_sent", "stream_msgs_received", "streams_started"):
            row[f"envoy_{k}_per_req"] = round((env1.get(k, 0) - env0.get(k, 0)) / n, 3)
    if srv1:
        for h in SERVER_HISTOGRAMS:
            cnt = srv1.get(h + "_count", 0) - srv0.get(h + "_count", 0)
            if cnt > 0:
                row[h.replace("extproc_", "") + "_ms_mean"] = round(
                    (srv1[h + "_sum"] - srv0.get(h + "_sum", 0)) * 1000 / cnt, 4
                )
    if extra is not None:
        row["counts"] = extra
    log.info(
        "rep%d %-11s %-15s ok=%d/%d %6.1f req/s e2e p50 %s ms cpu %s ms/req cs %s/req",
        rep, load.name, name, s["ok"], s["requests"], s["req_per_s"] or 0, s["e2e_p50_ms"],
        row["cpu_ms_per_req"], row["cs_per_req"],
    )  # fmt: skip
    return row


# -- perf stat and py-spy ------------------------------------------------------------------------

PERF_EVENTS = (
    "task-clock", "context-switches", "syscalls:sys_enter_epoll_wait",
    "syscalls:sys_enter_epoll_pwait", "syscalls:sys_enter_futex", "sched:sched_wakeup",
    "syscalls:sys_enter_write", "syscalls:sys_enter_read", "syscalls:sys_enter_sendmsg",
    "syscalls:sys_enter_recvmsg",
)  # fmt: skip


def perf_counts(out_dir: Path) -> Callable[[int], Callable[[], dict[str, dict[str, float]]]]:
    """A side-car for `_run`: `perf stat --per-thread` on the server while the load runs; its
    counts summed by thread group (raw, divide by the run's requests)."""

    def start(pid: int) -> Callable[[], dict[str, dict[str, float]]]:
        path = out_dir / f"perf-{pid}-{time.time_ns()}.csv"
        proc = subprocess.Popen(
            ["perf", "stat", "--per-thread", "-x", ";", "-o", str(path), "-e", ",".join(PERF_EVENTS),
             "-p", str(pid)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(0.3)

        def stop() -> dict[str, dict[str, float]]:
            proc.send_signal(signal.SIGINT)
            proc.wait(10)
            out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
            for line in path.read_text().splitlines():
                parts = line.split(";")
                if len(parts) < 4 or not parts[0] or line.startswith("#"):
                    continue
                comm = parts[0].rsplit("-", 1)[0]
                with contextlib.suppress(ValueError):
                    out[_group(comm)][parts[3].split(":")[-1]] += float(parts[1])
            return {g: dict(v) for g, v in out.items()}

        return stop

    return start


# Where a sample's time goes. `ENTRIES`: the work it belongs to, the first pattern (in this
# order) that matches any frame of its stack; `LEAVES`: what runs, the innermost frame that
# matches. Frames look like `function (path/file.py:line)` (py-spy --native adds C frames).
ENTRIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("decision (Director.route)", re.compile(r"(^|\.)route \(extproc/director/director\.py")),
    ("accounting (Director.account)", re.compile(r"(^|\.)account \(extproc/director/director\.py")),
    ("KV events (indexing)", re.compile(r"extproc/(kvevents|kvcache)/")),
    ("metrics polling", re.compile(r"extproc/metrics/")),
    ("replica sync", re.compile(r"extproc/sync/")),
    ("admin / status", re.compile(r"extproc/admin/")),
    ("access-log stream (server/accesslog.py)", re.compile(r"server/accesslog\.py")),
    ("edge: processor (parse, encode)", re.compile(r"server/processor\.py")),
    ("edge: stream handler (service.py)", re.compile(r"server/service\.py")),
)
LEAVES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("prometheus_client", re.compile(r"prometheus_client/")),
    ("logging", re.compile(r"/logging/")),
    ("protobuf", re.compile(r"google/protobuf|_upb|upb_")),
    ("json (orjson)", re.compile(r"orjson")),
    ("our Python", re.compile(r"extproc/")),
    ("grpc aio (Cython and core)", re.compile(r"grpc|cygrpc")),
    ("event loop (uvloop, asyncio)", re.compile(r"uvloop|asyncio/|uv__|libuv")),
    ("CPython", re.compile(r"libpython|python3|_Py|Py[A-Z]")),
)


def fold_profile(raw: str) -> dict[str, Any]:
    """py-spy `--format raw --threads --native` folded by work (ENTRIES), by what ran (LEAVES)
    and by thread; shares of all samples (idle samples excluded)."""
    entries: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        leaf = frames[-1] if frames else ""
        if re.search(
            r"epoll_wait|epoll_pwait|poll \(|futex_wait|__GI___poll|pthread_cond_wait|sem_wait",
            leaf,
        ):
            continue  # a thread waiting: not CPU
        n = int(count)
        total += n
        threads[re.sub(r"\s*\(.*", "", frames[0])] += n
        entry = next(
            (name for name, rx in ENTRIES if any(rx.search(f) for f in frames)),
            "grpc/loop machinery outside our handlers",
        )
        entries[entry] += n
        what = "other native"
        for frame in reversed(frames):
            hit = next((name for name, rx in LEAVES if rx.search(frame)), None)
            if hit is not None:
                what = hit
                break
        leaves[what] += n

    def share(c: Counter[str]) -> dict[str, float]:
        return {k: round(v / max(1, total), 4) for k, v in c.most_common()}

    return {"samples": total, "by_work": share(entries), "by_code": share(leaves),
            "by_thread": share(threads)}  # fmt: skip


def _profile(
    cluster: Cluster, d: Door, text: TextFactory, seconds: float, out_dir: Path
) -> dict[str, Any]:
    pid = d.door.cpu_pids[0]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "profile.txt"
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "py-spy"), "record", "--native", "--threads",
         "--format", "raw", "-r", "250", "-d", str(int(seconds)), "-o", str(path), "-p", str(pid)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    sizes = {
        a: len(httpx.get(f"http://{a}/metrics", timeout=5).content) for a in cluster.sim_addresses
    }
    log.info("simulator /metrics sizes before the profile: %s", sizes)
    load = Load("profile", 16, int(seconds * 200))
    convs = _workload(text, load, "hop.profile", False)
    gen = LoadGenerator(d.door.base_url, model="qwen3", max_duration_s=seconds)
    asyncio.run(gen.run(convs, Arrival(kind=ArrivalKind.CLOSED, concurrency=16)))
    proc.wait(60)
    sizes = {
        a: len(httpx.get(f"http://{a}/metrics", timeout=5).content) for a in cluster.sim_addresses
    }
    log.info("simulator /metrics sizes after the profile: %s", sizes)
    return fold_profile(path.read_text()) if path.exists() else {}


# -- aggregation and report ----------------------------------------------------------------------


def _median(rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    vals = [float(r[key]) for r in rows if r.get(key) is not None]
    return round(statistics.median(vals), 4) if vals else None


def aggregate(runs: Sequence[Mapping[str, Any]], peer: str = PEER) -> list[dict[str, Any]]:
    """Medians over repetitions per (load, variant); ratios and added latency per repetition
    first (against the peer's CPU and Envoy alone's latency in the same repetition)."""
    out = []
    keys = sorted({(r["load"], r["variant"]) for r in runs}, key=lambda k: (k[0], k[1]))
    for load, variant in keys:
        mine = [r for r in runs if r["load"] == load and r["variant"] == variant]
        row: dict[str, Any] = {"load": load, "variant": variant, "reps": len(mine)}
        for k in ("req_per_s", "e2e_p50_ms", "ttft_p50_ms", "cpu_ms_per_req", "envoy_cpu_ms_per_req",
                  "cs_per_req", "envoy_stream_msgs_sent_per_req", "envoy_stream_msgs_received_per_req",
                  "routing_decision_seconds_ms_mean", "tokenization_seconds_ms_mean", "steal_pct"):  # fmt: skip
            row[k] = _median(mine, k)
        row["cpu_ms_per_req_all"] = [r.get("cpu_ms_per_req") for r in mine]
        ratios, added = [], []
        for r in mine:
            other = next((p for p in runs if p["load"] == load and p["rep"] == r["rep"]
                          and p["variant"] == peer), None)  # fmt: skip
            base = next((p for p in runs if p["load"] == load and p["rep"] == r["rep"]
                         and p["variant"] == BASELINE), None)  # fmt: skip
            if other and other.get("cpu_ms_per_req") and r.get("cpu_ms_per_req") is not None:
                ratios.append(r["cpu_ms_per_req"] / other["cpu_ms_per_req"])
            if base and base.get("e2e_p50_ms") is not None and r.get("e2e_p50_ms") is not None:
                added.append(r["e2e_p50_ms"] - base["e2e_p50_ms"])
        row["cpu_vs_peer"] = round(statistics.median(ratios), 3) if ratios else None
        cpu = row["cpu_ms_per_req"]
        row["req_per_s_per_core"] = round(1000 / cpu, 1) if cpu else None
        row["added_p50_ms"] = round(statistics.median(added), 3) if added else None
        groups: dict[str, list[float]] = defaultdict(list)
        for r in mine:
            for g, v in r.get("threads", {}).items():
                groups[f"{g} cpu"].append(v["cpu_ms_per_req"])
                groups[f"{g} cs"].append(v["vcs_per_req"] + v["ivcs_per_req"])
        row["threads"] = {g: round(statistics.median(v), 3) for g, v in sorted(groups.items())}
        out.append(row)
    return out


def markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    head = ("| load | variant | server CPU ms/req | x vllm-router | reps | added p50 ms | req/s | "
            "cs/req | loop CPU ms/req | gRPC threads CPU ms/req | Envoy msgs out/in per req | "
            "decision ms | Envoy CPU ms/req |\n|" + "---|" * 13 + "\n")  # fmt: skip
    lines = []
    for r in rows:
        t = r.get("threads", {})
        msgs = (
            f"{r['envoy_stream_msgs_sent_per_req']:.2f} / {r['envoy_stream_msgs_received_per_req']:.2f}"
            if r.get("envoy_stream_msgs_sent_per_req") is not None else "-"
        )  # fmt: skip
        lines.append(
            f"| {r['load']} | {r['variant']} | {r['cpu_ms_per_req'] if r['cpu_ms_per_req'] is not None else '-'} | "
            f"{r['cpu_vs_peer'] or '-'} | {', '.join(str(x) for x in r['cpu_ms_per_req_all'])} | "
            f"{r['added_p50_ms']} | {r['req_per_s']} | {r['cs_per_req'] or '-'} | {t.get('loop cpu', '-')} | "
            f"{t.get('grpc cpu', '-')} | {msgs} | {r.get('routing_decision_seconds_ms_mean') or '-'} | "
            f"{r['envoy_cpu_ms_per_req'] or '-'} |"
        )  # fmt: skip
    return head + "\n".join(lines) + "\n"


# The budget: each item is the difference of two variants' medians (same run, same loads).
BUDGET_ITEMS = (
    ("bare grpc.aio floor, same messages", None, "floor"),
    ("protocol edge (processor, service, access-log records)", "floor", "edge"),
    ("director (decision, accounting, leases, metrics)", "edge", "app-bare"),
    ("KV-event indexing", "app-bare", "app-kv"),
    ("engine metrics polling", "app-kv", "default"),
)


def _served_cpu(rows: Sequence[Mapping[str, Any]], load: str) -> dict[str, float | None]:
    """CPU per request of the variants that served requests (a failed one has no budget)."""
    return {
        r["variant"]: r["cpu_ms_per_req"]
        for r in rows
        if r["load"] == load and r.get("req_per_s", 1) != 0
    }


def budget(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per load: the budget's items (ms per request), the default's total, the peer's, and
    the one-message and former-default totals beside them."""
    out: dict[str, list[dict[str, Any]]] = {}
    for load in sorted({r["load"] for r in rows}):
        cpu = _served_cpu(rows, load)
        items: list[dict[str, Any]] = []
        ladder = list(BUDGET_ITEMS)
        if cpu.get("app-kv") is None:  # not run: KV indexing and polling as one item
            ladder[3:] = [("KV-event indexing + engine metrics polling", "app-bare", "default")]
        for label, lower, upper in ladder:
            if cpu.get(upper) is None or (lower is not None and cpu.get(lower) is None):
                continue
            value = cpu[upper] - (cpu[lower] if lower is not None else 0.0)
            items.append({"item": label, "ms": round(value, 3)})
        for label, name in (
            ("total: default", "default"),
            ("total: default, one message each way", "default-1msg"),
            ("total: former default (before this work)", "old-default"),
            ("floor, one message each way", "floor-1msg"),
            ("vllm-router round_robin", PEER),
        ):
            if cpu.get(name) is not None:
                items.append({"item": label, "ms": round(cpu[name], 3)})
        out[load] = items
    return out


def plot_budget(result: Mapping[str, Any], path: Path) -> None:
    """Per load: the default's items stacked, and the other totals (one message each way, the
    former default, the floor with one message, the peer) as bars beside it."""
    plt = pyplot()

    by_load = budget(result["summary"])
    if not by_load:
        return
    fig, axes = plt.subplots(1, len(by_load), figsize=(6.5 * len(by_load), 4.4), squeeze=False)
    colors = ("#9e9e9e", "#64b5f6", "#1976d2", "#ffb74d", "#e57373")
    for ax, (load, items) in zip(axes[0], by_load.items(), strict=True):
        ladder = [i for i in items if not i["item"].startswith(("total", "floor,", "vllm"))]
        others = [i for i in items if i not in ladder and i["item"] != "total: default"]
        labels: list[str] = []
        if ladder:
            bottom = 0.0
            for item, color in zip(ladder, colors, strict=False):
                ax.bar(0, item["ms"], bottom=bottom, color=color, label=item["item"])
                bottom += item["ms"]
            labels.append("default")
        for item in others:
            peer = item["item"].startswith("vllm")
            ax.bar(len(labels), item["ms"], color="#4caf50" if peer else "#bdbdbd")
            labels.append(item["item"].removeprefix("total: "))
        ax.set_xticks(range(len(labels)), labels, rotation=18, ha="right", fontsize=7)
        ax.set_ylabel("server CPU ms per request")
        ax.set_title(f"hop budget, {load} (median of repetitions)")
        if ladder:
            ax.legend(fontsize=6.5, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def budget_markdown(result: Mapping[str, Any]) -> str:
    parts = []
    for load, items in budget(result["summary"]).items():
        parts.append(f"**{load}**\n\n| item | ms per request |\n|---|---|")
        parts += [f"| {i['item']} | {i['ms']} |" for i in items]
        parts.append("")
    return "\n".join(parts)


# -- main ----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.hop", description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="fewer requests per run (a smoke run)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--counts", action="store_true", help="one more pass under perf stat")
    p.add_argument("--profile", type=float, default=0.0, help="py-spy --native, seconds")
    p.add_argument("--kv", action="store_true", help="kv-aware on 8k-token multi-turn prompts")
    p.add_argument(
        "--report",
        type=Path,
        default=None,
        help="no run: re-render the tables and the plot from this result.json",
    )
    p.add_argument("--plot", type=Path, default=None, help="also write the budget plot here")
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    p.add_argument(
        "--old-tree",
        type=Path,
        default=None,
        help="another checkout (e.g. `git archive` of a former commit): adds `old-default`, "
        "its server as shipped, beside the new",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.report is not None:
        done = json.loads(args.report.read_text())
        print(markdown(done["summary"]))
        print(budget_markdown(done))
        if "kv_summary" in done:
            print(markdown(done["kv_summary"]))
        if args.plot is not None:
            plot_budget(done, args.plot)
        return 0
    if args.counts and shutil.which("perf") is None:
        p.error("--counts needs `perf` (linux-tools; run as root or with perf_event_paranoid <= 1)")
    out_dir = args.results / ("hop-quick" if args.quick else "hop")
    out_dir.mkdir(parents=True, exist_ok=True)
    scale = 0.4 if args.quick else 1.0
    loads = (Load("1-connection", 1, int(300 * scale)), Load("saturation", 32, int(800 * scale)))
    names = args.variants.split(",")
    if args.old_tree is not None:
        tree = args.old_tree.resolve()
        VARIANTS["old-default"] = lambda c: _app_server(
            c, "old-default", poll=True, kv_events=True, tree=tree
        )
        if "old-default" not in names:
            names.insert(names.index("default") if "default" in names else 0, "old-default")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    started = time.time()
    steal0 = _steal()
    cluster = Cluster(
        workdir=out_dir / "run", sims=4, sim_args=("--time-scale", "0.001"),
        strategy="least-request", repo_root=ROOT,
    )  # fmt: skip
    text = TextFactory.qwen(0)
    runs: list[dict[str, Any]] = []
    extras: dict[str, Any] = {}
    with cluster:
        doors: dict[str, Door] = {}
        for name in names:
            door = VARIANTS[name](cluster)
            idle = _idle(door.cpu_pids) if door.kind == "extproc" else 0.0
            doors[name] = Door(door, _admin_of(cluster, door), idle)
        log.info(
            "idle CPU share subtracted: %s", {n: round(d.idle_util, 4) for n, d in doors.items()}
        )
        for rep in range(args.reps):
            for load in loads:
                order = names[rep % len(names) :] + names[: rep % len(names)]
                for name in order:
                    runs.append(_run(cluster, name, doors[name], load, rep, text))
        if args.counts:
            counter = perf_counts(out_dir)
            for load in loads:
                for name in names:
                    if doors[name].door.cpu_pids:
                        row = _run(cluster, name, doors[name], load, -1, text, during=counter)
                        extras.setdefault("counts", []).append(row)
        for name in ("edge", "app-bare", "default") if args.profile else ():
            if name in doors:
                prof = _profile(cluster, doors[name], text, args.profile, out_dir / name)
                extras.setdefault("profile", {})[name] = prof
                log.info("profile of %s: %s", name, prof)
        if args.kv and "default" in doors:
            kv_load = Load("kv-8k", 8, int(160 * scale))
            for rep in range(args.reps):
                for name, strategy in (("default", "kv-aware"), (PEER, None)):
                    if name in doors:
                        row = _run(cluster, f"{name}:{strategy or 'rr'}", doors[name], kv_load, rep,
                                   text, kv=True, strategy=strategy)  # fmt: skip
                        extras.setdefault("kv", []).append(row)
    steal1 = _steal()
    rows = aggregate(runs)
    result = {
        "machine": machine_info(),
        "started_unix": int(started),
        "wall_s": round(time.time() - started, 1),
        "steal_pct_overall": round(
            100 * (steal1[0] - steal0[0]) / max(1.0, steal1[1] - steal0[1]), 1
        ),
        "command": "python -m bench.hop " + " ".join(argv if argv is not None else sys.argv[1:]),
        "idle_util": {n: d.idle_util for n, d in doors.items()},
        "summary": rows,
        "runs": runs,
        **extras,
    }
    if "kv" in extras:
        result["kv_summary"] = aggregate(extras["kv"], peer=f"{PEER}:rr")
    (out_dir / "result.json").write_text(json.dumps(result, indent=1, default=str))
    result["budget"] = budget(rows)
    (out_dir / "result.json").write_text(json.dumps(result, indent=1, default=str))
    (out_dir / "table.md").write_text(markdown(rows) + "\n" + budget_markdown(result))
    plot_budget(result, out_dir / "hop-budget.png")
    if args.plot is not None:
        plot_budget(result, args.plot)
    print(markdown(rows))
    print(budget_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
