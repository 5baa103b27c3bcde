"""The director runs its steps in order around the decision, and claims only at the end."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson

from extproc.director.api import RequestHead, RouteResult
from extproc.director.lifecycle import Outgoing, Placement, Request
from extproc.routing.base import Decision
from tests._director import Blocks, build_director, config_text

BODY = orjson.dumps(
    {
        "model": "qwen3",
        "messages": [{"role": "user", "content": "a prompt long enough for a few blocks " * 8}],
        "stream": True,
        "max_tokens": 8,
    }
)


def head(i: int) -> RequestHead:
    return RequestHead(
        request_id=f"r{i}", method="POST", path="/v1/chat/completions", headers={"x-user-id": "u"}
    )


class Seen:
    """An extra pre-request step: what the built-in steps had done when it ran."""

    def __init__(self) -> None:
        self.outs: list[Outgoing] = []
        self.cached_then: list[int] = []

    async def pre_request(
        self, req: Request, place: Placement, decision: Decision, out: Outgoing
    ) -> None:
        self.outs.append(Outgoing(**{k: getattr(out, k) for k in out.__slots__}))
        self.cached_then.append(req.runtime.prefix.cached_blocks(decision.endpoint.address))


async def test_extra_steps_run_after_the_built_in_ones_and_before_the_claim(
    qwen_tokenizer_dir: Path,
) -> None:
    seen = Seen()
    leases: list[int] = []

    class Leases:
        async def pre_request(
            self, req: Request, place: Placement, decision: Decision, out: Outgoing
        ) -> None:
            leases.append(kit.director.lease_count())

    kit = build_director(config_text(), qwen_tokenizer_dir)
    kit.add_pre_request(seen, Leases())
    try:
        res = await kit.director.route(head(1), BODY)
        assert isinstance(res, RouteResult)
        (out,) = seen.outs
        assert out.include_usage and out.routed is not None  # body rewrite and tag ran before
        assert out.routed.endpoint == res.destinations[0]
        assert seen.cached_then[0] > 0  # the pick was recorded in the index before
        assert leases == [0]  # nothing claimed yet while pre-request steps run
        assert kit.director.lease_count() == 1  # claimed once they all ran
        assert res.body is not None and orjson.loads(res.body)["stream_options"] == {
            "include_usage": True
        }
    finally:
        kit.close()


async def test_a_request_cancelled_in_a_pre_request_step_claims_nothing(
    qwen_tokenizer_dir: Path,
) -> None:
    blocks = Blocks()
    kit = build_director(config_text(), qwen_tokenizer_dir)
    kit.add_pre_request(blocks)
    try:
        task = asyncio.create_task(kit.director.route(head(1), BODY))
        await asyncio.wait_for(blocks.entered.wait(), 10)
        assert kit.director.deciding == 1
        task.cancel()  # Envoy reset the stream while the step waited
        done, _ = await asyncio.wait({task}, timeout=10)
        assert task in done and task.cancelled()
        assert kit.director.lease_count() == 0
        assert kit.director.deciding == 0
        assert not kit.core.fairness.is_active("u")
        # The next request is routed and claims as usual.
        blocks.release.set()
        res = await kit.director.route(head(2), BODY)
        assert isinstance(res, RouteResult) and kit.director.lease_count() == 1
    finally:
        kit.close()
