"""KV events end to end: the router's exact index equals each simulator's cache, block for block."""

from __future__ import annotations

import random
import time
from pathlib import Path

import httpx
import pytest

from extproc.stack.local import StackOptions
from tests.e2e.harness import metric_samples, metric_sum, running_stack, stack_options, wait_for

pytestmark = pytest.mark.e2e

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
]


def sim_blocks(address: str) -> set[int]:
    return {b["block_hash"] for b in httpx.get(f"http://{address}/debug/cache", timeout=10).json()}


def router_blocks(opts: StackOptions, address: str) -> set[int]:
    data = httpx.get(
        f"http://127.0.0.1:{opts.metrics_port}/debug/kv",
        params={"pod": address},
        headers=opts.admin_headers(),
        timeout=10,
    ).json()
    return set(data["_blocks"]["qwen3"])


@pytest.mark.parametrize("encoding", ["map", "legacy"])
def test_router_index_matches_simulator_caches_after_random_multi_turn_workload(
    tmp_path: Path, encoding: str
) -> None:
    # A small cache (64 blocks) so the workload also evicts: removals must be mirrored too.
    opts = stack_options(
        tmp_path,
        sims=2,
        strategy="prefix-cache",
        sim_args=("--time-scale", "0.05", "--cache-blocks", "64", "--kv-events-encoding", encoding),
        # The exact index alone: with the pending overlay a pod just routed to matches by
        # decision (not exact) for 2 s, and the last assertion reads the events' view.
        server_config={"kv_events": {"pending_s": 0}},
    )
    rng = random.Random(11 if encoding == "map" else 12)
    with running_stack(opts) as stack:
        base = stack.base_url
        addrs = [opts.sim_address(i) for i in range(opts.sims)]
        assert wait_for(
            lambda: all(
                httpx.get(
                    f"http://127.0.0.1:{opts.metrics_port}/debug/kv",
                    headers=opts.admin_headers(),
                    timeout=5,
                )
                .json()
                .get(a, {})
                .get("healthy")
                is not None
                for a in addrs
            ),
            timeout=10,
        )
        sessions: list[list[dict[str, str]]] = [[] for _ in range(5)]
        for _ in range(30):
            msgs = rng.choice(sessions)
            msgs.append(
                {"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(20, 80)))}
            )
            r = httpx.post(
                f"{base}/v1/chat/completions",
                json={"model": "qwen3", "messages": msgs, "max_tokens": 8},
                timeout=30,
            )
            assert r.status_code == 200
            msgs.append(
                {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}
            )
        for address in addrs:
            assert wait_for(
                lambda a=address: router_blocks(opts, a) == sim_blocks(a), timeout=10
            ), (
                address,
                len(router_blocks(opts, address)),
                len(sim_blocks(address)),
            )
        # The workload overflowed a 64-block cache: the comparison covered evictions.
        kv = httpx.get(
            f"http://127.0.0.1:{opts.metrics_port}/debug/kv",
            headers=opts.admin_headers(),
            timeout=5,
        ).json()
        assert sum(kv[a]["removed_blocks"] for a in addrs) > 0
        assert all(kv[a]["healthy"] and kv[a]["decode_errors"] == 0 for a in addrs)
        # Later turns of a session see their earlier turns cached, exactly.
        msgs = sessions[0] + [{"role": "user", "content": "one more question"}]
        explained = httpx.post(
            f"http://127.0.0.1:{opts.metrics_port}/debug/explain",
            json={"model": "qwen3", "messages": msgs},
            headers={"routing-strategy": "kv-aware", **opts.admin_headers()},
            timeout=10,
        ).json()
        best = max(explained["candidates"], key=lambda c: c["prefix_match_tokens"])
        assert best["prefix_exact"] is True


def test_short_prompts_keep_an_idle_event_stream_healthy(tmp_path: Path) -> None:
    """Prompts shorter than one block make the engines publish nothing: the streams stay
    healthy, and explain keeps exact prefixes (issue 27: every pod went down after 10 s)."""
    opts = stack_options(
        tmp_path,
        sims=2,
        strategy="kv-aware",
        server_config={"kv_events": {"stall_after_s": 1.0}},
    )
    with running_stack(opts) as stack:
        addrs = [opts.sim_address(i) for i in range(opts.sims)]
        port = opts.metrics_port

        def healthy() -> list[bool]:
            kv = httpx.get(
                f"http://127.0.0.1:{port}/debug/kv", headers=opts.admin_headers(), timeout=5
            ).json()
            return [bool(kv.get(a, {}).get("healthy")) for a in addrs]

        # Silent engines that have published nothing: one probe of each replay socket.
        assert wait_for(lambda: all(healthy()), timeout=10), healthy()
        short = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        deadline = time.monotonic() + 3.0  # three times stall_after_s
        while time.monotonic() < deadline:
            r = httpx.post(f"{stack.base_url}/v1/chat/completions", json=short, timeout=30)
            assert r.status_code == 200
            assert all(healthy()), healthy()
        samples = metric_samples(f"http://127.0.0.1:{port}/metrics")
        assert metric_sum(samples, "extproc_kv_events_healthy") == len(addrs)
        explained = httpx.post(
            f"http://127.0.0.1:{port}/debug/explain",
            json=short,
            headers=opts.admin_headers(),
            timeout=10,
        ).json()
        assert all(c["prefix_exact"] for c in explained["candidates"])
