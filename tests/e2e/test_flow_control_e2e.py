"""Flow control through real Envoy, two ext_proc processes on the replica bus, simulators.

- scale from zero: the model has no ready pod, requests wait in the gateway, a simulator
  starts, they are served; with no pod within the TTL, 503 with the reason;
- above capacity: requests queue, the high-priority band is dispatched first (its requests
  finish before the low band's that were sent earlier), every request ends served.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from extproc.stack.local import LocalStack
from tests.e2e.harness import metric_samples, metric_sum, running_stack, stack_options, wait_for

pytestmark = pytest.mark.e2e

TTL_S = 15.0  # long enough for a simulator to start on a loaded machine
LOW = 24  # low-priority requests sent before the high band's 6


def _sum(stack: LocalStack, name: str, **labels: str) -> float:
    o = stack.options
    return sum(
        metric_sum(metric_samples(f"http://{o.host}:{o.metrics_port + i}/metrics"), name, **labels)
        for i in range(o.extproc_processes)
    )


def _ready_pods(stack: LocalStack) -> int:
    """Ready pods as the process that sees the most of them (every process must agree that
    none is ready before a test counts on it)."""
    o = stack.options
    counts = []
    for i in range(o.extproc_processes):
        eps = httpx.get(
            f"http://{o.host}:{o.metrics_port + i}/debug/endpoints", timeout=5,
            headers=o.admin_headers(),
        ).json()  # fmt: skip
        counts.append(sum(1 for e in eps if e.get("ready")))
    return max(counts)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    opts = stack_options(
        tmp_path_factory.mktemp("flow"), sims=1, extproc_processes=2, kv_events=False,
        flow_control=True,
        sim_args=("--time-scale", "1.0", "--max-num-seqs", "2"),
        server_config={
            "flow_control": {"enabled": True, "ttl_s": TTL_S},
            "saturation": {"queue_threshold": 1},
            "metrics": {"poll_interval_s": 0.2, "stale_after_s": 1.0},
        },
    )  # fmt: skip
    with running_stack(opts) as s:
        yield s


def _chat(stack: LocalStack, max_tokens: int, headers: dict[str, str] | None = None) -> Any:
    return httpx.post(
        f"{stack.base_url}/v1/chat/completions",
        json={"model": "qwen3", "max_tokens": max_tokens,
              "messages": [{"role": "user", "content": "tell me a story"}]},
        headers=headers or {}, timeout=60,
    )  # fmt: skip


def test_scale_from_zero_requests_wait_then_are_served(stack: LocalStack) -> None:
    stack.kill("sim-0")
    try:
        assert wait_for(lambda: _ready_pods(stack) == 0, timeout=10)
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(_chat, stack, 4) for _ in range(4)]
            time.sleep(1.5)
            done = [f.result().text for f in futures if f.done()]
            assert done == []  # waiting in the gateway, not failed
            stack.respawn("sim-0")  # the pool scales up from zero
            results = [f.result() for f in futures]
    finally:
        if not stack.alive("sim-0"):
            stack.respawn("sim-0")
    assert [r.status_code for r in results] == [200] * 4, [r.text for r in results]
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in results)
    # They waited (seconds, not the fast path) and were dispatched.
    waited = _sum(stack, "extproc_flow_control_request_queue_duration_seconds_count",
                  outcome="dispatched") - _sum(
        stack, "extproc_flow_control_request_queue_duration_seconds_bucket",
        outcome="dispatched", le="1.0",
    )  # fmt: skip
    assert waited >= 4


def test_no_pod_within_the_ttl_is_503_with_the_reason(stack: LocalStack) -> None:
    assert wait_for(lambda: _ready_pods(stack) == 1, timeout=15)
    stack.kill("sim-0")
    try:
        # An idle pod is scraped every 2 s at most here (idle_poll_interval_s): its death is
        # seen at that scrape, which a refused connection ends at once.
        assert wait_for(lambda: _ready_pods(stack) == 0, timeout=10)
        started = time.monotonic()
        reply = _chat(stack, 4)
        waited = time.monotonic() - started
        assert reply.status_code == 503, reply.text
        assert reply.headers["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"
        assert reply.json()["error"]["code"] == "rejected-no-endpoints"
        assert waited >= TTL_S - 0.5
    finally:
        stack.respawn("sim-0")
    assert wait_for(lambda: _ready_pods(stack) == 1, timeout=15)


def test_above_capacity_the_high_band_goes_first(stack: LocalStack) -> None:
    assert wait_for(lambda: _ready_pods(stack) == 1, timeout=15)
    ended: dict[str, list[float]] = {"low": [], "high": []}
    statuses: list[int] = []
    lock = threading.Lock()
    t0 = time.monotonic()

    def one(band: str, priority: int) -> None:
        r = _chat(stack, 64, {"x-request-priority": str(priority)})
        with lock:
            statuses.append(r.status_code)
            ended[band].append(time.monotonic() - t0)

    with ThreadPoolExecutor(LOW + 6) as pool:
        low = [pool.submit(one, "low", 0) for _ in range(LOW)]
        # The low band queues first: about 6 s of work for the engine's 2 slots (0.5 s each on
        # a quiet machine), deep enough that the few low requests a loaded machine lets
        # through early (a replica's view of its peer's dispatches is one sync tick late)
        # still leave most of the band waiting behind the high one.
        time.sleep(1.0)
        high = [pool.submit(one, "high", 5) for _ in range(6)]
        for f in [*low, *high]:
            f.result()
    assert statuses == [200] * (LOW + 6)
    # The engine holds 2 running + 1 waiting; everything else waited in the gateway, where
    # the later high band was dispatched before the earlier low band's rest.
    mean = {band: sum(v) / len(v) for band, v in ended.items()}
    assert mean["high"] < mean["low"], (mean, ended)
    assert sorted(ended["high"])[-1] < sorted(ended["low"])[-1], ended
