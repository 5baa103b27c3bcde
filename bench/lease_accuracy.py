"""How well the gateway's in-flight counts follow the engines' own, by how leases end.

Open-loop streamed chats through the real local stack; every 0.1 s the bench reads, per pod,
the gateway's in-flight count (`/debug/endpoints`, the process's view) and the engine's own
running + waiting (`vllm:num_requests_*` from the simulator's /metrics). A lease ended by the
request's access-log record is late by up to one flush interval; one held by the routing
stream (the former default, `accounting.access_log: false`) ends with the request. Reported:
the mean over samples of sum over pods |gateway - engine|, the mean signed error (gateway
minus engine: late releases show as positive), and the mean engine count for scale.

Usage: .venv/bin/python bench/lease_accuracy.py [--seconds 20] [--rate 12] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.faults import STREAM_CHAT, StreamedOpenLoad, _ext_proc_stats, running, stack_options
from extproc.stack.local import LocalStack
from tests.e2e.harness import metric_samples, metric_sum

VARIANTS: dict[str, dict[str, Any]] = {
    "held stream (former default)": {"server_config": {"accounting": {"access_log": False}}},
    "record, flush 0.5 s (the former local default)": {"access_log_flush_s": 0.5},
    "record, flush 1.0 s (Envoy Gateway's)": {"access_log_flush_s": 1.0},
    "record, flush 0.2 s": {"access_log_flush_s": 0.2},
    "record, flush 0.1 s (the local default)": {"access_log_flush_s": 0.1},
}


def _gateway(stack: LocalStack) -> dict[str, int]:
    o = stack.options
    eps = httpx.get(
        f"http://{o.host}:{o.metrics_port}/debug/endpoints", headers=o.admin_headers(), timeout=1
    ).json()
    return {e["address"]: int(e["in_flight"]) for e in eps}


def _engines(stack: LocalStack) -> dict[str, float]:
    o = stack.options
    out = {}
    for i in range(o.sims):
        m = metric_samples(f"http://{o.sim_address(i)}/metrics", timeout=1)
        out[o.sim_address(i)] = metric_sum(m, "vllm:num_requests_running") + metric_sum(
            m, "vllm:num_requests_waiting"
        )
    return out


def measure(stack: LocalStack, *, seconds: float, rate: float) -> dict[str, Any]:
    body = {**STREAM_CHAT, "max_tokens": 200}
    errors: list[float] = []
    signed: list[float] = []
    scale: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            try:
                g, e = _gateway(stack), _engines(stack)
            except httpx.HTTPError:
                continue
            errors.append(sum(abs(g.get(a, 0) - n) for a, n in e.items()))
            signed.append(sum(g.get(a, 0) - n for a, n in e.items()))
            scale.append(sum(e.values()))
            time.sleep(0.1)

    envoy0 = _ext_proc_stats(stack)
    with StreamedOpenLoad(f"{stack.base_url}/v1/chat/completions", rate=rate, body=body) as load:
        time.sleep(2.0)  # warm up: the pool reaches its steady occupancy
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        time.sleep(seconds)
        stop.set()
        sampler.join(5)
        report = load.stop()
    time.sleep(1.0)
    envoy = {k: v - envoy0.get(k, 0) for k, v in _ext_proc_stats(stack).items()}
    n = max(1, len(errors))
    per = max(1, report.sent)
    return {
        "sent": report.sent,
        "ok": report.ok,
        "samples": len(errors),
        "engine_mean": round(sum(scale) / n, 2),
        "abs_error_mean": round(sum(errors) / n, 2),
        "signed_error_mean": round(sum(signed) / n, 2),
        "abs_error_share": round(sum(errors) / max(1e-9, sum(scale)), 3),
        # Envoy's routing-filter counters per request: messages each way on the gRPC stream.
        "ext_proc_msgs_sent_per_request": round(envoy.get("stream_msgs_sent", 0) / per, 2),
        "ext_proc_msgs_received_per_request": round(envoy.get("stream_msgs_received", 0) / per, 2),
        "ext_proc_streams_per_request": round(envoy.get("streams_started", 0) / per, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rate", type=float, default=12.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    results = {}
    for name, changes in VARIANTS.items():
        with (
            tempfile.TemporaryDirectory(prefix="lease-acc-") as tmp,
            running(
                stack_options(
                    Path(tmp),
                    sims=4,
                    kv_events=False,
                    strategy="least-request",
                    sim_args=("--time-scale", "1.0"),
                    **changes,
                )
            ) as stack,
        ):
            results[name] = measure(stack, seconds=args.seconds, rate=args.rate)
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
