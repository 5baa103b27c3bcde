"""Fault scenarios under load through the real local stack (Envoy + ext_proc + simulators).

Each scenario starts a LocalStack, runs a bounded closed-loop load (`concurrency` clients,
each sending the next request when the last one ends), injects one fault, and reports what
the clients saw: requests sent, succeeded, lost (any non-200 or transport error), errors by
status, and recovery times. tests/reliability/test_faults_e2e.py runs the same functions
with small loads and asserts on the figures; docs/reliability.md quotes a full run.

accounting_sink_restart / accounting_sink_sigterm (two ext_proc processes, open-loop streamed
load) stop the process holding Envoy's access-log stream and count, across processes, the
accounting records that never arrived, besides what the clients saw.

server_sigkill / server_sigkill_no_reset (two ext_proc processes, open loop at 80/s) SIGKILL
one process 5 times, with the routing stream's retry triggers and without `reset` among them.

Usage: .venv/bin/python bench/faults.py [--scenario NAME ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.stats import percentile
from extproc.stack.envoy_config import EXTPROC_STATUS_ON_ERROR
from extproc.stack.envoy_gateway import GatewayShape
from extproc.stack.local import LocalStack, StackOptions
from tests.e2e.harness import metric_samples, metric_sum
from tests.e2e.harness import stack_options as harness_options

__all__ = [
    "SCENARIOS",
    "Load",
    "LoadReport",
    "OpenLoad",
    "StreamedOpenLoad",
    "accounting_sink_restart",
    "accounting_sink_sigterm",
    "bucket_quantile",
    "ext_proc_restart",
    "graceful_shutdown",
    "nats_kill",
    "pod_hang",
    "pod_kill",
    "rolling_restart",
    "router_stop",
    "server_sigkill",
    "stack_options",
    "sync_process_kill",
]

CHAT = {
    "model": "qwen3",
    "messages": [{"role": "user", "content": "Say something reliable."}],
    "max_tokens": 8,
}


def stack_options(workdir: Path, **changes: Any) -> StackOptions:
    """The e2e stack on free ports, round robin so every pod gets traffic and a fault always
    meets requests."""
    return harness_options(workdir, **{"sims": 3, "strategy": "round-robin", **changes})


def running(opts: StackOptions) -> LocalStack:
    return LocalStack(opts)  # a context manager: starts on enter, stops on exit


@dataclass
class Outcome:
    started: float
    ended: float
    status: int | str  # HTTP status, or the transport error's class name
    pod: str | None = None  # the serving pod (the simulator's x-inference-pod header)
    detail: str | None = None  # a failed answer's body (first 200 characters), to say who failed


@dataclass
class LoadReport:
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def sent(self) -> int:
        return len(self.outcomes)

    @property
    def ok(self) -> int:
        return sum(1 for o in self.outcomes if o.status == 200)

    @property
    def lost(self) -> int:
        return self.sent - self.ok

    def by_status(self) -> dict[str, int]:
        return dict(sorted(Counter(str(o.status) for o in self.outcomes).items()))

    def first_ok_after(self, t: float) -> float | None:
        """Seconds from t until a request that started after t succeeded."""
        ends = [o.ended for o in self.outcomes if o.started >= t and o.status == 200]
        return round(min(ends) - t, 3) if ends else None

    def errors_between(self, t0: float, t1: float) -> int:
        return sum(1 for o in self.outcomes if t0 <= o.started < t1 and o.status != 200)

    def summary(self) -> dict[str, Any]:
        failed = [o.detail for o in self.outcomes if o.status != 200 and o.detail]
        return {
            "sent": self.sent,
            "ok": self.ok,
            "lost": self.lost,
            "by_status": self.by_status(),
            **({"failed_bodies": sorted(set(failed))[:3]} if failed else {}),
        }


class Load:
    """Closed-loop load: `concurrency` threads, each one request at a time, until stopped."""

    def __init__(
        self,
        url: str,
        *,
        concurrency: int = 4,
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self._url = url
        self._headers = headers or {}
        self._body = body or CHAT
        self._timeout = timeout_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.report = LoadReport()
        self._threads = [
            threading.Thread(target=self._worker, daemon=True) for _ in range(concurrency)
        ]

    def since(self, t: float) -> list[Outcome]:
        """Outcomes so far of requests started at or after t."""
        with self._lock:
            return [o for o in self.report.outcomes if o.started >= t]

    def _worker(self) -> None:
        with httpx.Client(timeout=self._timeout) as client:
            while not self._stop.is_set():
                self._one(client)

    def _one(self, client: httpx.Client) -> None:
        t0 = time.monotonic()
        status: int | str
        pod = detail = None
        try:
            resp = client.post(self._url, json=self._body, headers=self._headers)
            status, pod = resp.status_code, resp.headers.get("x-inference-pod")
            if status != 200:
                detail = resp.text[:200]
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        with self._lock:
            self.report.outcomes.append(Outcome(t0, time.monotonic(), status, pod, detail))

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, join_timeout_s: float = 35.0) -> LoadReport:
        self._stop.set()
        for t in self._threads:
            t.join(join_timeout_s)
        return self.report


class OpenLoad(Load):
    """Open-loop load: a new request every 1/rate s whatever the answers, like many independent
    clients (a request held by a hung pod does not slow the arrivals, as it does closed loop)."""

    def __init__(self, url: str, *, rate: float, max_outstanding: int = 256, **kw: Any) -> None:
        super().__init__(url, concurrency=0, **kw)
        self._rate = rate
        self._pool = ThreadPoolExecutor(max_outstanding, thread_name_prefix="open-load")
        self._client = httpx.Client(
            timeout=self._timeout, limits=httpx.Limits(max_connections=max_outstanding)
        )
        self._threads = [threading.Thread(target=self._dispatch, daemon=True)]

    def _dispatch(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            self._pool.submit(self._one, self._client)
            next_at += 1.0 / self._rate
            time.sleep(max(0.0, next_at - time.monotonic()))

    def stop(self, join_timeout_s: float = 35.0) -> LoadReport:
        super().stop(join_timeout_s)
        self._pool.shutdown(wait=True)
        self._client.close()
        return self.report


def _load(
    url: str,
    *,
    rate: float | None,
    concurrency: int,
    body: dict[str, Any] | None,
    headers: dict[str, str] | None = None,
) -> Load:
    """An open loop at `rate` requests/s, or (None) `concurrency` clients that wait for each
    answer; a minute's patience per request (a hung pod holds them)."""
    if rate is not None:
        return OpenLoad(url, rate=rate, headers=headers, timeout_s=60, body=body)
    return Load(url, concurrency=concurrency, headers=headers, timeout_s=60, body=body)


def _endpoint_field(
    stack: LocalStack, address: str, field: str, *, process: int = 0
) -> bool | None:
    """`field` of `address` in server process `process`'s /debug/endpoints (None: unknown)."""
    o = stack.options
    try:
        eps = httpx.get(
            f"http://{o.host}:{o.metrics_port + process}/debug/endpoints",
            headers=o.admin_headers(),
            timeout=2,
        ).json()
    except httpx.HTTPError:
        return None
    return next((bool(e[field]) for e in eps if e["address"] == address), None)


def _endpoint_ready(stack: LocalStack, address: str) -> bool | None:
    return _endpoint_field(stack, address, "ready")


