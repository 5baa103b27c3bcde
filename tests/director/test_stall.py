"""A pod that accepts requests and answers none leaves the candidates while others answer."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import orjson

from extproc.director.api import RequestHead, RouteResult
from tests.director._records import record_for
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


async def _route_many(
    kit: DirectorKit, start: int, n: int, *, answer: set[str], held: dict[int, RouteResult]
) -> Counter[str]:
    """Route n requests; those picked onto `answer` pods complete (routing stream ends, the
    record arrives), the others stay held in `held`."""
    picks: Counter[str] = Counter()
    for i in range(start, start + n):
        res = await kit.director.route(head(i), BODY)
        assert isinstance(res, RouteResult) and res.ticket is not None
        pick = res.destinations[0]
        picks[pick] += 1
        if pick in answer:
            res.ticket.close()
            kit.director.account(record_for(res, started_ago_s=0.01, done_s=0.005))
        else:
            held[i] = res
    return picks


async def test_hung_pod_leaves_the_candidates_and_returns_when_it_answers(
    qwen_tokenizer_dir: Path,
) -> None:
    hung = POOL[0]
    kit = build_director(stall_config(STALL_S), qwen_tokenizer_dir)
    held: dict[int, RouteResult] = {}
    try:
        # Round robin spreads requests; the hung pod keeps its requests, the others answer.
        first = await _route_many(kit, 0, 9, answer=set(POOL) - {hung}, held=held)
        assert first[hung] == 3
        await asyncio.sleep(STALL_S * 2)
        assert kit.director._inflight.stalled(hung, STALL_S)
        during = await _route_many(kit, 100, 30, answer=set(POOL) - {hung}, held=held)
        assert during[hung] == 0, during  # left out while the others answer
        assert sum(during.values()) == 30  # and nothing was refused
        # The pod completes one of its held requests: it is a candidate again at once.
        res = held.pop(0)
        assert res.ticket is not None
        res.ticket.close()
        kit.director.account(record_for(res, started_ago_s=STALL_S * 3, done_s=STALL_S * 3))
        after = await _route_many(kit, 200, 30, answer=set(POOL), held=held)
        assert after[hung] >= 5, after
    finally:
        kit.close()


async def test_when_every_pod_looks_stalled_none_is_singled_out(qwen_tokenizer_dir: Path) -> None:
    kit = build_director(stall_config(STALL_S), qwen_tokenizer_dir)
    held: dict[int, RouteResult] = {}
    try:
        await _route_many(kit, 0, 1, answer=set(POOL), held=held)  # one answer arms it
        await _route_many(kit, 1, 6, answer=set(), held=held)  # then nobody answers
        await asyncio.sleep(STALL_S * 2)
        assert all(kit.director._inflight.stalled(a, STALL_S) for a in POOL)
        picks = await _route_many(kit, 100, 12, answer=set(), held=held)
        assert set(picks) == set(POOL)  # everyone is slow alike: keep spreading
    finally:
        kit.close()


async def test_off_with_zero(qwen_tokenizer_dir: Path) -> None:
    hung = POOL[0]
    kit = build_director(stall_config(0), qwen_tokenizer_dir)
    held: dict[int, RouteResult] = {}
    try:
        await _route_many(kit, 0, 9, answer=set(POOL) - {hung}, held=held)
        await asyncio.sleep(STALL_S)
        picks = await _route_many(kit, 100, 9, answer=set(POOL) - {hung}, held=held)
        assert picks[hung] == 3
    finally:
        kit.close()
