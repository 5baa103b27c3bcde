"""Engine /metrics scrapes per second against server processes: does scraping grow with pods
only, or with processes x pods?

For 1, 2 and 4 server processes (replica sync on for more than one, as `extproc up` does), the
local stack's simulators are scraped by the servers; this counts the scrapes the engines
answered over a window (the servers' `extproc_metrics_scrapes_total`, summed over processes)
and the sync state of each process.

    .venv/bin/python bench/scrape_load.py --window 6 --json out.json

Not part of CI (it starts three stacks). Figures are quoted in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from extproc.stack.local import LocalStack
from tests.e2e.harness import metric_samples, metric_sum, stack_options


def scrapes(stack: LocalStack, processes: int) -> float:
    o = stack.options
    return sum(
        metric_sum(
            metric_samples(f"http://{o.host}:{o.metrics_port + i}/metrics"),
            "extproc_metrics_scrapes_total",
        )
        for i in range(processes)
    )


def peers(stack: LocalStack, processes: int) -> list[int]:
    o = stack.options
    out = []
    for i in range(processes):
        state = httpx.get(
            f"http://{o.host}:{o.metrics_port + i}/debug/sync", headers=o.admin_headers(), timeout=5
        ).json()
        out.append(len(state.get("peers_last_heard_s", {})))
    return out


def measure(processes: int, sims: int, window: float, workdir: Path) -> dict[str, Any]:
    opts = stack_options(workdir, sims=sims, extproc_processes=processes, kv_events=False)
    opts = replace(opts, sim_args=(), log_level="warning")  # engines at normal speed
    with LocalStack(opts) as stack:
        deadline = time.monotonic() + 15
        while processes > 1 and time.monotonic() < deadline:
            if all(n == processes - 1 for n in peers(stack, processes)):
                break
            time.sleep(0.2)
        time.sleep(1.5)  # ownership settles one poll after the membership
        first, t0 = scrapes(stack, processes), time.monotonic()
        time.sleep(window)
        last, t1 = scrapes(stack, processes), time.monotonic()
        return {
            "processes": processes,
            "pods": sims,
            "scrapes_per_s": round((last - first) / (t1 - t0), 2),
            "per_pod_per_s": round((last - first) / (t1 - t0) / sims, 2),
            "peers_seen": peers(stack, processes),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--window", type=float, default=6.0)
    ap.add_argument("--sims", type=int, default=4)
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.processes:
            rows.append(measure(n, args.sims, args.window, Path(tmp) / f"p{n}"))
            print(json.dumps(rows[-1]), flush=True)
    print("\n| processes | pods | scrapes/s (all processes) | per pod per s |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['processes']} | {r['pods']} | {r['scrapes_per_s']} | {r['per_pod_per_s']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
