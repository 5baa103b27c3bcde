"""256 endpoints end to end: real Envoy, the real server, 256 simulators (one process, see
tests/e2e/many_sims.py) each scraped and publishing KV events.

Behaviour only (no timings: bench/many_endpoints.py measures the server's CPU, scrapes/s and
KV events/s under this setup): every endpoint is known, ready and has a KV-event subscriber,
load-based routing spreads requests over the pool, a conversation's next turn goes to the pod
whose KV events say it holds the conversation's prefix, and nothing fails.
"""

from __future__ import annotations

import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import metric_samples, metric_sum, stack_options, wait_for
from tests.e2e.many_sims import ManySimStack, SimFleet, port_is_free

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PODS = 256
WORDS = ["router", "cache", "token", "engine", "prefix", "block", "queue", "batch", "decode"]


def fleet_port_block(size: int) -> int:
    """A free block between the other e2e tests' ports (12000-30000, `port_block`) and the
    kernel's ephemeral range (32768 up): hundreds of ports drawn among theirs would collide
    with a concurrently running test's."""
    for _ in range(100):
        base = random.randrange(30000, 32768 - size)
        if all(port_is_free(base + i) for i in range(size)):
            return base
    raise RuntimeError("no free port block for the simulator fleet")


def many_sim_stack(
    workdir: Path, pods: int = PODS, strategy: str = "least-request"
) -> ManySimStack:
    """Simulators on base..base+pods-1, their KV events on the next 2*pods ports, then the
    stack's own ports."""
    base = fleet_port_block(3 * pods + 40)
    stack = base + 3 * pods
    opts = stack_options(
        workdir,
        sims=0,
        strategy=strategy,
        listen_port=stack,
        admin_port=stack + 1,
        grpc_port=stack + 2,
        metrics_port=stack + 6,
        nats_port=stack + 10,
        log_level="warning",
    )
    fleet = SimFleet(pods, base_port=base, kv_base_port=base + pods)
    return ManySimStack(opts, fleet, sim_args=("--time-scale", "0.05"))


def _chat(base: str, messages: list[dict[str, str]], **headers: str) -> httpx.Response:
    return httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": "qwen3", "messages": messages, "max_tokens": 8},
        headers=headers,
        timeout=60,
    )


def test_server_routes_over_256_endpoints(tmp_path: Path) -> None:
    with many_sim_stack(tmp_path) as stack:
        o, fleet = stack.options, stack.fleet
        admin = f"http://{o.host}:{o.metrics_port}"
        addresses = {fleet.address(i) for i in range(PODS)}

        def endpoints() -> list[dict[str, object]]:
            rows: list[dict[str, object]] = httpx.get(
                f"{admin}/debug/endpoints", headers=o.admin_headers(), timeout=10
            ).json()
            return rows

        # Every endpoint known, scraped and ready, each with a KV-event subscriber.
        assert wait_for(lambda: sum(bool(e["ready"]) for e in endpoints()) == PODS, timeout=60)
        assert {str(e["address"]) for e in endpoints()} == addresses
        kv = httpx.get(f"{admin}/debug/kv", headers=o.admin_headers(), timeout=10).json()
        assert addresses <= set(kv)

        # Load-based routing spreads over the pool (in-flight ties broken at random).
        rng = random.Random(5)
        bodies = [
            [{"role": "user", "content": " ".join(rng.choices(WORDS, k=60))}] for _ in range(PODS)
        ]
        with ThreadPoolExecutor(max_workers=16) as pool:
            answers = list(pool.map(lambda m: _chat(stack.base_url, m), bodies))
        assert [r.status_code for r in answers] == [200] * len(answers)
        served = Counter(r.headers["x-inference-pod"] for r in answers)
        assert set(served) <= addresses
        assert len(served) >= PODS // 2, len(served)  # 256 random picks hit ~160 of 256
        assert max(served.values()) <= 12, served.most_common(3)

        # A conversation's next turn goes where its prefix is cached (KV events, exact index).
        for turn in range(3):
            talk = [{"role": "user", "content": " ".join(rng.choices(WORDS, k=300))}]
            first = _chat(stack.base_url, talk, **{"routing-strategy": "kv-aware"})
            assert first.status_code == 200
            holder = first.headers["x-inference-pod"]
            talk += [
                {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"and then {turn}?"},
            ]

            def stored(address: str = holder) -> bool:
                row = httpx.get(f"{admin}/debug/kv", headers=o.admin_headers(), timeout=10).json()[
                    address
                ]
                return int(row["stored_blocks"]) > 0

            assert wait_for(stored, timeout=10)
            second = _chat(stack.base_url, talk, **{"routing-strategy": "kv-aware"})
            assert second.status_code == 200
            assert second.headers["x-inference-pod"] == holder

        samples = metric_samples(f"{admin}/metrics")
        assert metric_sum(samples, "extproc_kv_events_decode_errors_total") == 0
        assert metric_sum(samples, "extproc_kv_events_total", kind="stored_blocks") > 0
        assert metric_sum(samples, "extproc_metrics_scrapes_total") >= PODS
