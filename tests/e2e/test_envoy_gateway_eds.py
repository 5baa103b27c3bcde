"""The Envoy Gateway shape's EDS stand-in: the server processes' clusters read their endpoints
from files the local stack writes, so a process leaves them as a terminating pod leaves
Envoy Gateway's EDS (and `bench/faults.py`'s rolling restart in that shape can do what a
cluster does)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from extproc.stack.envoy_gateway import GatewayShape, eds_path
from extproc.stack.local import LocalStack, StackError
from tests.e2e.harness import metric_samples, metric_sum, running_stack, stack_options, wait_for

pytestmark = pytest.mark.e2e

CHAT = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _routed(stack: LocalStack, i: int) -> float:
    """Routing decisions process `i` made."""
    o = stack.options
    samples = metric_samples(f"http://{o.host}:{o.metrics_port + i}/metrics")
    return metric_sum(samples, "extproc_routing_decision_seconds_count")


def _hosts(stack: LocalStack) -> dict[str, set[int]]:
    """Envoy's own view: each server cluster's hosts it would send to (their ports). A host
    EDS adds waits for its first health check, as on a cluster."""
    o = stack.options
    status = httpx.get(f"http://{o.host}:{o.admin_port}/clusters?format=json", timeout=5).json()
    return {
        c["name"]: {
            h["address"]["socket_address"]["port_value"]
            for h in c.get("host_statuses", [])
            if set(h["health_status"]) == {"eds_health_status"}  # no failed_/pending_ flag
        }
        for c in status["cluster_statuses"]
        if c["name"] in stack.server_clusters
    }


def _send(stack: LocalStack, n: int) -> None:
    with httpx.Client(timeout=30) as client:
        for _ in range(n):
            assert (
                client.post(f"{stack.base_url}/v1/chat/completions", json=CHAT).status_code == 200
            )


def test_a_withdrawn_process_gets_no_new_stream_and_a_readmitted_one_gets_them_again(
    tmp_path: Path,
) -> None:
    opts = stack_options(
        tmp_path, sims=2, extproc_processes=2, gateway_shape=GatewayShape.ENVOY_GATEWAY
    )
    with running_stack(opts) as stack:
        ports = {opts.grpc_port, opts.grpc_port + 1}
        clusters = stack.server_clusters
        assert len(clusters) == 2  # the ext_proc cluster and the access-log sink's
        for name in clusters:
            listed = json.loads(eds_path(stack.workdir / "eds", name).read_text())
            (assignment,) = listed["resources"]
            assert assignment["cluster_name"] == name

        # Both, once a health check of each has passed. A host EDS lists waits for its first;
        # one that fails it (a process still starting, under a loaded CI) is checked again
        # only after Envoy's no-traffic interval (60 s) while its cluster carries no traffic,
        # so traffic is sent meanwhile (the 3 s interval then applies), as a cluster's would.
        # (Read at once, and then after 10 s idle, one was not yet in: fresh-clone CI,
        # 2026-12-07.)
        def both() -> bool:
            _send(stack, 1)
            return _hosts(stack) == {c: ports for c in clusters}

        assert wait_for(both, timeout=30, interval=0.5)

        stack.withdraw("extproc-0")
        assert wait_for(lambda: _hosts(stack) == {c: {opts.grpc_port + 1} for c in clusters})
        before = [_routed(stack, 0), _routed(stack, 1)]
        _send(stack, 20)
        assert wait_for(lambda: _routed(stack, 1) == before[1] + 20)
        assert _routed(stack, 0) == before[0]  # it runs on, and gets nothing new
        assert stack.alive("extproc-0")

        stack.readmit("extproc-0")
        assert wait_for(lambda: _hosts(stack) == {c: ports for c in clusters})
        # Envoy's least-request balancer takes a few seconds to pick a host EDS added back
        # (healthy in its admin view at once, yet chosen only seconds later here).
        before = [_routed(stack, 0), _routed(stack, 1)]

        def readmitted() -> bool:
            _send(stack, 4)
            return _routed(stack, 0) > before[0]

        assert wait_for(readmitted, timeout=30, interval=0.2)

        with pytest.raises(StackError, match="not a server process"):
            stack.withdraw("sim-0")


def test_the_local_shape_has_no_eds_to_leave(tmp_path: Path) -> None:
    with running_stack(stack_options(tmp_path, sims=1, extproc_processes=1)) as stack:
        with pytest.raises(StackError, match="only the Envoy Gateway shape"):
            stack.withdraw("extproc-0")
        assert not (stack.workdir / "eds").exists()
