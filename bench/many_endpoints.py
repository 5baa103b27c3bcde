"""The server over 256 simulated endpoints: its CPU, scrapes/s and KV events/s, idle and under load.

One `tests.e2e.many_sims` process serves the simulators (each scraped every
`metrics.poll_interval_s` and publishing KV events), then the local stack's ext_proc server and
Envoy route over them. Two windows: idle (scrapes only) and a closed loop of `--clients`
concurrent chat requests (~300-token prompts, 8 output tokens). CPU is the server process's
utime + stime from /proc, per wall second.

    .venv/bin/python bench/many_endpoints.py [--pods 256] [--window 15] [--clients 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.harness import metric_samples, metric_sum, wait_for
from tests.e2e.many_sims import ManySimStack
from tests.e2e.test_many_endpoints import WORDS, many_sim_stack


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def counters(stack: ManySimStack) -> dict[str, float]:
    o = stack.options
    s = metric_samples(f"http://{o.host}:{o.metrics_port}/metrics")
    return {
        "cpu_s": cpu_seconds(stack.pid("extproc-0")),
        "sims_cpu_s": cpu_seconds(stack.pid("sims")),
        "scrapes": metric_sum(s, "extproc_metrics_scrapes_total"),
        "kv_blocks": metric_sum(s, "extproc_kv_events_total", kind="stored_blocks")
        + metric_sum(s, "extproc_kv_events_total", kind="removed_blocks"),
        "kv_batches": metric_sum(s, "extproc_kv_event_batches_total"),
    }


def window(stack: ManySimStack, seconds: float, clients: int) -> dict[str, Any]:
    stop = threading.Event()
    done: list[int] = []
    errors: list[int] = []

    def client(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                msgs = [{"role": "user", "content": " ".join(rng.choices(WORDS, k=300))}]
                r = http.post(
                    f"{stack.base_url}/v1/chat/completions",
                    json={"model": "qwen3", "messages": msgs, "max_tokens": 8},
                )
                (done if r.status_code == 200 else errors).append(1)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    before, t0 = counters(stack), time.monotonic()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    after, wall = counters(stack), time.monotonic() - t0
    rate = {k: round((after[k] - before[k]) / wall, 3) for k in before}
    return {
        "clients": clients,
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(done) / wall, 2),
        "errors": len(errors),
        "server_cpu_s_per_s": rate["cpu_s"],
        "sims_cpu_s_per_s": rate["sims_cpu_s"],
        "scrapes_per_s": rate["scrapes"],
        "kv_block_events_per_s": rate["kv_blocks"],
        "kv_batches_per_s": rate["kv_batches"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pods", type=int, default=256)
    ap.add_argument("--window", type=float, default=15.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--json", help="write results to this file")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, many_sim_stack(Path(tmp), args.pods) as stack:
        o = stack.options
        url = f"http://{o.host}:{o.metrics_port}/debug/endpoints"
        ok = wait_for(
            lambda: (
                sum(
                    e["ready"] for e in httpx.get(url, headers=o.admin_headers(), timeout=10).json()
                )
                == args.pods
            ),
            timeout=60,
        )
        if not ok:
            raise SystemExit("not every endpoint became ready")
        result = {
            "pods": args.pods,
            "idle": window(stack, args.window, 0),
            "load": window(stack, args.window, args.clients),
        }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