def _wait(cond: Callable[[], bool], timeout_s: float, interval_s: float = 0.02) -> float | None:
    """Seconds until cond() held, or None on timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if cond():
            return round(time.monotonic() - t0, 3)
        time.sleep(interval_s)
    return None


def pod_kill(
    stack: LocalStack,
    *,
    warmup_s: float = 1.0,
    down_s: float = 2.0,
    after_s: float = 1.5,
    concurrency: int = 6,
) -> dict[str, Any]:
    """SIGKILL one simulator under load, then restart it."""
    name, address = "sim-1", stack.options.sim_address(1)
    with Load(f"{stack.base_url}/v1/chat/completions", concurrency=concurrency) as load:
        time.sleep(warmup_s)
        killed_at = time.monotonic()
        stack.kill(name, signal.SIGKILL)
        excluded_s = _wait(lambda: _endpoint_ready(stack, address) is False, 10)
        time.sleep(max(0.0, down_s - (time.monotonic() - killed_at)))
        restarted_at = time.monotonic()
        stack.restart(name)
        back_s = _wait(lambda: _endpoint_ready(stack, address) is True, 30)
        time.sleep(after_s)
        report = load.stop()
    return {
        **report.summary(),
        "errors_while_down": report.errors_between(killed_at, restarted_at),
        "excluded_after_s": excluded_s,
        "ready_after_restart_s": back_s,
    }


def _fault(stack: LocalStack, index: int, **faults: Any) -> None:
    httpx.post(
        f"http://{stack.options.sim_address(index)}/admin/faults", json=faults, timeout=5
    ).raise_for_status()


def pod_hang(
    stack: LocalStack,
    *,
    warmup_s: float = 1.0,
    hang_s: float = 3.0,
    concurrency: int = 6,
    rate: float | None = None,
    strategy: str | None = None,
    body: dict[str, Any] | None = None,
    busiest: bool = False,
) -> dict[str, Any]:
    """One simulator accepts requests and never answers (completions_hang), then recovers.
    Closed loop with `concurrency` clients, or open loop at `rate` requests/s. The simulator
    is the second one, or with `busiest` the one that served most of the warm-up (where a
    rule that follows the cache sends the traffic)."""
    headers = {"routing-strategy": strategy} if strategy else {}
    url = f"{stack.base_url}/v1/chat/completions"
    index = 1
    with _load(url, rate=rate, concurrency=concurrency, body=body, headers=headers) as load:
        time.sleep(warmup_s)
        if busiest:
            served = Counter(o.pod for o in load.since(0.0))
            index = max(
                range(stack.options.sims), key=lambda i: served[stack.options.sim_address(i)]
            )
        address = stack.options.sim_address(index)
        t0 = time.monotonic()
        _fault(stack, index, completions_hang=True)
        # routing.stall_after_s: the hung pod leaves the candidates once it holds a request that
        # long while answering nothing (None: never, e.g. with the detection off)
        stalled_s = _wait(lambda: _endpoint_field(stack, address, "stalled") is True, hang_s)
        time.sleep(max(0.0, hang_s - (time.monotonic() - t0)))
        during = load.since(t0)  # finished during the hang: served by the other pods
        _fault(stack, index, completions_hang=False)
        t1 = time.monotonic()
        back_s = _wait(lambda: _endpoint_field(stack, address, "stalled") is False, 5.0)
        time.sleep(max(0.0, 1.0 - (time.monotonic() - t1)))
        report = load.stop()
    # Held: sent during the hang, served by the hung pod, so answered only after the hang.
    held = [o for o in report.outcomes if t0 <= o.started < t1 and o.pod == address]
    return {
        **report.summary(),
        "strategy": strategy or stack.options.strategy,
        "load": f"open loop {rate}/s" if rate is not None else f"closed loop x{concurrency}",
        "ok_during_hang": sum(1 for o in during if o.status == 200),
        "held_by_hung_pod": len(held),
        "hang_s": hang_s,
        "left_candidates_after_s": stalled_s,
        "candidate_again_after_s": back_s if stalled_s is not None else None,
    }


def pod_fault_default(
    stack: LocalStack,
    fault: str,
    *,
    warmup_s: float = 3.0,
    fault_s: float = 8.0,
    after_s: float = 3.0,
    concurrency: int = 8,
    rate: float | None = None,
    body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One fault on the pod that served most of the warm-up (where the default rule sends a
    shared prefix), under clients that wait for each answer (or an open loop at `rate`):
    `kill` (SIGKILL, restarted after `fault_s`), `slow` (every engine step 10 times as long),
    `errors` (every completion answered 503). Figures: requests lost, the pod's share of the
    requests before and during, latency p50/p90 before and during."""
    url = f"{stack.base_url}/v1/chat/completions"
    o = stack.options
    with _load(url, rate=rate, concurrency=concurrency, body=body) as load:
        time.sleep(warmup_s)
        served = Counter(x.pod for x in load.since(0.0))
        index = max(range(o.sims), key=lambda i: served[o.sim_address(i)])
        address, name = o.sim_address(index), f"sim-{index}"
        t0 = time.monotonic()
        excluded_s = None
        if fault == "kill":
            stack.kill(name, signal.SIGKILL)
            excluded_s = _wait(lambda: _endpoint_ready(stack, address) is False, fault_s)
        elif fault == "slow":
            _fault(stack, index, slow=10.0)
        elif fault == "errors":
            _fault(stack, index, error_rate=1.0)
        else:
            raise ValueError(f"unknown fault {fault!r}")
        time.sleep(max(0.0, fault_s - (time.monotonic() - t0)))
        t1 = time.monotonic()
        if fault == "kill":
            stack.restart(name)
            _wait(lambda: _endpoint_ready(stack, address) is True, 30)
        elif fault == "slow":
            _fault(stack, index, slow=1.0)
        else:
            _fault(stack, index, error_rate=0.0)
        time.sleep(after_s)
        report = load.stop()

    def phase(a: float, b: float) -> dict[str, Any]:
        xs = [x for x in report.outcomes if a <= x.started < b]
        ok = [x.ended - x.started for x in xs if x.status == 200]
        return {
            "sent": len(xs),
            "lost": sum(1 for x in xs if x.status != 200),
            "faulted_pod_share": round(sum(1 for x in xs if x.pod == address) / len(xs), 3)
            if xs
            else None,
            "p50_ms": round(percentile(ok, 50) * 1000, 1) if ok else None,
            "p90_ms": round(percentile(ok, 90) * 1000, 1) if ok else None,
        }

    first = report.outcomes[0].started if report.outcomes else t0
    return {
        **report.summary(),
        "fault": fault,
        "load": f"open loop {rate}/s" if rate is not None else f"closed loop x{concurrency}",
        "pod": address,
        "fault_s": fault_s,
        "excluded_after_s": excluded_s,
        "before": phase(first, t0),
        "during": phase(t0, t1),
        "after": phase(t1, float("inf")),
    }


def ext_proc_restart(
    stack: LocalStack,
    *,
    warmup_s: float = 1.0,
    down_s: float = 2.0,
    after_s: float = 2.0,
    concurrency: int = 4,
) -> dict[str, Any]:
    """SIGKILL the ext_proc server under load, restart it; fail-open or fail-closed per stack."""
    with Load(f"{stack.base_url}/v1/chat/completions", concurrency=concurrency) as load:
        time.sleep(warmup_s)
        killed_at = time.monotonic()
        stack.kill("extproc-0", signal.SIGKILL)
        time.sleep(down_s)
        restarted_at = time.monotonic()
        stack.restart("extproc-0")
        o = stack.options
        ready_s = _wait(lambda: _get_ok(f"http://{o.host}:{o.metrics_port}/readyz"), 30)
        time.sleep(after_s)
        report = load.stop()
    down = [x for x in report.outcomes if killed_at <= x.started < restarted_at]
    return {
        **report.summary(),
        "fail_open": stack.options.fail_open,
        "sent_while_down": len(down),
        "ok_while_down": sum(1 for x in down if x.status == 200),
        "server_ready_after_restart_s": ready_s,
        "first_ok_after_restart_s": report.first_ok_after(restarted_at),
    }


def _get_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def graceful_shutdown(stack: LocalStack, *, max_tokens: int = 400) -> dict[str, Any]:
    """SIGTERM the ext_proc server while a long streamed response is in flight."""
    body = {**CHAT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    events = 0
    done = False
    exited: list[float] = []

    def watch() -> None:  # the exit time, independent of when the client reads the end
        while stack.alive("extproc-0"):
            time.sleep(0.005)
        exited.append(time.monotonic())

    watcher = threading.Thread(target=watch, daemon=True)
    t_term: float | None = None
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body, timeout=60) as r:
        status = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events += 1
            if t_term is None and events == 3:
                t_term = time.monotonic()
                stack.signal("extproc-0", signal.SIGTERM)  # not kill(): it waits for the exit
                watcher.start()
            done = done or line == "data: [DONE]"
    stream_end = time.monotonic()
    watcher.join(stack_grace(stack) + 5)
    assert t_term is not None
    log = stack.log_tail("extproc-0", 1_000_000)
    drained = [line for line in log.splitlines() if "draining" in line]
    return {
        "status": status,
        "events": events,
        "completed": done,
        "stream_ran_after_sigterm_s": round(stream_end - t_term, 3),
        "exited_after_sigterm_s": round(exited[0] - t_term, 3) if exited else None,
        "grace_s": stack_grace(stack),
        "drain_log": drained[-1] if drained else None,
    }


