"""predicted-latency through a real Director (config, tokenizer, store, steps): an explain is a
dry run that leaves the next decision as it was, the probe is spent by a real request only,
and a sheddable request no pod can serve in time is a 429 counted as shed (reason "slo")."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from extproc.accounting.latency_model import LatencyModels
from extproc.director.api import ImmediateReply, RequestHead, RouteResult
from extproc.director.director import Director
from extproc.metrics.store import EndpointStore
from extproc.routing.predicted import SLO_TTFT_HEADER, LatencyFeatures
from extproc.types import EngineMetrics
from tests._clock import ManualClock
from tests._director import DirectorKit, build_director
from tests._metrics import sample

FAST, SLOW, OTHER = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
CONFIG = f"""
server:
  allow_explain: true
metrics:
  stale_after_s: 3600
flow_control:
  enabled: false  # the rule's SLO filter and the shedding step are what these tests read
routing:
  default_strategy: predicted-latency
  seed: 7
  strategy_params:
    predicted-latency: {{temperature: 1.0, probe_after_s: 30.0}}
models:
  - name: qwen3
    endpoints:
      - address: {FAST}
      - address: {SLOW}
      - address: {OTHER}
"""
BODY = orjson.dumps(
    {"model": "qwen3", "messages": [{"role": "user", "content": "hello there"}], "stream": True}
)


@dataclass
class Kit:
    kit: DirectorKit
    clock: ManualClock

    @property
    def director(self) -> Director:
        return self.kit.director

    @property
    def registry(self) -> CollectorRegistry:
        return self.kit.registry

    @property
    def store(self) -> EndpointStore:
        return self.kit.store


def learn(models: LatencyModels, clock: ManualClock) -> None:
    """SLOW learned last 50 s ago (due a probe); FAST and OTHER learn now, FAST 3x faster."""
    rng = random.Random(3)
    for address, speed, after in ((SLOW, 1.0, 0.0), (OTHER, 1.0, 50.0), (FAST, 3.0, 0.0)):
        clock.advance(after)
        for _ in range(60):  # past the rule's min_samples (50)
            f = LatencyFeatures(rng.randrange(0, 3000), rng.randrange(0, 10), 0, 0.0, 1.0, 0.2)
            ttft = (0.03 + 0.04 * f.uncached_tokens / 1000 + 0.015 * f.in_flight) / speed
            models.observe("qwen3", address, f, ttft_s=ttft, tpot_s=0.01 / speed)


@pytest.fixture
def kits(qwen_tokenizer_dir: Path) -> Iterator[list[Kit]]:
    """Two identical directors (same config, seed, models and clock time)."""
    made = []
    for _ in range(2):
        clock = ManualClock()
        kit = build_director(CONFIG, qwen_tokenizer_dir, clock=clock.now, wall_clock=clock.wall)
        learn(kit.core.latency, clock)
        for ep in kit.store.endpoints("qwen3"):  # headroom: a sheddable request is not shed as such
            kit.store.record_success(ep, EngineMetrics(clock.now(), running=1.0, waiting=0.0,
                                                       kv_cache_usage=0.2))  # fmt: skip
        made.append(Kit(kit, clock))
    yield made
    for k in made:
        k.kit.close()


def head(i: int, headers: dict[str, str] | None = None) -> RequestHead:
    return RequestHead(
        request_id=f"r{i}",
        method="POST",
        path="/v1/chat/completions",
        headers={":path": "/v1/chat/completions", **(headers or {})},
    )


def decided(explained: dict[str, Any]) -> dict[str, Any]:
    """What an explain decided (without the times it took)."""
    return {k: explained[k] for k in ("pick", "fallbacks", "reason", "candidates")}


async def routed(kit: Kit, i: int) -> tuple[str, ...]:
    result = await kit.director.route(head(i), BODY)
    assert isinstance(result, RouteResult)
    assert result.ticket is not None
    result.ticket.close()  # the request ended: no lease left to shift the next decision
    return result.destinations


async def test_an_explain_leaves_the_next_decision_as_it_was(kits: list[Kit]) -> None:
    explained, untouched = kits
    shown = [decided(await explained.director.explain(head(0), BODY)) for _ in range(3)]
    assert all(s == shown[0] for s in shown)  # a dry run, not a consumed probe or draw
    assert shown[0]["reason"].startswith(f"probe: the model of {SLOW}")
    first = await routed(explained, 1)
    assert first == await routed(untouched, 1)
    assert first[0] == SLOW == shown[0]["pick"]  # explain showed the decision that came
    # The real request spent the probe: the next decisions go by prediction, on both alike.
    for i in range(2, 8):
        nxt = await routed(explained, i)
        assert nxt == await routed(untouched, i)
        assert nxt[0] != SLOW


async def test_a_sheddable_request_no_pod_can_serve_in_time_is_counted_as_shed(
    kits: list[Kit],
) -> None:
    kit = kits[0]
    tight = {SLO_TTFT_HEADER: "1", "x-request-priority": "-1"}
    reply = await kit.director.route(head(0, tight), BODY)
    assert isinstance(reply, ImmediateReply) and reply.status == 429
    error = orjson.loads(reply.body)["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "slo_unmet")
    assert sample(kit.registry, "extproc_shed_requests_total", model="qwen3", reason="slo") == 1
    assert sample(kit.registry, "extproc_requests_total", status="429") == 1
    # Not sheddable: the best pod anyway, nothing shed. An explain counts nothing either.
    ok = await kit.director.route(head(1, {SLO_TTFT_HEADER: "1"}), BODY)
    assert isinstance(ok, RouteResult) and ok.ticket is not None
    ok.ticket.close()
    with pytest.raises(Exception, match="no endpoint is predicted to meet"):
        await kit.director.explain(head(2, tight), BODY)
    assert sample(kit.registry, "extproc_shed_requests_total") == 1


async def test_a_sheddable_request_on_a_saturated_pool_is_counted_once_and_never_by_explain(
    kits: list[Kit],
) -> None:
    kit = kits[0]
    for ep in kit.store.endpoints("qwen3"):
        kit.store.record_success(
            ep, EngineMetrics(kit.clock.now(), running=1.0, waiting=50.0, kv_cache_usage=0.99)
        )
    sheddable = {"x-request-priority": "-1"}
    with pytest.raises(Exception, match="saturated"):
        await kit.director.explain(head(0, sheddable), BODY)
    assert sample(kit.registry, "extproc_shed_requests_total") == 0
    reply = await kit.director.route(head(1, sheddable), BODY)
    assert isinstance(reply, ImmediateReply) and reply.status == 429
    assert orjson.loads(reply.body)["error"]["code"] == "overloaded"
    assert (
        sample(kit.registry, "extproc_shed_requests_total", model="qwen3", reason="saturated") == 1
    )
