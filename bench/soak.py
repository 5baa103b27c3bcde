"""Soak: steady mixed load through the real local stack; is anything growing?

Traffic mixes every request path: non-streaming and streaming chat, completions, streams the
client abandons after a few chunks, and rejected requests (bad JSON, unknown model). Every
`--sample-s` it records the ext_proc server's RSS, threads and open file descriptors, and the
gateway's in-flight count; at the end it stops the load, waits for the last settlements, and
checks that in-flight state went back to zero.

    .venv/bin/python bench/soak.py --minutes 30 --json bench/results/soak-30m.json   # documented run
    .venv/bin/python bench/soak.py --minutes 3                                        # short check

Not part of CI (it is a duration test). Figures are quoted in docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.faults import running, stack_options
from extproc.stack.local import LocalStack, StackOptions
from tests.e2e.harness import metric_samples

__all__ = ["Soak", "debug_memory", "memory_summary", "proc_sample", "rss_trend"]

CHAT = {
    "model": "qwen3",
    "messages": [{"role": "user", "content": "A steady stream of questions."}],
    "max_tokens": 16,
}
MIX: list[tuple[str, str, dict[str, Any] | bytes]] = [
    ("chat", "/v1/chat/completions", CHAT),
    ("chat_stream", "/v1/chat/completions", {**CHAT, "stream": True}),
    ("completion", "/v1/completions", {"model": "qwen3", "prompt": "Once upon a time", "max_tokens": 8}),
    ("abandoned_stream", "/v1/chat/completions", {**CHAT, "max_tokens": 500, "stream": True}),
    ("bad_json", "/v1/chat/completions", b"{not json"),
    ("unknown_model", "/v1/chat/completions", {**CHAT, "model": "nope"}),
    ("chat_multi_turn", "/v1/chat/completions", {
        **CHAT,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "First question about load balancing."},
            {"role": "assistant", "content": "An answer."},
            {"role": "user", "content": "A follow-up."},
        ],
    }),
]  # fmt: skip


def proc_sample(pid: int) -> dict[str, float]:
    """RSS (MiB), thread count and open file descriptors of a process, from /proc."""
    out: dict[str, float] = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                out["rss_mib"] = int(line.split()[1]) / 1024
            elif line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def rss_trend(samples: list[dict[str, float]]) -> dict[str, float]:
    """Median RSS of the first and last quarters (after a warm-up quarter) and the slope."""
    rss = [s["rss_mib"] for s in samples]
    ts = [s["t"] for s in samples]
    q = max(1, len(rss) // 4)
    early, late = rss[q : 2 * q] or rss[:q], rss[-q:]
    slope = statistics.linear_regression(ts[q:], rss[q:]).slope * 60 if len(rss[q:]) >= 2 else 0.0
    return {
        "rss_early_mib": round(statistics.median(early), 1),
        "rss_late_mib": round(statistics.median(late), 1),
        "rss_slope_mib_per_min": round(slope, 3),
    }


def debug_memory(options: StackOptions, process: int, query: dict[str, str]) -> dict[str, Any]:
    """Process `process`'s /debug/memory report (RSS, object types, tracemalloc growth since
    the baseline; `reset="1"` takes a new one). A long timeout: the snapshot holds the
    server's event loop for seconds under tracemalloc."""
    o = options
    report: dict[str, Any] = httpx.get(
        f"http://{o.host}:{o.metrics_port + process}/debug/memory",
        params=query,
        headers=o.admin_headers(),
        timeout=120,
    ).json()
    return report


def memory_summary(report: dict[str, Any], top: int = 12) -> dict[str, Any]:
    """The few figures of a /debug/memory report that say what grew: RSS, traced bytes and
    allocated blocks (growth since the baseline), object types that grew, and the allocation
    sites that grew most, each as (bytes, blocks, frames: the allocating line last)."""
    mib = 1024 * 1024
    out: dict[str, Any] = {
        "rss_mib": round(report["rss_bytes"] / mib, 1) if report.get("rss_bytes") else None,
        "rss_growth_mib": round(report["rss_growth_bytes"] / mib, 2)
        if report.get("rss_growth_bytes") is not None
        else None,
        "traced_mib": round(report["traced_bytes"] / mib, 2) if "traced_bytes" in report else None,
        "traced_growth_mib": round(report["traced_growth_bytes"] / mib, 2)
        if "traced_growth_bytes" in report
        else None,
        "allocated_blocks_growth": report.get("allocated_blocks_growth"),
        "object_type_growth": dict(list(report.get("object_type_growth", {}).items())[:top]),
    }
    growth = report.get("growth_since_baseline", [])
    out["traced_growth_mib_top_sites"] = round(sum(g["size_diff"] for g in growth) / mib, 2)
    out["sites"] = [
        [g["size_diff"], g["count_diff"], ["/".join(w.rsplit("/", 2)[-2:]) for w in g["where"]]]
        for g in growth[:top]
    ]
    return out