def stack_grace(stack: LocalStack) -> float:
    return float(stack.server_config().get("server", {}).get("shutdown_grace_s", 10.0))


# -- the accounting sink (Envoy's gRPC access log to the ext_proc processes) -------------------

STREAM_CHAT = {
    **CHAT,
    "max_tokens": 64,
    "stream": True,
    "stream_options": {"include_usage": True},
}
ALS_FLUSH_S = 0.5  # EnvoyOptions.access_log_flush_interval_s: records reach a server this late
ENVOY_ALS_STATS = (  # Envoy's counters for the accounting log (admin /stats names)
    "access_logs.grpc_access_log.logs_written",
    "access_logs.grpc_access_log.logs_dropped",
    "access_logs.grpc_access_log.grpc_entries_flushed",
    "access_logs.grpc_access_log.grpc_entries_flush_failed",
    "cluster.extproc.upstream_cx_connect_fail",
    "cluster.extproc.upstream_rq_rx_reset",
)


class StreamedOpenLoad(OpenLoad):
    """OpenLoad of streamed chats with `include_usage`: a 200 whose stream lacks `[DONE]` is
    recorded as "truncated", and the completion tokens of the usage the clients saw add up in
    `completion_tokens` (to compare with the servers' accounted tokens)."""

    def __init__(self, url: str, *, rate: float, **kw: Any) -> None:
        super().__init__(url, rate=rate, body=kw.pop("body", STREAM_CHAT), **kw)
        self.completion_tokens = 0

    def _one(self, client: httpx.Client) -> None:
        t0 = time.monotonic()
        status: int | str
        pod = None
        tokens = 0
        try:
            resp = client.post(self._url, json=self._body, headers=self._headers)
            status, pod = resp.status_code, resp.headers.get("x-inference-pod")
            if status == 200:
                lines = resp.text.splitlines()
                if "data: [DONE]" not in lines:
                    status = "truncated"
                for line in lines:
                    if line.startswith("data: {") and '"usage"' in line:
                        usage = json.loads(line[6:]).get("usage") or {}
                        tokens = int(usage.get("completion_tokens") or 0)
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        with self._lock:
            self.report.outcomes.append(Outcome(t0, time.monotonic(), status, pod))
            self.completion_tokens += tokens


@dataclass
class ProcSnapshot:
    """One ext_proc process's accounting counters (from its /metrics) at time `at`."""

    at: float
    records: float  # access-log records received: accounted + unrouted + error
    accounted: float
    routed: float  # routing streams ended on this process
    tokens: float  # completion tokens accounted
    als_streams: float  # Envoy access-log streams open (refreshed every 0.2 s)
    routing_streams: float  # ext_proc routing streams open (refreshed every 0.2 s)


