"""Routing features end to end: P/D disaggregation, shedding under saturation, per-route settings."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from extproc.stack.envoy_config import ROUTE_NAME
from tests.e2e.harness import (
    every_process_sees_every_pod_ready,
    metric_samples,
    metric_sum,
    running_stack,
    stack_options,
    wait_for,
)

pytestmark = pytest.mark.e2e

CHAT = {
    "model": "qwen3",
    "messages": [{"role": "user", "content": "Explain KV caches briefly."}],
    "max_tokens": 6,
}


def pd_counts(address: str) -> dict[str, float]:
    samples = metric_samples(f"http://{address}/metrics")
    return {
        kind: metric_sum(samples, "vllm_sim:pd_requests_total", kind=kind)
        for kind in ("prefill_only", "remote_prefill")
    }


def test_pd_runs_prefill_on_a_prefill_pod_and_decodes_on_a_decode_pod(tmp_path: Path) -> None:
    opts = stack_options(tmp_path, sims=3, sim_roles=("prefill", "decode", "decode"), strategy="pd")
    with running_stack(opts) as stack:
        # Ready means one fresh pod; a fresh clone's CI once sent both requests before the
        # prefill pod's first scrape, and both were decoded directly.
        assert wait_for(lambda: every_process_sees_every_pod_ready(stack))
        for stream in (False, True):
            r = httpx.post(
                f"{stack.base_url}/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=30
            )
            assert r.status_code == 200
        prefill = pd_counts(opts.sim_address(0))
        decode = [pd_counts(opts.sim_address(i)) for i in (1, 2)]
        assert prefill["prefill_only"] == 2  # the gateway ran both prefills itself
        assert sum(d["remote_prefill"] for d in decode) == 2  # decode pods got the KV handle
        assert prefill["remote_prefill"] == 0
        # Without a ready prefill pod, requests are decoded directly and a metric says so.
        stack.kill("sim-0")
        r = httpx.post(f"{stack.base_url}/v1/chat/completions", json=CHAT, timeout=30)
        for _ in range(30):
            if r.status_code == 200:
                break
            r = httpx.post(f"{stack.base_url}/v1/chat/completions", json=CHAT, timeout=30)
        assert r.status_code == 200
        fallbacks = metric_samples(f"http://127.0.0.1:{opts.metrics_port}/metrics")
        assert metric_sum(fallbacks, "extproc_pd_fallbacks_total") >= 1


def test_sheddable_requests_get_429_when_every_pod_is_saturated(tmp_path: Path) -> None:
    # Thresholds of zero make every pod count as saturated.
    opts = stack_options(
        tmp_path,
        sims=2,
        server_config={"saturation": {"queue_threshold": 0.0, "kv_threshold": 0.0}},
    )
    with running_stack(opts) as stack:
        url = f"{stack.base_url}/v1/chat/completions"
        shed = httpx.post(url, json=CHAT, headers={"x-request-priority": "-1"}, timeout=30)
        assert shed.status_code == 429
        assert shed.json()["error"]["type"] == "rate_limit_error"
        kept = httpx.post(url, json=CHAT, headers={"x-request-priority": "0"}, timeout=30)
        assert kept.status_code == 200  # critical requests go to the least bad pod
        bad = httpx.post(url, json=CHAT, headers={"x-request-priority": "high"}, timeout=30)
        assert bad.status_code == 400


def test_route_settings_apply_by_xds_route_name(tmp_path: Path) -> None:
    opts = stack_options(
        tmp_path,
        sims=2,
        server_config={
            "routes": {
                ROUTE_NAME: {"model_map": {"gpt-4o-mini": "qwen3"}, "strategy": "round-robin"}
            }
        },
    )
    with running_stack(opts) as stack:
        r = httpx.post(
            f"{stack.base_url}/v1/chat/completions",
            json={**CHAT, "model": "gpt-4o-mini"},
            headers={"x-routing-explain": "true"},
            timeout=30,
        )
        assert r.status_code == 200
        assert r.json()["model"] == "qwen3"  # the body was rewritten for the engine
        assert "strategy=round-robin" in r.headers["x-routing-explain"]
