"""Flow control inside the real director: the request waits before its pod is chosen, and is
routed from the state at dispatch (late binding); what it rejects is an OpenAI-style reply."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from extproc.director.api import ImmediateReply, RequestHead, RouteResult
from extproc.flowcontrol import DROPPED_HEADER, FlowController
from extproc.types import EngineMetrics
from tests._director import POOL, DirectorKit, build_director, config_text

FLOW = """
flow_control:
  enabled: true
  objectives: {critical: 100, batch: -5}
routes:
  httproute/default/chat/rule/0/match/0/x:
    priority: 7
"""


class Kit:
    """The director with flow control on (the queue's settings as YAML keys), its queue never
    dispatching on its own (not started): a test dispatches it."""

    def __init__(self, qwen_tokenizer_dir: Path, **settings: object) -> None:
        keys = "".join(f"\n  {key}: {value}" for key, value in settings.items())
        text = config_text(strategy="least-request") + FLOW.replace(
            "enabled: true", "enabled: true" + keys
        )
        self.kit: DirectorKit = build_director(text, qwen_tokenizer_dir)
        self.flow: FlowController = self.kit.flow
        self.eps = {ep.address: ep for ep in self.kit.store.endpoints("qwen3")}

    def scrape(self, address: str, waiting: float) -> None:
        self.kit.store.record_success(
            self.eps[address],
            EngineMetrics(updated_at=time.monotonic(), waiting=waiting, kv_cache_usage=0.1),
        )


@pytest.fixture
def kit(qwen_tokenizer_dir: Path) -> Iterator[Kit]:
    k = Kit(qwen_tokenizer_dir)
    yield k
    k.kit.close()


def head(i: int, headers: dict[str, str] | None = None, route: str | None = None) -> RequestHead:
    return RequestHead(
        request_id=f"r{i}", method="POST", path="/v1/chat/completions",
        headers={"content-type": "application/json", **(headers or {})}, route_name=route,
    )  # fmt: skip


BODY = orjson.dumps({"model": "qwen3", "messages": [{"role": "user", "content": "hello there"}]})


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_queued_request_is_routed_from_the_state_at_dispatch(kit: Kit) -> None:
    async def main() -> None:
        for address in POOL:
            kit.scrape(address, waiting=5)  # every pod full: the request waits
        task = asyncio.create_task(kit.kit.director.route(head(1), BODY))
        await settle()
        assert not task.done() and kit.flow.queued == 1
        # At arrival least-request would pick POOL[0] (nothing in flight anywhere). While the
        # request waits, POOL[0] takes three requests and POOL[1] gains room.
        for _ in range(3):
            kit.kit.core.inflight.start(kit.eps[POOL[0]], 10)
        kit.scrape(POOL[1], waiting=0)
        assert kit.flow.dispatch() == 1
        result = await task
        assert isinstance(result, RouteResult)
        assert result.destinations[0] != POOL[0]
        assert kit.flow.queued == 0

    asyncio.run(main())


def test_below_saturation_a_request_is_routed_at_once(kit: Kit) -> None:
    async def main() -> None:
        for address in POOL:
            kit.scrape(address, waiting=0)
        result = await kit.kit.director.route(head(1), BODY)
        assert isinstance(result, RouteResult)
        assert kit.flow.queued == 0

    asyncio.run(main())


def test_a_rejection_is_an_openai_error_with_the_reason(qwen_tokenizer_dir: Path) -> None:
    async def main() -> None:
        k = Kit(qwen_tokenizer_dir, ttl_s=0.001, retry_after_s=3)
        try:
            for address in POOL:
                k.scrape(address, waiting=9)
            task = asyncio.create_task(k.kit.director.route(head(1), BODY))
            await settle()
            await asyncio.sleep(0.01)
            k.flow.dispatch()
            reply = await task
            assert isinstance(reply, ImmediateReply)
            assert reply.status == 429
            assert reply.headers[DROPPED_HEADER] == "rejected-ttl-expired"
            assert reply.headers["retry-after"] == "3"
            assert reply.headers["content-type"] == "application/json"
            error = orjson.loads(reply.body)["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "rejected-ttl-expired"
        finally:
            k.kit.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("headers", "route", "band"),
    [
        ({}, None, 0),
        ({"x-request-priority": "3"}, None, 3),
        ({"x-request-priority": "99999"}, None, 10),  # our header is clamped
        ({"x-llm-d-inference-objective": "critical"}, None, 100),
        ({"x-gateway-inference-objective": "critical"}, None, 100),
        ({"x-llm-d-inference-objective": "unknown"}, None, 0),
        ({}, "httproute/default/chat/rule/0/match/0/x", 7),
        ({"x-request-priority": "1"}, "httproute/default/chat/rule/0/match/0/x", 1),
    ],
)
def test_the_band_comes_from_the_headers_the_objective_or_the_route(
    kit: Kit, headers: dict[str, str], route: str | None, band: int
) -> None:
    async def main() -> None:
        for address in POOL:
            kit.scrape(address, waiting=5)
        task = asyncio.create_task(kit.kit.director.route(head(1, headers, route), BODY))
        await settle()
        assert kit.flow.depths() == {"qwen3": {band: (1, len(BODY))}}
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert kit.flow.queued == 0

    asyncio.run(main())


def test_a_sheddable_objective_is_shed_when_saturated(kit: Kit) -> None:
    async def main() -> None:
        for address in POOL:
            kit.scrape(address, waiting=5)
        reply = await kit.kit.director.route(
            head(1, {"x-llm-d-inference-objective": "batch"}), BODY
        )
        assert isinstance(reply, ImmediateReply) and reply.status == 429
        assert reply.headers[DROPPED_HEADER] == "rejected-saturated"

    asyncio.run(main())


def test_the_fairness_id_names_the_flow_and_the_vtc_user(kit: Kit) -> None:
    async def main() -> None:
        for address in POOL:
            kit.scrape(address, waiting=0)
        result = await kit.kit.director.route(
            head(1, {"x-llm-d-inference-fairness-id": "tenant-a"}), BODY
        )
        assert isinstance(result, RouteResult) and result.routed is not None
        assert result.routed.user == "tenant-a"

    asyncio.run(main())


def test_a_dispatched_request_goes_to_a_pod_with_room(kit: Kit) -> None:
    """Late binding into room: least-request alone would pick an idle pod whose queue is full;
    the grant names the pod with room and the request goes there."""

    async def main() -> None:
        kit.scrape(POOL[0], waiting=5)  # full queues, nothing of ours in flight
        kit.scrape(POOL[1], waiting=5)
        kit.scrape(POOL[2], waiting=4)  # the one with room, and the busiest by our count
        for _ in range(3):
            kit.kit.core.inflight.start(kit.eps[POOL[2]], 10)
        for i in range(3):
            result = await kit.kit.director.route(head(i), BODY)
            assert isinstance(result, RouteResult)
            assert result.destinations[0] == POOL[2]
            kit.scrape(POOL[2], waiting=4)  # still room for one (a fresh scrape)

    asyncio.run(main())


def test_token_fairness_rereads_a_tenant_the_counters_forget(qwen_tokenizer_dir: Path) -> None:
    """The VTC counters forget the idle user seen least recently past their bound (its count
    reads 0 from then on): flow control's index, told by the core's wiring, serves its waiting
    request first, as a scan of the counts would."""

    async def main() -> None:
        k = Kit(qwen_tokenizer_dir, fairness="token")
        try:
            counters = k.kit.core.fairness
            counters.charge("old", input_tokens=100)  # idle, and the least recently seen
            counters.charge("new", input_tokens=50)
            for address in POOL:
                k.scrape(address, waiting=5)
            tasks = [
                asyncio.create_task(
                    k.kit.director.route(head(i, {"x-llm-d-inference-fairness-id": t}), BODY)
                )
                for i, t in enumerate(["old", "new"])
            ]
            await settle()
            assert k.flow.queued == 2
            while counters.tokens("old"):  # new users, in flight: past the bound "old" goes
                counters.request_started(f"u{len(counters)}")
            assert counters.tokens("new") == 50
            k.scrape(POOL[2], waiting=4)  # room for one
            assert k.flow.dispatch() == 1
            await settle()
            assert tasks[0].done() and not tasks[1].done()
            k.scrape(POOL[2], waiting=4)
            assert k.flow.dispatch() == 1
            await asyncio.gather(*tasks)
        finally:
            k.kit.close()

    asyncio.run(main())
