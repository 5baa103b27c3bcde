"""A pod that accepts requests and answers none leaves the candidates while others answer."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import orjson

from extproc.director.api import RequestHead, RouteResult
from tests.reliability._director import POOL, DirectorKit, build_director, config_text

BODY = orjson.dumps(
    {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
)
STALL_S = 0.2


def head(i: int) -> RequestHead:
    return RequestHead(request_id=f"r{i}", method="POST", path="/v1/chat/completions", headers={})


def stall_config(after_s: float) -> str:
    text = config_text(strategy="round-robin")
    return text.replace("routing:\n", f"routing:\n  stall_after_s: {after_s}\n", 1)


async def _route_many(kit: DirectorKit, start: int, n: int, *, answer: set[str]) -> Counter[str]:
    picks: Counter[str] = Counter()
    for i in range(start, start + n):
        res = await kit.director.route(head(i), BODY)
        assert isinstance(res, RouteResult)
        pick = res.destinations[0]
        picks[pick] += 1
        if pick in answer:
            obs = kit.director.observer_for(f"r{i}")
            assert obs is not None
            obs.on_headers(200, {})
            obs.on_body(b'{"usage": {"prompt_tokens": 9, "completion_tokens": 4}}', True)
            obs.finish(complete=True)
    return picks


async def test_hung_pod_leaves_the_candidates_and_returns_when_it_answers(
    qwen_tokenizer_dir: Path,
) -> None:
    hung = POOL[0]
    kit = build_director(stall_config(STALL_S), qwen_tokenizer_dir)
    try:
        # Round robin spreads requests; the hung pod keeps its requests, the others answer.
        first = await _route_many(kit, 0, 9, answer=set(POOL) - {hung})
        assert first[hung] == 3
        await asyncio.sleep(STALL_S * 2)
        assert kit.director._inflight.stalled(hung, STALL_S)
        during = await _route_many(kit, 100, 30, answer=set(POOL) - {hung})
        assert during[hung] == 0, during  # left out while the others answer
        assert sum(during.values()) == 30  # and nothing was refused
        # The pod answers one of its held requests: it is a candidate again at once.
        obs = kit.director.observer_for("r0")
        assert obs is not None
        obs.on_headers(200, {})
        obs.on_body(b"data: {}\n\n", False)
        after = await _route_many(kit, 200, 30, answer=set(POOL))
        assert after[hung] >= 5, after
    finally:
        kit.close()


async def test_when_every_pod_looks_stalled_none_is_singled_out(qwen_tokenizer_dir: Path) -> None:
    kit = build_director(stall_config(STALL_S), qwen_tokenizer_dir)
    try:
        await _route_many(kit, 0, 1, answer=set(POOL))  # one answer arms the detector
        await _route_many(kit, 1, 6, answer=set())  # then nobody answers
        await asyncio.sleep(STALL_S * 2)
        assert all(kit.director._inflight.stalled(a, STALL_S) for a in POOL)
        picks = await _route_many(kit, 100, 12, answer=set())
        assert set(picks) == set(POOL)  # everyone is slow alike: keep spreading
    finally:
        kit.close()


async def test_off_with_zero(qwen_tokenizer_dir: Path) -> None:
    hung = POOL[0]
    kit = build_director(stall_config(0), qwen_tokenizer_dir)
    try:
        await _route_many(kit, 0, 9, answer=set(POOL) - {hung})
        await asyncio.sleep(STALL_S)
        picks = await _route_many(kit, 100, 9, answer=set(POOL) - {hung})
        assert picks[hung] == 3
    finally:
        kit.close()