def _snapshot(stack: LocalStack, index: int, timeout_s: float = 1.0) -> ProcSnapshot | None:
    o = stack.options
    at = time.monotonic()
    try:
        m = metric_samples(f"http://{o.host}:{o.metrics_port + index}/metrics", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    return ProcSnapshot(
        at=at,
        records=metric_sum(m, "extproc_access_records_total"),
        accounted=metric_sum(m, "extproc_access_records_total", result="accounted"),
        routed=metric_sum(m, "extproc_routed_requests_total"),
        tokens=metric_sum(m, "extproc_completion_tokens_total"),
        als_streams=metric_sum(m, "extproc_server_state", kind="access_log_streams"),
        routing_streams=metric_sum(m, "extproc_server_state", kind="grpc_streams"),
    )


def _lease_min_s(stack: LocalStack) -> float:
    return float(stack.server_config().get("accounting", {}).get("lease_min_s", 30.0))


def _counter(stack: LocalStack, index: int, name: str, **labels: str) -> float:
    o = stack.options
    try:
        m = metric_samples(f"http://{o.host}:{o.metrics_port + index}/metrics", timeout=1)
    except httpx.HTTPError:
        return 0.0
    return metric_sum(m, name, **labels)


def _in_flight(stack: LocalStack, index: int) -> int | None:
    o = stack.options
    try:
        eps = httpx.get(
            f"http://{o.host}:{o.metrics_port + index}/debug/endpoints",
            headers=o.admin_headers(),
            timeout=1,
        )
        return sum(int(e["in_flight"]) for e in eps.json())
    except httpx.HTTPError:
        return None


def _envoy_counters(stack: LocalStack, keep: Callable[[str], bool]) -> dict[str, int]:
    """Envoy's admin /stats counters whose names `keep` accepts."""
    o = stack.options
    try:
        text = httpx.get(f"http://{o.host}:{o.admin_port}/stats", timeout=2).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if keep(name) and value.strip().isdigit():
            out[name] = int(value)
    return out


def _envoy_stats(stack: LocalStack) -> dict[str, int]:
    return _envoy_counters(stack, lambda name: name in ENVOY_ALS_STATS)


def _accounting_sink_fault(
    stack: LocalStack,
    sig: signal.Signals,
    *,
    warmup_s: float,
    down_s: float,
    after_s: float,
    rate: float,
) -> dict[str, Any]:
    """Stop the ext_proc process holding Envoy's access-log stream (the accounting sink) with
    `sig` under open-loop streamed load, keep it down `down_s` once it exited, restart it.

    Phases (times from the signal): draining (SIGTERM only: until the process exited), down
    (until the restart), restarting (until its /readyz answers), after. Failed requests are
    counted by the phase they started in, plus those in flight at the signal.

    Records are counted on every process: the victim's up to its end (its last scrape before
    a SIGKILL; for SIGTERM its last scrape before it exited, after it stopped reading the log),
    the others' and the restarted process's at the end, once the counts stopped moving.
    records_lost = requests sent - records received (Envoy logs every request it answers,
    whatever its status); ok_minus_accounted = successful requests never accounted."""
    n = stack.options.extproc_processes
    if n < 2:
        raise ValueError("the accounting sink scenarios need extproc_processes >= 2")
    o = stack.options
    # Counters are per process life: count from here (a stack may have run scenarios before).
    start = [_snapshot(stack, i) for i in range(n)]
    if any(s is None for s in start):
        raise RuntimeError("an ext_proc process does not answer /metrics")
    envoy_before = _envoy_stats(stack)
    load = StreamedOpenLoad(f"{stack.base_url}/v1/chat/completions", rate=rate, timeout_s=30)
    with load:
        time.sleep(warmup_s)
        # Envoy's one worker keeps one access-log stream, on one process: the victim.
        holders: list[int] = []

        def one_holder() -> bool:
            snaps = [_snapshot(stack, i) for i in range(n)]
            holders[:] = [i for i, s in enumerate(snaps) if s is not None and s.als_streams >= 1]
            return len(holders) == 1

        if _wait(one_holder, 10.0, 0.1) is None:
            raise RuntimeError(f"not exactly one process holds the access-log stream: {holders}")
        victim = holders[0]
        name = f"extproc-{victim}"
        others = [i for i in range(n) if i != victim]
        at_kill: dict[int, ProcSnapshot] = {}
        for i in others:
            s = _snapshot(stack, i)
            if s is None:
                raise RuntimeError(f"extproc-{i} does not answer /metrics")
            at_kill[i] = s
        last = _snapshot(stack, victim)  # scraped last, just before the signal
        if last is None:
            raise RuntimeError(f"{name} does not answer /metrics")
        routing_at_signal = int(last.routing_streams)  # the gauge is up to 0.2 s old
        killed_at = time.monotonic()
        if sig == signal.SIGKILL:
            stack.kill(name, sig)  # returns once the process is reaped
        else:
            os.kill(stack.pid(name), sig)  # it drains on its own: watched below

        # Until the victim is gone and `down_s` more: does another process take the log?
        resumed: tuple[float, int] | None = None  # (time, process) of the first new record
        stream_at: float | None = None  # another process's stream gauge shows it
        exited_at = killed_at if sig == signal.SIGKILL else None
        deadline = killed_at + stack_grace(stack) + 10
        while time.monotonic() < deadline:
            now = time.monotonic()
            if exited_at is None:
                # Its /metrics goes away right after it ended the access-log stream (it exits
                # a while later): poll it often, so the last scrape follows its last record.
                snap = _snapshot(stack, victim, 0.3) if stack.alive(name) else None
                if snap is not None:
                    last = snap  # it still accounts while it drains
                elif not stack.alive(name):
                    exited_at = now
            for i in others:
                s = _snapshot(stack, i)
                if s is None:
                    continue
                if resumed is None and s.accounted > at_kill[i].accounted:
                    resumed = (now, i)
                if stream_at is None and s.als_streams >= 1:
                    stream_at = now
            if exited_at is not None and now - exited_at >= down_s:
                break
            time.sleep(0.01 if exited_at is None else 0.05)
        stack.restart(name)  # reaps the process (or ends it, had it outlived the deadline)
        restarted_at = time.monotonic()
        ready_in = _wait(lambda: _get_ok(f"http://{o.host}:{o.metrics_port + victim}/readyz"), 30)
        ready_at = time.monotonic() if ready_in is not None else None
        if resumed is None:  # nobody took the log while it was down: maybe the new process
            resumed = _first_new_record(stack, range(n), at_kill, 10.0)
        time.sleep(after_s)
        report = load.stop()
    stopped_at = time.monotonic()

    # Settle: a record comes at most one flush interval after its response.
    final: list[ProcSnapshot | None] = []

    def received(snaps: list[ProcSnapshot | None]) -> float:
        return sum(s.records for s in snaps if s is not None) + last.records

    def settled() -> bool:
        before = received([_snapshot(stack, i) for i in range(n)])
        time.sleep(3 * ALS_FLUSH_S)
        final[:] = [_snapshot(stack, i) for i in range(n)]
        return received(final) == before

    _wait(settled, 8.0, 0.0)
    # A lease whose record was lost (the victim's last batch) ends at its expiry.
    lease_wait_s = _lease_min_s(stack) + 5.0
    zero_in = _wait(lambda: all(_in_flight(stack, i) == 0 for i in range(n)), lease_wait_s, 0.1)
    in_flight_end = {f"extproc-{i}": _in_flight(stack, i) for i in range(n)}
    expired = sum(_counter(stack, i, "extproc_lease_ends_total", how="expired") for i in range(n))
    envoy_after = _envoy_stats(stack)

    def counted(name: str) -> float:
        """Over the scenario: the victim's first life (start to end) and its second (from 0),
        the others' from start to the end."""
        total = 0.0
        for i in range(n):
            s0, s1 = start[i], final[i] if final else None
            assert s0 is not None  # checked at the start
            if i == victim:
                total += getattr(last, name) - getattr(s0, name)
                total += getattr(s1, name) if s1 is not None else 0.0
            elif s1 is not None:
                total += getattr(s1, name) - getattr(s0, name)
        return total

    records = counted("records")
    accounted = counted("accounted")
    routed = counted("routed")
    tokens = counted("tokens")

    envoy = {k: envoy_after.get(k, 0) - envoy_before.get(k, 0) for k in envoy_after}

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - killed_at, 3)

    assert exited_at is not None
    phases = {
        "draining": (killed_at, exited_at),
        "down": (exited_at, restarted_at),
        "restarting": (restarted_at, ready_at or stopped_at),
        "after": (ready_at or stopped_at, stopped_at),
    }
    started: dict[str, dict[str, int]] = {}
    for phase, (t0, t1) in phases.items():
        xs = [x for x in report.outcomes if t0 <= x.started < t1]
        started[phase] = {"sent": len(xs), "failed": sum(1 for x in xs if x.status != 200)}
    in_flight_at_kill = [x for x in report.outcomes if x.started < killed_at <= x.ended]
    # The outage: from one flush interval (plus as much margin) before the signal, when
    # records still in Envoy's buffer or on the wire were bound for the victim, until the
    # first record accounted elsewhere.
    window_end = resumed[0] if resumed is not None else stopped_at
    in_window = [x for x in report.outcomes if killed_at - 2 * ALS_FLUSH_S <= x.ended <= window_end]
    return {
        **report.summary(),
        "signal": sig.name,
        "rate": rate,
        "victim": name,
        "victim_routing_streams_at_signal": routing_at_signal,
        "in_flight_at_signal": len(in_flight_at_kill),
        "failed_in_flight_at_signal": sum(1 for x in in_flight_at_kill if x.status != 200),
        # Cut: answered, then broken (the fail-closed answer is a request that reached the
        # victim as it went)
        "cut_in_flight_at_signal": sum(
            1 for x in in_flight_at_kill if x.status not in (200, EXTPROC_STATUS_ON_ERROR)
        ),
        "started": started,  # by phase: requests sent and failed
        # A fail-closed gateway answers 503 when it cannot route (the routing filter's
        # status_on_error); anything else (a timeout, a cut stream) for a request sent after
        # the signal would be worse.
        "failed_not_fail_closed_after_signal": sum(
            1
            for x in report.outcomes
            if x.started >= killed_at and x.status not in (200, EXTPROC_STATUS_ON_ERROR)
        ),
        "exited_after_s": rel(exited_at),
        # SIGTERM: the victim's records are counted up to this scrape (it stops answering
        # once it ended the access-log stream; a batch it read after would count as lost).
        "victim_last_scrape_after_s": rel(last.at),
        "restarted_after_s": rel(restarted_at),
        "ready_after_s": rel(ready_at),
        "als_stream_elsewhere_after_s": rel(stream_at),
        "accounting_resumed_after_s": rel(resumed[0]) if resumed else None,
        "accounting_resumed_on": f"extproc-{resumed[1]}" if resumed else None,
        "records_expected": report.sent,
        "records_received": int(records),
        "records_lost": int(report.sent - records),
        "completed_in_outage_window": len(in_window),
        "accounted": int(accounted),
        "ok_minus_accounted": int(report.ok - accounted),
        "routed_minus_accounted": int(routed - accounted),
        "completion_tokens_clients": load.completion_tokens,
        "completion_tokens_accounted": int(tokens),
        "in_flight_zero_after_s": zero_in,
        "in_flight_end": in_flight_end,
        "leases_expired": expired,  # on the processes alive at the end
        # Envoy's counters over the scenario. logs_written counts every entry Envoy logged,
        # so logs_written - records received is the loss as monitoring can see it.
        "envoy": envoy,
        "envoy_written_minus_received": envoy.get(ENVOY_ALS_STATS[0], 0) - int(records),
    }


def _first_new_record(
    stack: LocalStack, indexes: range, at_kill: dict[int, ProcSnapshot], timeout_s: float
) -> tuple[float, int] | None:
    """(time, process) of the first record accounted beyond a process's count at the signal
    (a restarted process starts from 0), or None."""
    found: list[int] = []

    def new() -> bool:
        for i in indexes:
            s = _snapshot(stack, i)
            base = at_kill[i].accounted if i in at_kill else 0.0
            if s is not None and s.accounted > base:
                found.append(i)
                return True
        return False

    return None if _wait(new, timeout_s, 0.05) is None else (time.monotonic(), found[0])


def accounting_sink_restart(
    stack: LocalStack,
    *,
    warmup_s: float = 2.0,
    down_s: float = 2.0,
    after_s: float = 2.0,
    rate: float = 20.0,
) -> dict[str, Any]:
    """SIGKILL the process holding Envoy's access-log stream under load, restart it."""
    return _accounting_sink_fault(
        stack, signal.SIGKILL, warmup_s=warmup_s, down_s=down_s, after_s=after_s, rate=rate
    )


def accounting_sink_sigterm(
    stack: LocalStack,
    *,
    warmup_s: float = 2.0,
    down_s: float = 2.0,
    after_s: float = 2.0,
    rate: float = 20.0,
) -> dict[str, Any]:
    """SIGTERM (graceful) the process holding Envoy's access-log stream under load; restart it
    `down_s` after it exited."""
    return _accounting_sink_fault(
        stack, signal.SIGTERM, warmup_s=warmup_s, down_s=down_s, after_s=after_s, rate=rate
    )


# -- shared state over NATS (the replica sync between ext_proc processes) ----------------------

DECISION_HISTOGRAM = "extproc_routing_decision_seconds"


