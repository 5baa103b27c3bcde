"""Explain changes nothing: for every registered strategy and profile, explaining before each
request leaves the live decisions exactly as they are without it (issue 27: explains with
`--strategy round-robin` advanced the live round-robin turn)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from extproc.director.api import ImmediateReply, RequestHead, RouteResult
from extproc.routing.builtin import default_registry
from extproc.tokenization import load_tokenizer
from extproc.tokenization.base import Tokenizer
from tests._clock import ManualClock
from tests._director import build_director, config_text

NAMES = default_registry().names()
PROMPTS = [f"question {i}: " + "tell me about caches " * (5 + 7 * (i % 3)) for i in range(8)]


def body(i: int) -> bytes:
    messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
    return orjson.dumps({"model": "qwen3", "messages": messages})


def head(i: int, strategy: str) -> RequestHead:
    return RequestHead(
        request_id=f"r{i}",
        method="POST",
        path="/v1/chat/completions",
        headers={"routing-strategy": strategy, "x-user-id": f"u{i % 2}"},
    )


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer_dir: Path) -> Tokenizer:
    return load_tokenizer(qwen_tokenizer_dir)


async def live_picks(tokenizer: Tokenizer, strategy: str, *, explains: int) -> list[object]:
    """The destinations of 9 requests; `explains` explains of the same request before each."""
    clock = ManualClock()
    text = config_text().replace("routing:\n", "routing:\n  seed: 7\n")
    kit = build_director(text, Path(), tokenizer=tokenizer, clock=clock.now, wall_clock=clock.wall)
    picks: list[object] = []
    try:
        for i in range(9):
            for _ in range(explains):
                await kit.director.explain(head(i, strategy), body(i))
            res = await kit.director.route(head(i, strategy), body(i))
            if isinstance(res, ImmediateReply):
                picks.append(res.status)
                continue
            assert isinstance(res, RouteResult)
            picks.append(res.destinations)
            if i % 2 and res.ticket is not None:
                res.ticket.close()  # some requests end, some stay in flight
            clock.advance(0.05)
    finally:
        kit.close()
    return picks


@pytest.mark.parametrize("strategy", [*NAMES, "least-request:1,random:0.5"])
@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
async def test_explaining_leaves_every_live_decision_as_it_was(
    tokenizer: Tokenizer, strategy: str
) -> None:
    alone = await live_picks(tokenizer, strategy, explains=0)
    for explains in (1, 2):  # not 3: with 3 pods, 3 turns of round-robin would look like none
        assert await live_picks(tokenizer, strategy, explains=explains) == alone
