"""A routing stream refused by the process Envoy chose, or reset because that process died
with it open, goes to another (issue 32 #4).

Envoy may send a new routing stream to a process whose port is closed: one that has just
finished its drain while Envoy, seeing no healthy process (a peer restarted a moment ago and
not yet checked), is in panic mode; or one not yet listening. Fail-closed, each such stream was
a user's 500. The routing filter's gRPC service now retries a stream refused before the server
read it (connect-failure, refused-stream, unavailable) on another process.

The test makes the window wide on purpose: `shutdown_announce_s: 0` closes the port at the
signal, before Envoy's next health check (every 0.5 s) can see NOT_SERVING, so Envoy keeps
choosing the stopped process for up to half a second. With `extproc_retries=0` the same run
loses a request at each stop (measured: docs/reliability.md).

A process that dies (SIGKILL) with routing streams open resets them; Envoy keeps sending new
ones on its connection until it reads the close (tens of milliseconds). Those streams are
retried too (`reset`): Envoy retries only a stream none of whose answer has come back. That is
every stream in the `one_message` shape, where the decision is the first answer; in the
two-message shape a stream whose headers' CONTINUE had gone out is lost (a 503) if the kill
catches it before its decision (docs/reliability.md, "What a crash still costs"): a window of
milliseconds that a loaded machine widens, so the kill test runs `one_message`.

Both count requests in a fault's window: `alone` (CI failed once with the SIGTERM test beside
another worker's load: 6 of 548 were 503s; Envoy's gRPC errors are in the failure message now).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

from bench.faults import OpenLoad, running, stack_options
from tests.e2e.harness import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.alone]

STOPS = 4


def _grpc_errors(workdir: Path) -> list[str]:
    """What Envoy said of the routing streams that failed (a filter's 503 has no body)."""
    log = (workdir / "envoy.log").read_text(errors="replace").splitlines()
    return [line[-160:] for line in log if "gRPC error" in line][:5]


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_process_that_closes_its_port_at_once_loses_no_request(tmp_path: Path) -> None:
    opts = stack_options(
        tmp_path,
        sims=2,
        kv_events=False,
        strategy="least-request",
        extproc_processes=2,
        server_config={"server": {"shutdown_announce_s": 0.0}},
    )
    with running(opts) as s:
        o = s.options
        readyz = f"http://{o.host}:{o.metrics_port + 1}/readyz"
        with OpenLoad(f"{s.base_url}/v1/chat/completions", rate=40) as load:
            # Past the stack's first seconds: a process stopped about 1 s after the start lost
            # requests even with 4 retries, Envoy sending every attempt to it for ~250 ms
            # (docs/reliability.md, "Where two retries were not enough"); 3 s later, none.
            time.sleep(3.0)
            for _ in range(STOPS):
                s.signal("extproc-1", signal.SIGTERM)
                assert wait_for(lambda: not s.alive("extproc-1"), timeout=30)
                time.sleep(0.5)  # Envoy's health check sees it gone
                s.restart("extproc-1")
                assert wait_for(lambda: _ready(readyz), timeout=30)
                time.sleep(1.0)  # checked healthy again, and serving
            report = load.stop()
    summary = report.summary()
    assert summary["sent"] > 100, summary
    # Without the retry a run this size loses ~20 (53 of 1,730 measured); with it, none, but
    # for two races outside our code that this config (the port closed at the signal) widens,
    # each met once in the `alone` runs of 2026-12-06: a stream sent just as gRPC stops got
    # no handler and waited out Envoy's message timeout (a 504), and in Envoy's first seconds
    # it sent every attempt to the stopped process (a 503; hence the 3 s above).
    failed = {k: v for k, v in summary["by_status"].items() if k != "200"}
    assert set(failed) <= {"503", "504"}, (summary, _grpc_errors(tmp_path))
    assert summary["lost"] <= 2, (summary, _grpc_errors(tmp_path))


def test_streams_open_on_a_process_that_dies_are_retried_on_another(tmp_path: Path) -> None:
    # The window a SIGKILL leaves (streams sent to a process that will never answer them) made
    # wide: the process is stopped (SIGSTOP) for 0.8 s under 50 requests/s, so Envoy, whose
    # health check waits 1 s for an answer, keeps sending it streams (LEAST_REQUEST between
    # two: at least a quarter of them), then it is killed. Without `reset` among the routing
    # stream's retry triggers every one of those is a fail-closed 503.
    opts = stack_options(
        tmp_path, sims=2, kv_events=False, strategy="least-request", extproc_processes=2,
        one_message=True,
    )  # fmt: skip
    with running(opts) as s, OpenLoad(f"{s.base_url}/v1/chat/completions", rate=50) as load:
        time.sleep(1.5)
        s.signal("extproc-1", signal.SIGSTOP)
        stopped_at = time.monotonic()
        time.sleep(0.8)
        killed_at = time.monotonic()
        s.kill("extproc-1", signal.SIGKILL)
        time.sleep(1.0)
        report = load.stop()
    # Sent while it was stopped and answered only after the kill: held by the stopped process.
    held = [
        x
        for x in report.outcomes
        if stopped_at <= x.started < killed_at - 0.2 and x.ended >= killed_at
    ]
    summary = report.summary()
    assert len(held) >= 3, (len(held), summary)  # the fault met requests
    assert summary["lost"] == 0, (summary, _grpc_errors(tmp_path))