def _decision_buckets(stack: LocalStack) -> dict[float, float] | None:
    """Cumulative decision-time bucket counts (upper bound -> count), summed over processes."""
    o = stack.options
    total: dict[float, float] = {}
    for i in range(o.extproc_processes):
        try:
            m = metric_samples(f"http://{o.host}:{o.metrics_port + i}/metrics", timeout=2)
        except httpx.HTTPError:
            return None
        for (name, labels), v in m.items():
            if name == DECISION_HISTOGRAM + "_bucket":
                le = float(dict(labels)["le"])
                total[le] = total.get(le, 0.0) + v
    return total


def bucket_quantile(
    before: dict[float, float], after: dict[float, float], q: float
) -> float | None:
    """The q-quantile (ms) of the observations between two cumulative bucket snapshots,
    interpolated linearly inside its bucket as Prometheus' histogram_quantile does."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    n = counts[-1] if counts else 0.0
    if n <= 0:
        return None
    rank = q * n
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if bound == float("inf"):
                return round(lower_bound * 1000, 3)
            share = (rank - lower_count) / (count - lower_count) if count > lower_count else 1.0
            return round((lower_bound + (bound - lower_bound) * share) * 1000, 3)
        lower_bound, lower_count = bound, count
    return None


def _sync_state(stack: LocalStack, i: int) -> dict[str, Any] | None:
    o = stack.options
    try:
        state = httpx.get(
            f"http://{o.host}:{o.metrics_port + i}/debug/sync", headers=o.admin_headers(), timeout=1
        ).json()
    except httpx.HTTPError:
        return None
    return state if isinstance(state, dict) else None


def _peer_counts(stack: LocalStack) -> list[int | None]:
    states = [_sync_state(stack, i) for i in range(stack.options.extproc_processes)]
    return [None if s is None else len(s.get("peers_last_heard_s") or {}) for s in states]


def _sync_counters(stack: LocalStack) -> dict[str, float]:
    o = stack.options
    out: Counter[str] = Counter()
    for i in range(o.extproc_processes):
        try:
            m = metric_samples(f"http://{o.host}:{o.metrics_port + i}/metrics", timeout=2)
        except httpx.HTTPError:
            continue
        for name in ("extproc_sync_stale_total", "extproc_sync_dropped_total"):
            out[name] += metric_sum(m, name)
    return dict(out)


def _latency_ms(xs: list[Outcome], q: float) -> float | None:
    """Client latency percentile (q in [0, 100]) of the successful requests, in ms."""
    p = percentile([x.ended - x.started for x in xs if x.status == 200], q)
    return None if p is None else round(p * 1000, 1)


def nats_kill(
    stack: LocalStack,
    *,
    warmup_s: float = 3.0,
    down_s: float = 3.0,
    after_s: float = 3.0,
    rate: float = 30.0,
) -> dict[str, Any]:
    """SIGKILL the NATS server that the ext_proc processes share state through, under open-loop
    load, keep it down `down_s`, start it again on the same port.

    Phases: before (the warm-up), down (signal to restart), recovering (restart until every
    process has its peers back), after. Per phase: requests sent and failed, client latency,
    and the routing decision time (p50/p99 from the servers' histogram, all processes)."""
    n = stack.options.extproc_processes
    nats = stack.nats
    if n < 2 or nats is None:
        raise ValueError("the NATS scenarios need extproc_processes >= 2 (which starts NATS)")
    if _wait(lambda: _peer_counts(stack) == [n - 1] * n, 15.0, 0.1) is None:
        raise RuntimeError(f"the processes do not see each other: {_peer_counts(stack)}")
    sync_before = _sync_counters(stack)
    marks: dict[str, dict[float, float] | None] = {}
    with OpenLoad(f"{stack.base_url}/v1/chat/completions", rate=rate, timeout_s=30) as load:
        started_at = time.monotonic()
        marks["start"] = _decision_buckets(stack)
        time.sleep(warmup_s)
        marks["kill"] = _decision_buckets(stack)
        killed_at = time.monotonic()
        pid = nats.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        # The processes notice: the connection drops, the peers' shares expire.
        disconnected_s = _wait(
            lambda: all((_sync_state(stack, i) or {}).get("connected") is False for i in range(n)),
            10.0,
            0.02,
        )
        expired_s = _wait(lambda: _peer_counts(stack) == [0] * n, 10.0, 0.02)
        time.sleep(max(0.0, down_s - (time.monotonic() - killed_at)))
        marks["restart"] = _decision_buckets(stack)
        restarted_at = time.monotonic()
        nats.stop()  # reaps the killed process
        nats.start()
        listening_at = time.monotonic()
        recovered_s = _wait(lambda: _peer_counts(stack) == [n - 1] * n, 30.0, 0.02)
        recovered_at = time.monotonic()
        marks["recovered"] = _decision_buckets(stack)
        time.sleep(after_s)
        marks["end"] = _decision_buckets(stack)
        report = load.stop()
    stopped_at = time.monotonic()
    # Every request has ended (the load waits for its answers): every lease must end too,
    # those whose records reached another process while the bus was away included.
    leases_ended_s = _wait(
        lambda: all(_in_flight_own(stack, i) == 0 and _in_flight(stack, i) == 0 for i in range(n)),
        10.0,
        0.05,
    )
    sync_after = _sync_counters(stack)
    phases = {
        "before": (started_at, killed_at, "start", "kill"),
        "down": (killed_at, restarted_at, "kill", "restart"),
        "recovering": (restarted_at, recovered_at, "restart", "recovered"),
        "after": (recovered_at, stopped_at, "recovered", "end"),
    }
    by_phase: dict[str, dict[str, Any]] = {}
    for phase, (t0, t1, m0, m1) in phases.items():
        xs = [x for x in report.outcomes if t0 <= x.started < t1]
        b0, b1 = marks.get(m0), marks.get(m1)
        by_phase[phase] = {
            "sent": len(xs),
            "failed": sum(1 for x in xs if x.status != 200),
            "client_p50_ms": _latency_ms(xs, 50),
            "client_p99_ms": _latency_ms(xs, 99),
            "decision_p50_ms": bucket_quantile(b0, b1, 0.5) if b0 and b1 else None,
            "decision_p99_ms": bucket_quantile(b0, b1, 0.99) if b0 and b1 else None,
        }
    return {
        **report.summary(),
        "processes": n,
        "rate": rate,
        "strategy": stack.options.strategy,
        "phases": by_phase,
        "disconnected_after_s": disconnected_s,
        "peers_expired_after_s": expired_s,
        "nats_listening_after_restart_s": round(listening_at - restarted_at, 3),
        # From the restart until every process hears all its peers again.
        "recovered_after_restart_s": recovered_s,
        # From the end of the load until no process holds or counts a lease (None: some were
        # left, counted as in flight on every replica until their expiry).
        "leases_ended_after_load_s": leases_ended_s,
        "leases_left": {f"extproc-{i}": _in_flight_own(stack, i) for i in range(n)},
        "sync": {k: sync_after.get(k, 0.0) - sync_before.get(k, 0.0) for k in sync_after},
    }


def sync_process_kill(stack: LocalStack, *, held: int = 6, warmup_s: float = 1.0) -> dict[str, Any]:
    """Hold `held` streamed requests open, SIGKILL one ext_proc process, and time how long the
    survivors still count its in-flight share (it should leave within sync.expire_s). The
    victim is a process that routed some of them, so its share is not zero."""
    n = stack.options.extproc_processes
    o = stack.options
    if n < 2:
        raise ValueError("sync_process_kill needs extproc_processes >= 2")
    if _wait(lambda: _peer_counts(stack) == [n - 1] * n, 15.0, 0.1) is None:
        raise RuntimeError(f"the processes do not see each other: {_peer_counts(stack)}")
    expire_s = float(stack.server_config().get("sync", {}).get("expire_s", 0.5))
    release = threading.Event()
    body = {**CHAT, "stream": True, "max_tokens": 20000, "ignore_eos": True}
    outcomes: list[str] = []

    def one() -> None:
        try:
            with (
                httpx.Client(timeout=60) as client,
                client.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body) as r,
            ):
                for _ in r.iter_lines():
                    if release.is_set():
                        break
                outcomes.append(str(r.status_code))
        except httpx.HTTPError as exc:
            outcomes.append(type(exc).__name__)

    def own(i: int) -> float | None:
        try:
            m = metric_samples(f"http://{o.host}:{o.metrics_port + i}/metrics", timeout=1)
        except httpx.HTTPError:
            return None
        return metric_sum(m, "extproc_in_flight_requests")

    threads = [threading.Thread(target=one, daemon=True) for _ in range(held)]
    for t in threads:
        t.start()
    try:
        seen = _wait(lambda: all(_in_flight(stack, i) == held for i in range(n)), 20.0, 0.05)
        if seen is None:
            views = [_in_flight(stack, i) for i in range(n)]
            owns = [own(i) for i in range(n)]
            raise RuntimeError(
                f"not every process sees {held} in flight: views {views}, own {owns}, "
                f"outcomes {outcomes}"
            )
        time.sleep(warmup_s)
        shares = [own(i) for i in range(n)]
        victim = max(range(n), key=lambda i: shares[i] or 0.0)
        survivors = [i for i in range(n) if i != victim]
        stack.kill(f"extproc-{victim}", signal.SIGKILL)

        def share_gone() -> bool:
            return all(_in_flight(stack, i) == (own(i) or 0.0) for i in survivors)

        gone_s = _wait(share_gone, 10.0, 0.01)
        views = {f"extproc-{i}": _in_flight(stack, i) for i in survivors}
    finally:
        release.set()
        for t in threads:
            t.join(15)
    stack.restart(f"extproc-{victim}")
    return {
        "processes": n,
        "held": held,
        "shares_at_kill": {f"extproc-{i}": s for i, s in enumerate(shares)},
        "victim": f"extproc-{victim}",
        "expire_s": expire_s,
        # From the SIGKILL until every survivor counts only its own requests (its view of the
        # pods' in-flight equals its own gauge): expire_s plus this loop's polling.
        "share_left_after_s": gone_s,
        "survivor_views_after": views,
        # The held responses that the victim routed are cut with it (Envoy keeps the routing
        # stream for the whole response and resets the response when that stream breaks).
        "held_outcomes": dict(Counter(outcomes)),
    }


