"""A pod that accepts requests and answers none leaves the candidates while others answer.

Time is a ManualClock shared by the director and its in-flight tracker: the tests move it
instead of sleeping, so the real default (10 s) is tested as it is."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from extproc.director.api import RequestHead, RouteResult
from tests._clock import ManualClock
from tests._director import POOL, DirectorKit, build_director, config_text
from tests.director._records import record_for

BODY = orjson.dumps(
    {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
)
STALL_S = 10.0


def head(i: int) -> RequestHead:
    return RequestHead(request_id=f"r{i}", method="POST", path="/v1/chat/completions", headers={})


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def stall_kit(after_s: float, tokenizer_dir: Path, clock: ManualClock) -> DirectorKit:
    text = config_text(strategy="round-robin")
    text = text.replace("routing:\n", f"routing:\n  stall_after_s: {after_s}\n", 1)
    return build_director(text, tokenizer_dir, clock=clock.now, wall_clock=clock.wall)


@pytest.fixture
def kit(qwen_tokenizer_dir: Path, clock: ManualClock) -> Iterator[DirectorKit]:
    made = stall_kit(STALL_S, qwen_tokenizer_dir, clock)
    yield made
    made.close()


async def _route_many(
    kit: DirectorKit,
    clock: ManualClock,
    start: int,
    n: int,
    *,
    answer: set[str],
    held: dict[int, RouteResult],
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
            record = record_for(res, started_ago_s=0.01, done_s=0.005, wall_now=clock.wall())
            kit.director.account(record)
        else:
            held[i] = res
    return picks


async def test_hung_pod_leaves_the_candidates_and_returns_when_it_answers(
    kit: DirectorKit, clock: ManualClock
) -> None:
    hung = POOL[0]
    held: dict[int, RouteResult] = {}
    others = set(POOL) - {hung}
    # Round robin spreads requests; the hung pod keeps its requests, the others answer.
    first = await _route_many(kit, clock, 0, 9, answer=others, held=held)
    assert first[hung] == 3
    clock.advance(STALL_S - 0.5)
    assert not kit.core.inflight.stalled(hung, STALL_S)  # slow is not hung yet
    still = await _route_many(kit, clock, 50, 3, answer=others, held=held)
    assert still[hung] == 1
    clock.advance(1.0)
    assert kit.core.inflight.stalled(hung, STALL_S)
    during = await _route_many(kit, clock, 100, 30, answer=others, held=held)
    assert during[hung] == 0, during  # left out while the others answer
    assert sum(during.values()) == 30  # and nothing was refused
    # The pod completes one of its held requests: it is a candidate again at once.
    res = held.pop(0)
    assert res.ticket is not None
    res.ticket.close()
    kit.director.account(
        record_for(res, started_ago_s=STALL_S + 1, done_s=STALL_S + 0.9, wall_now=clock.wall())
    )
    after = await _route_many(kit, clock, 200, 30, answer=set(POOL), held=held)
    assert after[hung] >= 5, after


async def test_when_every_pod_looks_stalled_none_is_singled_out(
    kit: DirectorKit, clock: ManualClock
) -> None:
    held: dict[int, RouteResult] = {}
    await _route_many(kit, clock, 0, 1, answer=set(POOL), held=held)  # one answer arms it
    await _route_many(kit, clock, 1, 6, answer=set(), held=held)  # then nobody answers
    clock.advance(STALL_S * 2)
    assert all(kit.core.inflight.stalled(a, STALL_S) for a in POOL)
    picks = await _route_many(kit, clock, 100, 12, answer=set(), held=held)
    assert set(picks) == set(POOL)  # everyone is slow alike: keep spreading


async def test_off_with_zero(qwen_tokenizer_dir: Path, clock: ManualClock) -> None:
    hung = POOL[0]
    kit = stall_kit(0, qwen_tokenizer_dir, clock)
    held: dict[int, RouteResult] = {}
    try:
        await _route_many(kit, clock, 0, 9, answer=set(POOL) - {hung}, held=held)
        clock.advance(STALL_S * 10)
        picks = await _route_many(kit, clock, 100, 9, answer=set(POOL) - {hung}, held=held)
        assert picks[hung] == 3
    finally:
        kit.close()
