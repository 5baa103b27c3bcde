"""One gateway for a fleet: the server's cost over `pools` models of `pods` engines each, idle
and under a load spread unevenly over the pools (issue 36).

The simulators (vLLM 0.33-sized /metrics pages, ~490 lines) run in `--sim-procs` processes
(`extproc sim --fleet`), each endpoint on its own port; one ext_proc server routes over them,
behind Envoy (tests/e2e/fleet_stack.py). Every pool names the same tokenizer file. Windows:

- idle: no requests; the server only keeps its view of the engines fresh;
- load: open-loop Poisson arrivals at `--rate` requests/s, `--hot-share` of them on the first
  `--hot` pools, the rest spread over every other pool (short chats, 8 output tokens);
- staleness (same load, after the load window): the age of each pod's engine figures, sampled
  from /debug/endpoints every second, for busy and idle pods apart.

Per window: the server's CPU (utime+stime from /proc per wall second), engine scrapes/s (the
server's `extproc_metrics_scrapes_total`), CPU per scrape (CPU / scrapes: an upper bound, all
of the window's work divided by scrapes), RSS, the series on the server's /metrics, and the
decision latency as Envoy saw it (its ext_proc filter's request-body call, from the access log),
p50/p99 per pool (hot pools each, cold pools together).

    flock /tmp/heavy.lock .venv/bin/python bench/fleet.py --pools 10 --pods 10 \\
        [--window 20] [--rate 20] [--hot 3] [--sim-procs 2] [--json out.json] [--label now]

`--memory`: no simulators, no traffic; the server started in this process for the same shape
(nothing listens at the endpoints), RSS after each step: the app (one shared tokenizer not
loaded yet), the tokenizer
loaded, every endpoint's engine figures stored, every pool's exact KV index filled with each
pod's whole cache (`--blocks-per-pod` distinct blocks of 16 tokens, chained as an engine
stores them). Per endpoint and per pool figures are the slope between two shapes.

    .venv/bin/python bench/fleet.py --memory --pools 100 --pods 10 [--blocks-per-pod 8192]

Figures go to docs/benchmarks.md (the fleet table).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.report import pyplot  # noqa: E402
from bench.stats import percentile  # noqa: E402
from extproc.config import MetricsConfig  # noqa: E402
from extproc.metrics.parse import parse  # noqa: E402
from extproc.stack.local import StackOptions  # noqa: E402
from tests.e2e.fleet_stack import FleetShape, FleetStack, access_records  # noqa: E402
from tests.e2e.many_sims import port_is_free  # noqa: E402

WORDS = [
    "router",
    "cache",
    "token",
    "engine",
    "prefix",
    "block",
    "queue",
    "batch",
    "decode",
    "tensor",
    "kernel",
    "model",
    "pool",
    "replica",
    "shard",
    "stream",
    "window",
    "budget",
    "latency",
    "fleet",
]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_base(size: int) -> int:
    """A free block of `size` ports (simulators, then KV ports, then the stack's 40)."""
    for base in range(20000, 32768 - size, 500):
        if all(port_is_free(base + i) for i in range(0, size, 7)) and all(
            port_is_free(base + size - 40 + i) for i in range(40)
        ):
            return base
    raise SystemExit("no free port block for the fleet")


class Server:
    """The server process's figures, read from /proc and its /metrics."""

    def __init__(self, stack: FleetStack) -> None:
        self.stack = stack
        o = stack.options
        self.url = f"http://{o.host}:{o.metrics_port}"
        self.pid = stack.pid("extproc-0")

    def exposition(self) -> tuple[float, int, dict[str, int]]:
        """Scrapes counted so far, the number of series on /metrics, and the families with
        the most series."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        result = parse(text)
        scrapes = sum(s.value for s in result.samples if s.name == "extproc_metrics_scrapes_total")
        families: defaultdict[str, int] = defaultdict(int)
        for sample in result.samples:
            base = sample.name
            for suffix in ("_bucket", "_count", "_sum", "_created", "_total"):
                if base.endswith(suffix):
                    base = base[: -len(suffix)]
                    break
            families[base] += 1
        top = dict(sorted(families.items(), key=lambda kv: -kv[1])[:8])
        return scrapes, len(result.samples), top

    def endpoints(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = httpx.get(
            f"{self.url}/debug/endpoints", headers=self.stack.options.admin_headers(), timeout=30
        ).json()
        return rows


class Load:
    """Open-loop Poisson arrivals in a thread of its own (its own event loop)."""

    def __init__(self, base_url: str, pools: list[str], hot: int, hot_share: float, rate: float):
        self.base_url = base_url
        self.pools = pools
        self.hot = pools[:hot]
        self.cold = pools[hot:]
        self.hot_share = hot_share if self.cold else 1.0
        self.rate = rate
        self.ok: defaultdict[str, int] = defaultdict(int)
        self.failed: defaultdict[str, int] = defaultdict(int)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def pick(self, rng: random.Random) -> str:
        if self.hot and rng.random() < self.hot_share:
            return rng.choice(self.hot)
        return rng.choice(self.cold or self.hot)

    def start(self) -> None:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=120)

    async def _one(self, http: httpx.AsyncClient, pool: str, rng: random.Random) -> None:
        words = " ".join(rng.choices(WORDS, k=rng.randint(50, 300)))
        try:
            r = await http.post(
                f"{self.base_url}/v1/chat/completions",
                json={"model": pool, "messages": [{"role": "user", "content": words}],
                      "max_tokens": 8},
            )  # fmt: skip
            if r.status_code == 200:
                self.ok[pool] += 1
            else:
                self.failed[pool] += 1
                if len(self.errors) < 20:
                    self.errors.append(f"{pool}: {r.status_code} {r.text[:200]}")
        except httpx.HTTPError as exc:
            self.failed[pool] += 1
            if len(self.errors) < 20:
                self.errors.append(f"{pool}: {type(exc).__name__} {exc}")

    async def _run(self) -> None:
        rng = random.Random(7)
        tasks: set[asyncio.Task[None]] = set()
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http:
            next_at = time.monotonic()
            while not self._stop.is_set():
                next_at += rng.expovariate(self.rate)
                delay = next_at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(self._one(http, self.pick(rng), rng))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.wait(tasks, timeout=60)


def quantiles(values: list[float]) -> dict[str, float | None]:
    p50, p99 = percentile(values, 50), percentile(values, 99)
    return {
        "n": len(values),
        "p50_ms": None if p50 is None else round(p50 / 1000, 3),
        "p99_ms": None if p99 is None else round(p99 / 1000, 3),
    }


def decisions(
    records: list[dict[str, Any]],
    span: tuple[float, float],
    pool_of: dict[str, str],
    hot: list[str],
) -> Any:
    """Decision latency (Envoy's ext_proc request-body call) per hot pool and for cold ones,
    over the requests that started within `span` (wall clock)."""
    by_pool: defaultdict[str, list[float]] = defaultdict(list)
    for rec in records:
        started = rec.get("time")
        if not isinstance(started, str):
            continue
        at = datetime.datetime.fromisoformat(started.replace("Z", "+00:00")).timestamp()
        if not span[0] <= at <= span[1]:
            continue
        pool = pool_of.get(str(rec.get("upstream") or ""))
        body = rec.get("extproc_body_us")
        if pool is None or body in (None, "-", ""):
            continue
        with_header = float(body) + float(rec.get("extproc_header_us") or 0)
        by_pool[pool if pool in hot else "cold"].append(with_header)
    out = {p: quantiles(by_pool[p]) for p in hot}
    out["cold"] = quantiles(by_pool["cold"])
    return out


def window(
    stack: FleetStack, server: Server, seconds: float, load: Load | None, hot: list[str]
) -> dict[str, Any]:
    scrapes0, _, _ = server.exposition()
    sims = {n: stack.pid(n) for n in stack.sim_names()}
    sims0 = sum(cpu_seconds(p) for p in sims.values())
    ok0 = sum(load.ok.values()) if load else 0
    failed0 = sum(load.failed.values()) if load else 0
    cpu0, t0, wall0 = cpu_seconds(server.pid), time.monotonic(), time.time()
    time.sleep(seconds)
    cpu1, t1, wall1 = cpu_seconds(server.pid), time.monotonic(), time.time()
    sims1 = sum(cpu_seconds(p) for p in sims.values())
    scrapes1, series, families = server.exposition()
    wall = t1 - t0
    cpu = (cpu1 - cpu0) / wall
    rate = (scrapes1 - scrapes0) / wall
    out: dict[str, Any] = {
        "wall_s": round(wall, 2),
        "server_cpu": round(cpu, 3),
        "scrapes_per_s": round(rate, 1),
        "cpu_ms_per_scrape": round(1000 * cpu / rate, 3) if rate else None,
        "rss_mib": round(rss_mib(server.pid), 1),
        "series": series,
        "series_top": families,
        "sims_cpu": round((sims1 - sims0) / wall, 3),
    }
    if load is not None:
        out["requests_per_s"] = round((sum(load.ok.values()) - ok0) / wall, 2)
        out["failed"] = sum(load.failed.values()) - failed0
        out["span"] = (wall0, wall1)  # decisions are read from Envoy's log once it is flushed
    return out


def staleness(server: Server, seconds: float, hot: list[str]) -> dict[str, Any]:
    """Ages of the engine figures of hot pools' pods and of the others, sampled each second."""
    ages: dict[str, list[float]] = {"hot": [], "cold": []}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for row in server.endpoints():
            age = row.get("metrics_age_s")
            if age is not None:
                ages["hot" if row["model"] in hot else "cold"].append(float(age))
        time.sleep(1.0)
    return {
        k: {
            "n": len(v),
            "p50_s": round(statistics.median(v), 3) if v else None,
            "p99_s": round(percentile(v, 99) or 0.0, 3) if v else None,
            "max_s": round(max(v), 3) if v else None,
        }
        for k, v in ages.items()
    }


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    n = args.pools * args.pods
    base = port_base(n * (3 if args.kv_events else 1) + 40)
    shape = FleetShape(
        pools=args.pools,
        pods=args.pods,
        base_port=base,
        sim_processes=args.sim_procs,
        kv_events=args.kv_events,
    )
    stack_base = base + shape.ports_used
    opts = StackOptions(
        workdir=workdir,
        listen_port=stack_base,
        admin_port=stack_base + 1,
        grpc_port=stack_base + 2,
        metrics_port=stack_base + 6,
        nats_port=stack_base + 10,
        strategy=args.strategy,
        log_level="warning",
        # The product's idle pace (the local stack reads idle pods every 2 s, having no
        # Kubernetes to remove dead ones); --server-config may still set another.
        server_config={
            "metrics": {"idle_poll_interval_s": MetricsConfig().idle_poll_interval_s},
            **(json.loads(args.server_config) if args.server_config else {}),
        },
    )
    pools = [shape.pool_name(j) for j in range(args.pools)]
    hot = pools[: args.hot]
    with FleetStack(opts, shape, sim_args=("--time-scale", str(args.time_scale))) as stack:
        server = Server(stack)
        time.sleep(args.settle)
        result: dict[str, Any] = {
            "label": args.label,
            "pools": args.pools,
            "pods": args.pods,
            "endpoints": n,
            "sim_processes": min(args.sim_procs, args.pools),
            "rss_start_mib": round(rss_mib(server.pid), 1),
        }
        result["idle"] = window(stack, server, args.window, None, hot)
        print(json.dumps({"idle": result["idle"]}), flush=True)
        if args.rate > 0:
            load = Load(stack.base_url, pools, args.hot, args.hot_share, args.rate)
            load.start()
            try:
                time.sleep(3.0)  # the load's first seconds: connections, first scrapes
                result["load"] = window(stack, server, args.window, load, hot)
                print(json.dumps({"load": result["load"]}), flush=True)
                if args.staleness > 0:
                    result["staleness"] = staleness(server, args.staleness, hot)
            finally:
                load.stop()
            result["load"]["failed_total"] = sum(load.failed.values())
            result["load"]["errors"] = load.errors[:5]
    if "load" in result:  # Envoy flushed its access log when it stopped
        records, _ = access_records(stack.envoy_log())
        span = result["load"].pop("span")
        result["load"]["decision"] = decisions(records, span, shape.pool_of(), hot)
    return result


def memory(args: argparse.Namespace) -> dict[str, Any]:
    """RSS of the server's parts for `pools` x `pods`, built in this process (see --memory)."""
    import gc

    import yaml

    from extproc.app import App
    from extproc.config import load_config_text
    from extproc.types import EngineMetrics

    shape = FleetShape(pools=args.pools, pods=args.pods, base_port=20000)
    cfg = {
        "server": {"grpc_port": free_port(), "metrics_port": free_port()},
        "models": [shape.model_config(j) for j in range(args.pools)],
    }
    gc.collect()
    pid = os.getpid()
    out: dict[str, Any] = {"label": args.label, "pools": args.pools, "pods": args.pods}
    out["rss_imports_mib"] = round(rss_mib(pid), 1)

    async def build() -> dict[str, Any]:
        app = App(load_config_text(yaml.safe_dump(cfg)))
        # Started as `extproc serve` starts it (gRPC and admin servers, poller, loops); nothing
        # listens at the endpoints, so their scrapes are refused and they stay unready.
        await app.start()
        gc.collect()
        out["rss_app_mib"] = round(rss_mib(pid), 1)
        await app.tokenizers.warm()
        gc.collect()
        out["distinct_tokenizers"] = app.tokenizers.loaded_count()
        out["rss_tokenizers_mib"] = round(rss_mib(pid), 1)
        now = time.monotonic()
        for ep in app.store.endpoints():
            app.store.record_success(
                ep,
                EngineMetrics(
                    updated_at=now, running=1, waiting=0, kv_cache_usage=0.5,
                    prefix_cache_hits=1e6, prefix_cache_queries=2e6, prompt_tokens_total=3e6,
                    generation_tokens_total=1e6, ttft_avg_s=0.1, itl_avg_s=0.01,
                    block_size=16, num_gpu_blocks=args.blocks_per_pod,
                ),
            )  # fmt: skip
        gc.collect()
        out["rss_endpoints_mib"] = round(rss_mib(pid), 1)
        rng = random.Random(1)
        t0 = time.perf_counter()
        entries = 0
        for model, index in app.exact_indexes.items():
            for ep in app.store.endpoints(model):
                parent: int | None = None
                for start in range(0, args.blocks_per_pod, 16):
                    n = min(16, args.blocks_per_pod - start)
                    hashes = [rng.getrandbits(63) for _ in range(n)]
                    tokens = [rng.randrange(150000) for _ in range(16 * n)]
                    index.stored(ep.address, hashes, parent, tokens)
                    parent = hashes[-1]
            entries += index.stats().entries
        gc.collect()
        out["index_entries"] = entries
        out["index_fill_s"] = round(time.perf_counter() - t0, 1)
        out["index_bytes_estimate_mib"] = round(
            sum(i.stats().bytes_estimate for i in app.exact_indexes.values()) / 2**20, 1
        )
        out["rss_full_index_mib"] = round(rss_mib(pid), 1)
        await app.stop()
        return out

    return asyncio.run(build())


def plot(rows_path: Path, out: Path) -> None:
    """Server CPU and RSS against endpoints, idle and loaded, for each label in the file."""
    plt = pyplot()

    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    runs = [r for r in rows if "idle" in r]
    fig, (cpu_ax, rss_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for label in sorted({r["label"] for r in runs}):
        mine = sorted((r for r in runs if r["label"] == label), key=lambda r: r["endpoints"])
        if len(mine) < 2:
            continue  # a single shape is no line (a variant measured once)
        x = [r["endpoints"] for r in mine]
        cpu_ax.plot(x, [r["idle"]["server_cpu"] for r in mine], "o-", label=f"{label}, idle")
        loaded = [(r["endpoints"], r["load"]["server_cpu"]) for r in mine if "load" in r]
        if loaded:
            cpu_ax.plot(*zip(*loaded, strict=True), "s--", label=f"{label}, loaded")
        rss_ax.plot(x, [r["idle"]["rss_mib"] for r in mine], "o-", label=label)
    cpu_ax.set(xlabel="endpoints (pools of 10)", ylabel="server CPU (cores)", ylim=(0, None))
    rss_ax.set(xlabel="endpoints (pools of 10)", ylabel="server RSS (MiB)", ylim=(0, None))
    for ax in (cpu_ax, rss_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("One gateway for a fleet: cost against endpoints (bench/fleet.py)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pools", type=int, default=10)
    ap.add_argument("--pods", type=int, default=10)
    ap.add_argument("--sim-procs", type=int, default=2)
    ap.add_argument("--window", type=float, default=20.0)
    ap.add_argument("--settle", type=float, default=5.0, help="seconds after start-up")
    ap.add_argument("--rate", type=float, default=20.0, help="requests/s (0: idle only)")
    ap.add_argument("--hot", type=int, default=3, help="pools taking --hot-share of the load")
    ap.add_argument("--hot-share", type=float, default=0.8)
    ap.add_argument("--staleness", type=float, default=10.0, help="seconds of age sampling")
    ap.add_argument("--time-scale", type=float, default=0.2, help="simulators' time scale")
    ap.add_argument("--strategy", default="kv-aware")
    ap.add_argument("--kv-events", action="store_true", help="pods publish KV events")
    ap.add_argument("--server-config", default="", help="JSON merged into the server's config")
    ap.add_argument("--label", default="")
    ap.add_argument("--workdir", type=Path, help="keep logs here (default: a temporary dir)")
    ap.add_argument("--json", type=Path, help="append the result (one JSON line) to this file")
    ap.add_argument("--memory", action="store_true", help="in-process memory breakdown only")
    ap.add_argument(
        "--plot", nargs=2, type=Path, metavar=("ROWS.jsonl", "OUT.png"),
        help="draw cost against endpoints from saved rows, and exit",
    )  # fmt: skip
    ap.add_argument("--blocks-per-pod", type=int, default=8192, help="--memory: cache per pod")
    args = ap.parse_args()
    if args.plot:
        plot(*args.plot)
        return
    if args.memory:
        mem = memory(args)
        print(json.dumps(mem, indent=1))
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps({"memory": mem}) + "\n")
        return
    if args.workdir is not None:
        result = run(args, args.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="fleet-") as tmp:
            result = run(args, Path(tmp))
    print(json.dumps(result, indent=1))
    if args.json:
        with args.json.open("a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