# -- the router itself restarts: streams outlive the routing process -------------------------

REAL_TIME_SIM = ("--time-scale", "1.0")  # the e2e stacks run simulated GPU time 5x faster
LONG_STREAM = {
    **CHAT,
    "stream": True,
    "stream_options": {"include_usage": True},
    "ignore_eos": True,
}


@dataclass
class _Stream:
    status: int | str = 0
    chunks: int = 0  # content events received
    usage_tokens: int = 0  # completion_tokens of the usage the client saw
    done: bool = False  # `data: [DONE]` arrived
    routed_by: str = ""  # x-inference-pod of the answer


def _long_stream(url: str, body: dict[str, Any], out: _Stream, started: threading.Event) -> None:
    try:
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", url, json=body) as r,
        ):
            out.status = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out.done = True
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    out.usage_tokens = int(event["usage"].get("completion_tokens") or 0)
                if event.get("choices"):
                    out.chunks += 1
                    started.set()
    except (httpx.HTTPError, ValueError) as exc:
        out.status = type(exc).__name__


def _tokens_and_flight(stack: LocalStack) -> tuple[float, list[int | None]]:
    n = stack.options.extproc_processes
    tokens = 0.0
    for i in range(n):
        snap = _snapshot(stack, i)
        tokens += snap.tokens if snap is not None else 0.0
    return tokens, [_in_flight(stack, i) for i in range(n)]


def _ext_proc_stats(stack: LocalStack) -> dict[str, int]:
    """Envoy's routing filter counters (streams and messages each way), summed over names."""
    out: Counter[str] = Counter()
    for name, value in _envoy_counters(stack, lambda name: ".ext_proc." in name).items():
        out[name.rsplit(".", 1)[-1]] += value
    return dict(out)


def router_stop(
    stack: LocalStack,
    *,
    sig: signal.Signals,
    streams: int = 20,
    max_tokens: int = 2000,
    stop_after_s: float = 3.0,
) -> dict[str, Any]:
    """`streams` long streamed chats (>= 15 s each) in flight; signal one ext_proc process that
    routed some of them (SIGTERM: a rolling update, a scale-down; SIGKILL: a crash), restart it.
    Reports the cut streams (0 is the goal), the tokens the clients saw against those the
    processes accounted, and how long after the last stream every process's in-flight view
    came back to 0."""
    n = stack.options.extproc_processes
    url = f"{stack.base_url}/v1/chat/completions"
    body = {**LONG_STREAM, "max_tokens": max_tokens}
    tokens_before, _ = _tokens_and_flight(stack)
    results = [_Stream() for _ in range(streams)]
    flowing = [threading.Event() for _ in range(streams)]
    threads = [
        threading.Thread(target=_long_stream, args=(url, body, r, f), daemon=True)
        for r, f in zip(results, flowing, strict=True)
    ]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for f in flowing:
        f.wait(30)
    time.sleep(stop_after_s)
    done_before = sum(1 for r in results if r.done or r.status not in (0, 200))
    owned = {i: _snapshot(stack, i) for i in range(n)}
    shares = {i: _in_flight_own(stack, i) for i in range(n)}
    victim = max(range(n), key=lambda i: shares[i] or 0)
    victim_tokens = owned[victim].tokens if owned[victim] is not None else 0.0
    stack.signal(f"extproc-{victim}", sig)
    exited = _wait(lambda: not stack.alive(f"extproc-{victim}"), 30.0, 0.005)
    stack.restart(f"extproc-{victim}")
    o = stack.options
    ready = _wait(lambda: _get_ok(f"http://{o.host}:{o.metrics_port + victim}/readyz"), 30)
    for t in threads:
        t.join(180)
    t_end = time.monotonic()
    # Every process's view of the pods' in-flight back to 0 (records arrive within a flush).
    zero_s = _wait(lambda: _tokens_and_flight(stack)[1] == [0] * n, 60.0, 0.05)
    time.sleep(ALS_FLUSH_S * 2)
    tokens_after, views = _tokens_and_flight(stack)
    cut = [r for r in results if not (r.status == 200 and r.done)]
    return {
        "processes": n,
        "signal": sig.name,
        "streams": streams,
        "stream_s": round(t_end - t0, 1),
        "victim": f"extproc-{victim}",
        "victim_held": shares[victim],
        "ended_before_signal": done_before,  # 0: every stream was in flight at the signal
        "exited_after_signal_s": exited,
        "ready_again_after_s": ready,
        "cut": len(cut),
        "cut_statuses": dict(Counter(str(r.status) for r in cut)),
        "client_tokens": sum(r.usage_tokens for r in results),
        # The victim's counters die with it: what it had accounted before the signal is added.
        "accounted_tokens": tokens_after - tokens_before + victim_tokens,
        "in_flight_zero_after_last_stream_s": zero_s,
        "in_flight_views_after": views,
    }


def _in_flight_own(stack: LocalStack, index: int) -> int:
    """The requests process `index` holds leases for (its own gauge, no peers' shares)."""
    return int(_counter(stack, index, "extproc_in_flight_requests"))


def rolling_restart(
    stack: LocalStack,
    *,
    rate: float = 10.0,
    streams: int = 10,
    max_tokens: int = 2000,
    warmup_s: float = 3.0,
    pause_s: float = 2.0,
    after_s: float = 3.0,
) -> dict[str, Any]:
    """Open-loop short chats at `rate`/s plus `streams` long streams, while every ext_proc
    process is restarted in turn (SIGTERM, wait for its exit, start, wait until ready): the
    failed requests and cut streams (0 and 0 is the goal)."""
    n = stack.options.extproc_processes
    o = stack.options
    url = f"{stack.base_url}/v1/chat/completions"
    body = {**LONG_STREAM, "max_tokens": max_tokens}
    results = [_Stream() for _ in range(streams)]
    flowing = [threading.Event() for _ in range(streams)]
    threads = [
        threading.Thread(target=_long_stream, args=(url, body, r, f), daemon=True)
        for r, f in zip(results, flowing, strict=True)
    ]
    restarts = []
    with OpenLoad(url, rate=rate) as load:
        for t in threads:
            t.start()
        time.sleep(warmup_s)
        for i in range(n):
            name = f"extproc-{i}"
            t_sig = time.monotonic()
            stack.signal(name, signal.SIGTERM)
            exited = _wait(lambda name=name: not stack.alive(name), 30.0, 0.005)
            stack.restart(name)
            ready = _wait(lambda i=i: _get_ok(f"http://{o.host}:{o.metrics_port + i}/readyz"), 30)
            restarts.append({"process": name, "exited_s": exited, "ready_s": ready,
                             "took_s": round(time.monotonic() - t_sig, 2)})  # fmt: skip
            time.sleep(pause_s)
        time.sleep(after_s)
        report = load.stop()
    for t in threads:
        t.join(180)
    cut = [r for r in results if not (r.status == 200 and r.done)]
    return {
        **report.summary(),
        "processes": n,
        "rate": rate,
        "restarts": restarts,
        "streams": streams,
        "cut": len(cut),
        "cut_statuses": dict(Counter(str(r.status) for r in cut)),
    }