class Soak:
    def __init__(
        self, stack: LocalStack, *, concurrency: int, kinds: frozenset[str] | None = None
    ) -> None:
        self._stack = stack
        self._mix = [m for m in MIX if kinds is None or m[0] in kinds]
        if not self._mix:
            raise ValueError(f"no request kind selected; kinds are {[m[0] for m in MIX]}")
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self._threads = [
            threading.Thread(target=self._worker, args=(i,), daemon=True)
            for i in range(concurrency)
        ]

    def _one(self, client: httpx.Client, kind: str, path: str, body: dict[str, Any] | bytes) -> str:
        url = f"{self._stack.base_url}{path}"
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"content-type": "application/json", "authorization": "Bearer sk-soak"}
        if kind == "abandoned_stream":
            with client.stream("POST", url, content=content, headers=headers) as r:
                for i, _ in enumerate(r.iter_lines()):
                    if i >= 4:
                        break  # the client walks away mid-generation
                return str(r.status_code)
        return str(client.post(url, content=content, headers=headers).status_code)

    def _worker(self, i: int) -> None:
        n = i
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                kind, path, body = self._mix[n % len(self._mix)]
                n += 1
                try:
                    status = self._one(client, kind, path, body)
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                with self._lock:
                    self.outcomes[(kind, status)] += 1

    def in_flight(self) -> int:
        o = self._stack.options
        eps = httpx.get(
            f"http://{o.host}:{o.metrics_port}/debug/endpoints",
            headers=o.admin_headers(),
            timeout=60,
        ).json()
        return sum(int(e["in_flight"]) for e in eps)

    def server_state(self) -> dict[str, float]:
        """The server's own gauges: extproc_server_state{kind} and the stream-end counts."""
        o = self._stack.options
        # A long timeout: a /debug/memory snapshot may hold the event loop for seconds.
        samples = metric_samples(f"http://{o.host}:{o.metrics_port}/metrics", timeout=60)
        out: dict[str, float] = {}
        for (name, labels), value in samples.items():
            lbl = dict(labels)
            if name == "extproc_server_state":
                out[lbl["kind"]] = value
            elif name == "extproc_grpc_stream_ends_total":
                out[f"streams_{lbl['end']}"] = value
        return out

    def memory(self, **query: str) -> dict[str, Any]:
        """The server's /debug/memory report (RSS, object types, tracemalloc growth)."""
        return debug_memory(self._stack.options, 0, query)

    def run(self, minutes: float, sample_s: float, *, memory: bool = False) -> dict[str, Any]:
        pid = self._stack.pid("extproc-0")
        samples: list[dict[str, float]] = []
        memory_reports: dict[str, Any] = {}
        t0 = time.monotonic()
        for t in self._threads:
            t.start()
        while time.monotonic() - t0 < minutes * 60:
            if memory and not memory_reports and time.monotonic() - t0 >= minutes * 15:
                # baseline after the warm-up quarter; growth is reported against it at the end
                memory_reports["baseline"] = self.memory(types="1", reset="1", top="30")
            time.sleep(sample_s)
            s = proc_sample(pid)
            s["t"] = round(time.monotonic() - t0, 1)
            s["in_flight"] = self.in_flight()
            s.update(self.server_state())
            with self._lock:
                s["requests"] = sum(self.outcomes.values())
            samples.append(s)
            print(json.dumps(s), flush=True)
        self._stop.set()
        for t in self._threads:
            t.join(70)
        time.sleep(
            8.0
        )  # abandoned streams settle after CLOSE_GRACE_S or Envoy's deferred close (5 s)
        final = {**proc_sample(pid), "in_flight": self.in_flight(), **self.server_state()}
        if memory:
            memory_reports["after_drain"] = self.memory(types="1", top="30")
        by_kind: dict[str, dict[str, int]] = {}
        for (kind, status), n in sorted(self.outcomes.items()):
            by_kind.setdefault(kind, {})[status] = n
        return {
            "minutes": minutes,
            "requests": sum(self.outcomes.values()),
            "by_kind_and_status": by_kind,
            **rss_trend(samples),
            "threads_first_last": [samples[0]["threads"], samples[-1]["threads"]],
            "fds_first_last": [samples[0]["fds"], samples[-1]["fds"]],
            "in_flight_max_during": max(s["in_flight"] for s in samples),
            "in_flight_after_drain": final["in_flight"],
            "rss_after_drain_mib": round(final["rss_mib"], 1),
            "server_state_during_max": {
                k: max(x.get(k, 0.0) for x in samples)
                for k in ("asyncio_tasks", "access_log_streams", "deciding", "grpc_streams")
            },
            "server_state_first_last": {
                k: [samples[0].get(k), samples[-1].get(k)]
                for k in (
                    "asyncio_tasks",
                    "access_log_streams",
                    "grpc_streams",
                    "python_allocated_blocks",
                )
            },
            "server_state_after_drain": {
                k: final.get(k)
                for k in (
                    "asyncio_tasks",
                    "access_log_streams",
                    "deciding",
                    "grpc_streams",
                    "python_allocated_blocks",
                )
            },
            "memory": memory_reports,
            "samples": samples,
        }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--json", help="write the figures (with every sample) to this file")
    ap.add_argument(
        "--memory",
        action="store_true",
        help="fetch /debug/memory after the warm-up quarter (baseline) and after the drain",
    )
    ap.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment for the ext_proc server, e.g. PYTHONTRACEMALLOC=1 or MALLOC_ARENA_MAX=2",
    )
    ap.add_argument(
        "--server-launcher",
        default="",
        help="interpreter arguments before `-m extproc serve`, e.g. "
        "'-m memray run --native --follow-fork -o /tmp/server.bin'",
    )
    ap.add_argument("--strategy", default="least-request")
    ap.add_argument(
        "--kinds",
        help="comma-separated subset of the mix (" + ",".join(m[0] for m in MIX) + ")",
    )
    args = ap.parse_args()
    server_env = tuple(tuple(kv.split("=", 1)) for kv in args.server_env)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        opts = stack_options(
            Path(tmp),
            strategy=args.strategy,
            log_level="warning",
            server_env=server_env,
            server_launcher=tuple(shlex.split(args.server_launcher)),
        )
        with running(opts) as stack:
            kinds = frozenset(args.kinds.split(",")) if args.kinds else None
            result = Soak(stack, concurrency=args.concurrency, kinds=kinds).run(
                args.minutes, args.sample_s, memory=args.memory
            )
    summary = {k: v for k, v in result.items() if k not in ("samples", "memory")}
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
