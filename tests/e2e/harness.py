"""Helpers for end-to-end tests: free port blocks, a stack per test module, metric reads."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from extproc.stack.local import LocalStack, StackOptions

FAST_SIM = ("--time-scale", "0.2")  # simulated GPU time runs 5x faster: quick tests, same logic


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_block(size: int = 40) -> int:
    """A base port such that base..base+size-1 are free (below the ephemeral range)."""
    for _ in range(200):
        base = random.randrange(12000, 30000 - size, 50)
        if all(_free(base + i) for i in range(size)):
            return base
    raise RuntimeError("no free port block found")


def stack_options(workdir: Path, **changes: Any) -> StackOptions:
    base = port_block()
    opts = StackOptions(
        sims=changes.pop("sims", 3),
        sim_base_port=base,
        kv_base_port=base + 10,
        listen_port=base + 30,
        admin_port=base + 31,
        grpc_port=base + 32,
        metrics_port=base + 36,
        nats_port=base + 25,
        workdir=workdir,
        sim_args=FAST_SIM,
        log_level="info",
        strategy="least-request",  # what these tests were written against (not the default)
    )
    return replace(opts, **changes)


def running_stack(opts: StackOptions) -> LocalStack:
    """`with running_stack(opts) as stack:` starts everything and stops it on exit."""
    return LocalStack(opts)


def metric_samples(
    url: str, timeout: float = 5.0
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url, timeout=timeout).text
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric_sum(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    total = 0.0
    for (n, lbls), v in samples.items():
        d = dict(lbls)
        if n == name and all(d.get(k) == val for k, val in labels.items()):
            total += v
    return total


def served_counts(stack: LocalStack) -> dict[str, float]:
    """Finished requests per simulator (from the simulators' own vLLM metrics)."""
    o = stack.options
    out = {}
    for i in range(o.sims):
        samples = metric_samples(f"http://{o.sim_address(i)}/metrics")
        out[o.sim_address(i)] = metric_sum(samples, "vllm:request_success_total")
    return out


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return cond()


def in_flight(stack: LocalStack) -> int:
    o = stack.options
    eps = httpx.get(
        f"http://{o.host}:{o.metrics_port}/debug/endpoints", headers=o.admin_headers(), timeout=5
    ).json()
    return sum(int(e["in_flight"]) for e in eps)


def every_process_sees_every_pod_ready(stack: LocalStack) -> bool:
    """True once each server process counts every simulator ready. A process is ready with one
    fresh pod (`/readyz`); a test that needs a particular pod (P/D's prefill pod) waits for
    this, as the others may still be on their first scrape or their first synced view."""
    o = stack.options
    for i in range(o.extproc_processes):
        eps = httpx.get(
            f"http://{o.host}:{o.metrics_port + i}/debug/endpoints",
            headers=o.admin_headers(),
            timeout=5,
        ).json()
        if sum(1 for e in eps if e.get("ready")) < o.sims:
            return False
    return True
