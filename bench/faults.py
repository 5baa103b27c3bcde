"""Fault scenarios under load through the real local stack (Envoy + ext_proc + simulators).

Each scenario starts a LocalStack, runs a bounded closed-loop load (`concurrency` clients,
each sending the next request when the last one ends), injects one fault, and reports what
the clients saw: requests sent, succeeded, lost (any non-200 or transport error), errors by
status, and recovery times. tests/reliability/test_faults_e2e.py runs the same functions
with small loads and asserts on the figures; docs/reliability.md quotes a full run.

Usage: .venv/bin/python bench/faults.py [--scenario NAME ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
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

from extproc.stack.local import LocalStack, StackOptions
from tests.e2e.harness import stack_options as harness_options

__all__ = [
    "SCENARIOS",
    "Load",
    "LoadReport",
    "OpenLoad",
    "ext_proc_restart",
    "graceful_shutdown",
    "pod_hang",
    "pod_kill",
    "stack_options",
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
        return {"sent": self.sent, "ok": self.ok, "lost": self.lost, "by_status": self.by_status()}


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
        pod = None
        try:
            resp = client.post(self._url, json=self._body, headers=self._headers)
            status, pod = resp.status_code, resp.headers.get("x-inference-pod")
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        with self._lock:
            self.report.outcomes.append(Outcome(t0, time.monotonic(), status, pod))

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


def _endpoint_field(stack: LocalStack, address: str, field: str) -> bool | None:
    o = stack.options
    try:
        eps = httpx.get(f"http://{o.host}:{o.metrics_port}/debug/endpoints", timeout=2).json()
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
) -> dict[str, Any]:
    """One simulator accepts requests and never answers (completions_hang), then recovers.
    Closed loop with `concurrency` clients, or open loop at `rate` requests/s."""
    headers = {"routing-strategy": strategy} if strategy else {}
    url = f"{stack.base_url}/v1/chat/completions"
    address = stack.options.sim_address(1)
    load_gen = (
        OpenLoad(url, rate=rate, headers=headers, timeout_s=60)
        if rate is not None
        else Load(url, concurrency=concurrency, headers=headers, timeout_s=60)
    )
    with load_gen as load:
        time.sleep(warmup_s)
        t0 = time.monotonic()
        _fault(stack, 1, completions_hang=True)
        # routing.stall_after_s: the hung pod leaves the candidates once it holds a request that
        # long while answering nothing (None: never, e.g. with the detection off)
        stalled_s = _wait(lambda: _endpoint_field(stack, address, "stalled") is True, hang_s)
        time.sleep(max(0.0, hang_s - (time.monotonic() - t0)))
        during = load.since(t0)  # finished during the hang: served by the other pods
        _fault(stack, 1, completions_hang=False)
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
    body = {**CHAT, "max_tokens": max_tokens, "stream": True}
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
                stack.kill("extproc-0", signal.SIGTERM)
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


STALL_1S = {"routing": {"stall_after_s": 1.0}}  # the default is 10 s; 1 s fits a 5 s hang
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
