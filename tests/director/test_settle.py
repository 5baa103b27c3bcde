"""When the routing stream ends, unfinished requests are settled (in-flight released) soon after,
unless their response is still arriving."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson

from extproc.director.api import RequestHead, RouteResult
from extproc.director.director import CLOSE_GRACE_S
from tests.reliability._director import build_director, config_text

BODY = orjson.dumps(
    {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
)


def head(i: int) -> RequestHead:
    return RequestHead(request_id=f"r{i}", method="POST", path="/v1/chat/completions", headers={})


async def test_unclaimed_request_is_settled_after_the_grace(qwen_tokenizer_dir: Path) -> None:
    kit = build_director(config_text(), qwen_tokenizer_dir)
    try:
        res = await kit.director.route(head(1), BODY)
        assert isinstance(res, RouteResult)
        assert kit.director.lease_count() == 1
        kit.director.request_closed("r1")  # the client left before any response byte
        assert kit.director.lease_count() == 1  # not at once: a response stream may be starting
        await asyncio.sleep(CLOSE_GRACE_S + 0.3)
        assert kit.director.lease_count() == 0
        assert kit.director.pending == 0
    finally:
        kit.close()


async def test_finished_response_is_untouched_and_active_one_waits(
    qwen_tokenizer_dir: Path,
) -> None:
    kit = build_director(config_text(), qwen_tokenizer_dir)
    try:
        done = await kit.director.route(head(1), BODY)
        live = await kit.director.route(head(2), BODY)
        assert isinstance(done, RouteResult) and isinstance(live, RouteResult)
        obs_done = kit.director.observer_for("r1")
        obs_live = kit.director.observer_for("r2")
        assert obs_done is not None and obs_live is not None
        obs_done.on_headers(200, {})
        obs_done.on_body(b'{"usage": {"prompt_tokens": 9, "completion_tokens": 4}}', True)
        meta = obs_done.finish(complete=True)
        assert meta["llm_total_token"] == 13.0
        kit.director.request_closed("r1")  # already finished: nothing to do
        kit.director.request_closed("r2")
        # r2's response keeps streaming: it is re-checked rather than cut.
        for _ in range(3):
            obs_live.on_body(b"data: {}\n\n", False)
            await asyncio.sleep(CLOSE_GRACE_S * 0.6)
        assert kit.director.lease_count() == 1
        await asyncio.sleep(CLOSE_GRACE_S * 2.2)  # bytes stopped: settled as incomplete
        assert kit.director.lease_count() == 0
        assert obs_live.usage is not None  # finished exactly once
    finally:
        kit.close()