@dataclass
class _Turn:
    conversation: int
    turn: int
    started: float
    status: int | str
    pod: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0


def _conversation(
    url: str,
    index: int,
    stop: threading.Event,
    turns: list[_Turn],
    lock: threading.Lock,
    *,
    max_tokens: int,
    think_s: float,
) -> None:
    """One multi-turn chat: its own system prompt (so turn 1 caches nothing), each turn the
    whole history plus a new question, the answer appended; until `stop`."""
    system = f"Conversation {index}. " + " ".join(
        f"Rule {index}.{i}: keep answers short and exact." for i in range(40)
    )
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    session: str | None = None
    with httpx.Client(timeout=60) as client:
        turn = 0
        while not stop.is_set():
            turn += 1
            messages.append(
                {"role": "user", "content": f"Question {turn} of conversation {index}: go on."}
            )
            headers = {"x-session-id": session} if session else {}
            body = {"model": "qwen3", "messages": messages, "max_tokens": max_tokens}
            record = _Turn(index, turn, time.monotonic(), "pending")
            try:
                r = client.post(url, json=body, headers=headers)
                record.status = r.status_code
                record.pod = r.headers.get("x-inference-pod")
                if r.status_code == 200:
                    data = r.json()
                    usage = data.get("usage") or {}
                    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    record.cached_tokens = int(details.get("cached_tokens") or 0)
                    answer = data["choices"][0]["message"]["content"] or ""
                    messages.append({"role": "assistant", "content": answer})
                    session = r.headers.get("x-session-id") or session
                else:
                    messages.pop()  # the question is asked again
            except httpx.HTTPError as exc:
                record.status = type(exc).__name__
                messages.pop()
            with lock:
                turns.append(record)
            stop.wait(think_s)


def rolling_restart_sessions(
    stack: LocalStack,
    *,
    restart: bool = True,
    conversations: int = 24,
    max_tokens: int = 24,
    think_s: float = 0.3,
    warmup_s: float = 8.0,
    pause_s: float = 2.0,
    after_s: float = 8.0,
    eds_delay_s: float | None = None,
) -> dict[str, Any]:
    """Multi-turn conversations (a session header sent back, the history growing every turn)
    while every ext_proc process is restarted in turn (SIGTERM, wait for its exit, start,
    wait until ready, `pause_s`), or, `restart=False`, the same time without restarts (the
    reference). `eds_delay_s` (Envoy Gateway shape): as on a cluster, where the pod's
    deletion sends it SIGTERM and Envoy Gateway's EDS drops its endpoint a moment later, the
    process leaves the EDS stand-in `eds_delay_s` after its SIGTERM and comes back once
    ready (None: it stays listed, its health check the only sign). Figures: requests lost, the prefix hit rate of turns 2 and later (cached /
    prompt tokens, from each answer's usage) before, during and after the restarts, and the
    share of those turns served by the pod that served the conversation's previous turn."""
    n = stack.options.extproc_processes
    o = stack.options
    url = f"{stack.base_url}/v1/chat/completions"
    stop = threading.Event()
    turns: list[_Turn] = []
    lock = threading.Lock()
    threads = [
        threading.Thread(
            target=_conversation,
            args=(url, i, stop, turns, lock),
            kwargs={"max_tokens": max_tokens, "think_s": think_s},
            daemon=True,
        )
        for i in range(conversations)
    ]
    for t in threads:
        t.start()
    time.sleep(warmup_s)
    began = time.monotonic()
    restarts = []
    for i in range(n):
        name = f"extproc-{i}"
        t_sig = time.monotonic()
        if restart:
            withdraw = None
            if eds_delay_s is not None:
                withdraw = threading.Timer(eds_delay_s, stack.withdraw, args=(name,))
                withdraw.start()
            stack.signal(name, signal.SIGTERM)
            exited = _wait(lambda name=name: not stack.alive(name), 30.0, 0.005)
            if withdraw is not None:
                withdraw.join()  # a process that left before its endpoint did: still listed
            stack.restart(name)
            ready = _wait(lambda i=i: _get_ok(f"http://{o.host}:{o.metrics_port + i}/readyz"), 30)
            if eds_delay_s is not None:
                stack.readmit(name)
            took = round(time.monotonic() - t_sig, 2)
            restarts.append({"process": name, "exited_s": exited, "ready_s": ready, "took_s": took})
        else:
            time.sleep(5.0)  # about what a restart takes, so both runs last as long
        time.sleep(pause_s)
    ended = time.monotonic()
    time.sleep(after_s)
    stop.set()
    for t in threads:
        t.join(90)
    turns.sort(key=lambda r: (r.conversation, r.turn))
    previous_pod: dict[int, str | None] = {}
    phases: dict[str, dict[str, int]] = {
        p: {"turns": 0, "prompt": 0, "cached": 0, "same_pod": 0}
        for p in ("before", "during", "after")
    }
    for r in turns:
        if r.status != 200:
            continue
        phase = "before" if r.started < began else "during" if r.started < ended else "after"
        if r.turn > 1 and r.conversation in previous_pod:
            ph = phases[phase]
            ph["turns"] += 1
            ph["prompt"] += r.prompt_tokens
            ph["cached"] += r.cached_tokens
            ph["same_pod"] += int(previous_pod[r.conversation] == r.pod)
        previous_pod[r.conversation] = r.pod
    figures = {
        p: {
            "turns": ph["turns"],
            "hit_rate": round(ph["cached"] / ph["prompt"], 4) if ph["prompt"] else None,
            "same_pod": round(ph["same_pod"] / ph["turns"], 4) if ph["turns"] else None,
        }
        for p, ph in phases.items()
    }
    statuses = Counter(str(r.status) for r in turns)
    return {
        "restart": restart,
        "eds_delay_s": eds_delay_s,
        "processes": n,
        "conversations": conversations,
        "sent": len(turns),
        "lost": sum(1 for r in turns if r.status != 200),
        "by_status": dict(statuses),
        "restarts": restarts,
        "window_s": round(ended - began, 2),
        "phases": figures,
    }


STALL_1S = {"routing": {"stall_after_s": 1.0}}  # the default is 10 s; 1 s fits a 5 s hang
# A chat with a system prompt every client shares (~25 blocks): what the default rule's prefix
# scoring sees in a real deployment (every pod caches it after the warm-up).
SHARED_PREFIX_CHAT = {
    "model": "qwen3",
    "messages": [
        {"role": "system", "content": " ".join(f"rule {i}: answer briefly." for i in range(80))},
        {"role": "user", "content": "Say something reliable."},
    ],
    "max_tokens": 8,
}


def server_sigkill(
    stack: LocalStack,
    *,
    kills: int = 5,
    rate: float = 80.0,
    warmup_s: float = 2.0,
    down_s: float = 1.0,
    settle_s: float = 1.5,
) -> dict[str, Any]:
    """SIGKILL ext_proc process 1 `kills` times under open-loop load at `rate`/s, restarting
    it `down_s` later; the next kill comes `settle_s` after it is ready again (Envoy's health
    check, every 0.5 s, has it back in rotation). A request is lost when it is not answered
    200; each loss is put on the kill it started nearest to, with its start relative to the
    kill (negative: sent before it). What the routing stream's retry triggers change: a stream
    Envoy sent on its connection to the dead process before reading the close is reset."""
    o = stack.options
    if o.extproc_processes < 2:
        raise ValueError("server_sigkill needs extproc_processes >= 2")
    kill_at: list[float] = []
    ready_s: list[float | None] = []
    with OpenLoad(f"{stack.base_url}/v1/chat/completions", rate=rate, timeout_s=30) as load:
        time.sleep(warmup_s)
        for _ in range(kills):
            kill_at.append(time.monotonic())
            stack.kill("extproc-1", signal.SIGKILL)
            time.sleep(down_s)
            stack.restart("extproc-1")
            ready_s.append(
                _wait(lambda: _get_ok(f"http://{o.host}:{o.metrics_port + 1}/readyz"), 60)
            )
            time.sleep(settle_s)
        report = load.stop()
    per_kill: list[list[float]] = [[] for _ in kill_at]
    for x in report.outcomes:
        if x.status != 200:
            k = min(range(len(kill_at)), key=lambda i: abs(x.started - kill_at[i]))
            per_kill[k].append(round((x.started - kill_at[k]) * 1000.0, 1))
    return {
        **report.summary(),
        "rate": rate,
        "kills": kills,
        "retry_on": o.extproc_retry_on or "(default)",
        "lost_per_kill": [len(xs) for xs in per_kill],
        # When each lost request was sent, in ms from its kill.
        "lost_sent_ms_from_kill": per_kill,
        "ready_after_restart_s": ready_s,
    }


