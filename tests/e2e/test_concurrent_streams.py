"""2,000 concurrent streams through one Envoy, on the Envoy Gateway shape.

Envoy's default circuit breakers (1,024 requests per cluster, which Envoy Gateway leaves in
place unless a policy sets `circuitBreaker`) run at most 1,024 at once: the next 1,024 wait in
Envoy's pending queue (measured without the BackendTrafficPolicy's `circuitBreaker`: the peak
is exactly 1,024 and this test fails), later ones get 503. The simulators here are slow per step but give 5-token answers, so each stream is
cheap and holds its upstream request for 20 s or more: the requests pile up on the model
cluster beyond that limit even when the single ext_proc process, sharing two cores with
another stack, lets them in at 60 a second rather than the 250 a second they start at (a CI
run with 2-token answers, held 8-12 s, peaked at 926).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import aiohttp
import httpx
import pytest

from extproc.stack.envoy_config import MODELS_CLUSTER
from extproc.stack.envoy_gateway import GatewayShape
from extproc.stack.local import LocalStack
from tests.e2e.harness import running_stack, stack_options

pytestmark = pytest.mark.e2e

STREAMS = 2000
RATE = 250.0  # stream starts per second: ~8 s to start them all
ENVOY_DEFAULT_CIRCUIT_BREAKER = 1024
# Each engine step takes 4 s whatever its size (a 5-token answer is 5-6 steps, 20-24 s) and
# every request fits in one batch: answers stay cheap, streams stay open.
SLOW_SIM = (
    *("--time-scale", "1", "--step-overhead-ms", "4000"),
    *("--max-num-seqs", "2048", "--max-batched-tokens", "262144"),
)


# The Envoy Gateway shape only: its limits come from the overlay's BackendTrafficPolicy as
# Envoy Gateway translates it; the local shape's are our own bootstrap's, checked where it is
# generated (tests/envoy/test_envoy_config.py), and a second 2,000-stream run took a minute of
# CI for them.
@pytest.fixture(scope="module", params=[GatewayShape.ENVOY_GATEWAY], ids=["envoy-gateway"])
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalStack]:
    opts = stack_options(
        tmp_path_factory.mktemp("streams"),
        gateway_shape=request.param,
        sims=3,
        sim_args=SLOW_SIM,
        kv_events=False,
        log_level="warning",
    )
    with running_stack(opts) as s:
        yield s


def model_cluster(stack: LocalStack) -> str:
    translation = stack.envoy_gateway_translation()
    return MODELS_CLUSTER if translation is None else translation.model_clusters[0]


def envoy_stat(stack: LocalStack, name: str) -> int:
    text = httpx.get(
        f"http://127.0.0.1:{stack.options.admin_port}/stats", params={"filter": name}
    ).text
    return sum(
        int(value)
        for key, _, value in (line.partition(": ") for line in text.splitlines())
        if key == name
    )


async def _peak(stack: LocalStack, stat: str, done: asyncio.Event) -> int:
    peak = 0
    url = f"http://127.0.0.1:{stack.options.admin_port}/stats"
    async with aiohttp.ClientSession() as session:
        while not done.is_set():
            async with session.get(url, params={"filter": stat}) as r:
                for line in (await r.text()).splitlines():
                    key, _, value = line.partition(": ")
                    if key == stat:
                        peak = max(peak, int(value))
            await asyncio.sleep(0.1)
    return peak


async def _streams(stack: LocalStack) -> tuple[Counter[object], int]:
    body = {
        "model": "qwen3",
        "messages": [{"role": "user", "content": "Say two words."}],
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
    }
    url = f"{stack.base_url}/v1/chat/completions"
    stat = f"cluster.{model_cluster(stack)}.upstream_rq_active"
    done = asyncio.Event()
    peak = asyncio.create_task(_peak(stack, stat, done))
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one() -> object:
            try:
                async with session.post(url, json=body) as r:
                    text = await r.text()
                    return r.status if text.rstrip().endswith("data: [DONE]") else (r.status, text)
            except aiohttp.ClientError as exc:
                return repr(exc)

        tasks = []
        for _ in range(STREAMS):
            tasks.append(asyncio.create_task(one()))
            await asyncio.sleep(1 / RATE)
        results = await asyncio.gather(*tasks)
    done.set()
    return Counter(results), await peak


def test_2000_concurrent_streams_all_complete(stack: LocalStack) -> None:
    cluster = model_cluster(stack)
    overflows = f"cluster.{cluster}.upstream_rq_pending_overflow"
    before = envoy_stat(stack, overflows)
    results, peak = asyncio.run(_streams(stack))
    assert results == Counter({200: STREAMS})
    # They were concurrent past Envoy's default limit, and no request overflowed a breaker.
    assert peak > ENVOY_DEFAULT_CIRCUIT_BREAKER, peak
    assert envoy_stat(stack, overflows) == before
