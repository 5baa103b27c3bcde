"""One gateway for a fleet, end to end: 20 pools of 2 simulated engines each behind real
Envoy and one server. Every request is served by a pod of its own pool; a 21st pool is added
and then removed while traffic runs over the others, and no request fails.

Behaviour only; bench/fleet.py measures the costs (docs/benchmarks.md, the fleet section).
Pools found in the cluster (InferencePools) are tested against the fake API server in
tests/k8s/test_app_pools.py; here they are listed in the config, the reload path.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from typing import Any

import httpx
import pytest
import yaml

from extproc.stack.envoy_config import HostPort
from tests.e2e.fleet_stack import FleetShape, FleetStack
from tests.e2e.harness import stack_options, wait_for
from tests.e2e.many_sims import port_is_free

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

POOLS, PODS = 20, 2
WORDS = ["pool", "fleet", "gateway", "engine", "token", "route", "cache", "queue"]


def port_base(size: int) -> int:
    for _ in range(200):
        base = random.randrange(30000, 32768 - size)
        if all(port_is_free(base + i) for i in range(size)):
            return base
    raise RuntimeError("no free port block for the fleet")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FleetStack, FleetShape]]:
    base = port_base((POOLS + 1) * PODS + 40)
    shape = FleetShape(pools=POOLS, pods=PODS, base_port=base, sim_processes=2)
    extra = replace(shape, pools=1, base_port=base + POOLS * PODS, first_pool=POOLS)
    stack_at = base + (POOLS + 1) * PODS
    opts = stack_options(
        tmp_path_factory.mktemp("fleet"),
        sims=0,
        listen_port=stack_at,
        admin_port=stack_at + 1,
        grpc_port=stack_at + 2,
        metrics_port=stack_at + 6,
        nats_port=stack_at + 10,
        strategy="least-request",
        log_level="info",
    )
    envoy_extra = tuple(HostPort(extra.host, extra.base_port + i) for i in range(PODS))
    stack = FleetStack(opts, shape, sim_args=("--time-scale", "0.05"), envoy_endpoints=envoy_extra)
    with stack:
        yield stack, extra


def chat(client: httpx.Client, base: str, model: str) -> httpx.Response:
    words = " ".join(random.choices(WORDS, k=40))
    return client.post(
        f"{base}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": words}], "max_tokens": 4},
    )


def ready_by_pool(stack: FleetStack) -> Counter[str]:
    o = stack.options
    rows: list[dict[str, Any]] = httpx.get(
        f"http://{o.host}:{o.metrics_port}/debug/endpoints", headers=o.admin_headers(), timeout=10
    ).json()
    return Counter(r["model"] for r in rows if r["ready"])


def pool_ready(stack: FleetStack, pool: str) -> bool:
    return ready_by_pool(stack)[pool] == PODS


def endpoints_of(stack: FleetStack, model: str) -> list[dict[str, Any]]:
    """What the server says of a pool's pods (a failed request's diagnosis)."""
    o = stack.options
    rows: list[dict[str, Any]] = httpx.get(
        f"http://{o.host}:{o.metrics_port}/debug/endpoints", headers=o.admin_headers(), timeout=10
    ).json()
    return [r for r in rows if r["model"] == model]


def write_config(stack: FleetStack, models: list[dict[str, Any]]) -> None:
    """Rewrite the server's config with these models (it reloads on the file's change)."""
    path = stack.config_path
    cfg = yaml.safe_load(path.read_text())
    cfg["models"] = models
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(cfg, sort_keys=False))
    os.replace(tmp, path)
    st = path.stat()
    os.utime(path, (st.st_atime, st.st_mtime + 2))  # mtime granularity must not hide it


def test_twenty_pools_each_request_served_by_its_own_pool(
    fleet: tuple[FleetStack, FleetShape],
) -> None:
    stack, _ = fleet
    shape = stack.shape
    assert wait_for(lambda: sum(ready_by_pool(stack).values()) == POOLS * PODS, timeout=60)
    pool_of = shape.pool_of()
    with httpx.Client(timeout=60) as client:
        for j in range(POOLS):
            pool = shape.pool_name(j)
            # Every pool was ready above; on a machine this loaded (two workers, 40 engines in
            # two processes) a starved engine process may miss scrapes for stale_after_s: its
            # pods leave the candidate set, and come back at its next scrape.
            assert wait_for(partial(pool_ready, stack, pool), timeout=30), pool
            for _ in range(3):
                r = chat(client, stack.base_url, pool)
                assert r.status_code == 200, (r.text, endpoints_of(stack, pool))
                assert pool_of[r.headers["x-inference-pod"]] == shape.pool_name(j)


def test_a_pool_added_and_removed_under_load_fails_no_request(
    fleet: tuple[FleetStack, FleetShape],
) -> None:
    stack, extra = fleet
    shape = stack.shape
    assert wait_for(lambda: sum(ready_by_pool(stack).values()) == POOLS * PODS, timeout=60)
    pool_of = {**shape.pool_of(), **extra.pool_of()}
    stop = threading.Event()
    served: Counter[str] = Counter()
    failures: list[str] = []
    wrong_pool: list[str] = []
    extra_on = threading.Event()

    def client_loop(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                pools = [shape.pool_name(j) for j in range(POOLS)]
                if extra_on.is_set():
                    pools.append(extra.pool_name(0))
                model = rng.choice(pools)
                try:
                    r = chat(client, stack.base_url, model)
                except httpx.HTTPError as exc:
                    failures.append(f"{model}: {exc!r}")
                    continue
                if r.status_code != 200:
                    failures.append(f"{model}: {r.status_code} {r.text[:200]}")
                    continue
                served[model] += 1
                if pool_of.get(r.headers.get("x-inference-pod", "")) != model:
                    wrong_pool.append(f"{model} -> {r.headers.get('x-inference-pod')}")

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(2.0)
        base_models = yaml.safe_load(stack.config_path.read_text())["models"]
        stack.add_sims("sims-extra", extra)
        write_config(stack, [*base_models, extra.model_config(0)])
        assert wait_for(lambda: ready_by_pool(stack)[extra.pool_name(0)] == PODS, timeout=30)
        extra_on.set()
        time.sleep(3.0)
        extra_on.clear()
        time.sleep(1.0)  # requests already sent to it finish (an operator drains first)
        write_config(stack, base_models)
        assert wait_for(lambda: extra.pool_name(0) not in ready_by_pool(stack), timeout=30)
        time.sleep(2.0)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert failures == []
    assert wrong_pool == []
    assert served[extra.pool_name(0)] > 0  # the added pool served while it was there
    assert sum(served.values()) > 50