# Issue 32 #4: the defaults (kv-aware, KV events), 2 processes, 24 conversations; the same run
# without restarts is the reference for the hit rate and the pods kept.
SESSIONS_STACK: dict[str, Any] = {"extproc_processes": 2, "strategy": "kv-aware", "sims": 4}

SCENARIOS: dict[str, tuple[dict[str, Any], Callable[[LocalStack], dict[str, Any]]]] = {
    "pod_kill": ({}, lambda s: pod_kill(s, warmup_s=2, down_s=5, after_s=3, concurrency=8)),
    "pod_hang": (
        {"server_config": STALL_1S},
        lambda s: pod_hang(s, warmup_s=2, hang_s=5, rate=40),
    ),
    "pod_hang_detection_off": (
        {"server_config": {"routing": {"stall_after_s": 0}}},
        lambda s: pod_hang(s, warmup_s=2, hang_s=5, rate=40),
    ),
    "pod_hang_least_request": (
        {"server_config": STALL_1S},
        lambda s: pod_hang(s, warmup_s=2, hang_s=5, concurrency=8, strategy="least-request"),
    ),
    # The default rule and stall settings, clients that wait for each answer (issue 32 #5).
    "pod_hang_default": (
        {"strategy": "kv-aware"},
        lambda s: pod_hang(
            s, warmup_s=2, hang_s=15, concurrency=8, body=SHARED_PREFIX_CHAT, busiest=True
        ),
    ),
    "pod_hang_default_open": (
        {"strategy": "kv-aware"},
        lambda s: pod_hang(
            s, warmup_s=2, hang_s=15, rate=40, body=SHARED_PREFIX_CHAT, busiest=True
        ),
    ),
    "ext_proc_fail_closed": (
        {"fail_open": False},
        lambda s: ext_proc_restart(s, warmup_s=2, down_s=3, after_s=3),
    ),
    "ext_proc_fail_open": (
        {"fail_open": True},
        lambda s: ext_proc_restart(s, warmup_s=2, down_s=3, after_s=3),
    ),
    "graceful_shutdown": (
        {"server_config": {"server": {"shutdown_grace_s": 20.0}}},
        lambda s: graceful_shutdown(s, max_tokens=600),
    ),
    # Two ext_proc processes: the one holding Envoy's access-log stream goes away under load.
    "accounting_sink_restart": (
        {"extproc_processes": 2},
        lambda s: accounting_sink_restart(s, warmup_s=3, down_s=3, after_s=3, rate=20),
    ),
    "accounting_sink_sigterm": (
        {"extproc_processes": 2},
        lambda s: accounting_sink_sigterm(s, warmup_s=3, down_s=3, after_s=3, rate=20),
    ),
    # Two ext_proc processes sharing state over the local stack's NATS server.
    "nats_kill": (  # prefix-cache reads both shared parts: in-flight and approximate blocks
        {"extproc_processes": 2, "kv_events": False, "strategy": "prefix-cache"},
        lambda s: nats_kill(s, warmup_s=4, down_s=4, after_s=4, rate=30),
    ),
    "sync_process_kill": (
        {"extproc_processes": 2, "kv_events": False},
        lambda s: sync_process_kill(s, held=6),
    ),
    # The routing process goes away while the long streams it routed are in flight (simulated
    # GPU time at 1x: a 2,000-token stream takes 15-20 s).
    "router_sigterm": (
        {
            "extproc_processes": 2,
            "kv_events": False,
            "strategy": "least-request",
            "sim_args": REAL_TIME_SIM,
        },
        lambda s: router_stop(s, sig=signal.SIGTERM, streams=20, max_tokens=2000),
    ),
    # Issue 32: a server process SIGKILLed 5 times under 80 requests/s, with the routing
    # stream's retry triggers (reset among them), and without reset (as before 2026-12-04).
    **{
        f"server_sigkill{suffix}": (
            {
                "extproc_processes": 2,
                "kv_events": False,
                "strategy": "least-request",
                "extproc_retry_on": retry_on,
            },
            lambda s: server_sigkill(s, kills=5, rate=80.0),
        )
        for suffix, retry_on in (
            ("", None),
            ("_no_reset", "connect-failure,refused-stream,unavailable,cancelled"),
        )
    },
    "router_sigkill": (
        {
            "extproc_processes": 3,
            "kv_events": False,
            "strategy": "least-request",
            "sim_args": REAL_TIME_SIM,
        },
        lambda s: router_stop(s, sig=signal.SIGKILL, streams=30, max_tokens=2000),
    ),
    "rolling_restart": (
        {
            "extproc_processes": 2,
            "kv_events": False,
            "strategy": "least-request",
            "sim_args": REAL_TIME_SIM,
        },
        lambda s: rolling_restart(s, rate=10, streams=10, max_tokens=2000),
    ),
    # Issue 32 #5: the fault matrix under the default rule (kv-aware), a shared system prompt,
    # the fault on the pod holding it (where every request goes), 2 processes.
    **{
        f"pod_{fault}_default{suffix}": (
            {"strategy": "kv-aware", "extproc_processes": 2},
            lambda s, fault=fault, rate=rate: pod_fault_default(
                s, fault, rate=rate, body=SHARED_PREFIX_CHAT
            ),
        )
        for fault in ("kill", "slow", "errors")
        for suffix, rate in (("", None), ("_open", 40.0))
    },
    "rolling_restart_sessions": (
        SESSIONS_STACK,
        lambda s: rolling_restart_sessions(s, restart=True),
    ),
    "sessions_no_restart": (
        SESSIONS_STACK,
        lambda s: rolling_restart_sessions(s, restart=False),
    ),
    # The same in Envoy Gateway's translation of deploy/ (its health check, retries, 1 s
    # access-log flush), its EDS dropping the terminating pod's endpoint 1 s after the
    # SIGTERM; then 12 s after it (past the process's 10 s shutdown_grace_s: what a slow
    # control plane costs); and never (the endpoint stays: the health check alone).
    "rolling_restart_sessions_eg": (
        {**SESSIONS_STACK, "gateway_shape": GatewayShape.ENVOY_GATEWAY},
        lambda s: rolling_restart_sessions(s, restart=True, eds_delay_s=1.0),
    ),
    "rolling_restart_sessions_eg_slow_eds": (
        {**SESSIONS_STACK, "gateway_shape": GatewayShape.ENVOY_GATEWAY},
        lambda s: rolling_restart_sessions(s, restart=True, eds_delay_s=12.0),
    ),
    "rolling_restart_sessions_eg_no_eds": (
        {**SESSIONS_STACK, "gateway_shape": GatewayShape.ENVOY_GATEWAY},
        lambda s: rolling_restart_sessions(s, restart=True),
    ),
    "sessions_no_restart_eg": (
        {**SESSIONS_STACK, "gateway_shape": GatewayShape.ENVOY_GATEWAY},
        lambda s: rolling_restart_sessions(s, restart=False),
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--scenario", action="append", choices=sorted(SCENARIOS))
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args()
    results: dict[str, Any] = {}
    for name in args.scenario or list(SCENARIOS):
        changes, run = SCENARIOS[name]
        with (
            tempfile.TemporaryDirectory(prefix=f"faults-{name}-") as tmp,
            running(stack_options(Path(tmp), **changes)) as stack,
        ):
            fig = run(stack)
        results[name] = fig
        print(f"{name}: {json.dumps(fig)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
