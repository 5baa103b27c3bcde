"""State that outlives a config reload: the reload builds a new director with new steps on the
same core (`extproc.app.Core`), so session ids and stored-response ids a client holds still
name their pods, decisions go on from the same random state and routing memory, requests in
flight keep their leases and their place in the deciding count."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from extproc.director.api import ImmediateReply, RequestHead, RouteResult
from extproc.tokenization import load_tokenizer
from extproc.tokenization.base import Tokenizer
from tests._director import POOL, Blocks, DirectorKit, build_director, config_text
from tests.director._records import record_for

CHAT = orjson.dumps({"model": "qwen3", "messages": [{"role": "user", "content": "hi there"}]})
TURNS = 12  # per pod 1/3 chance that a re-keyed id lands on its pod anyway: all 12 is 1 in 500k


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer_dir: Path) -> Tokenizer:
    return load_tokenizer(qwen_tokenizer_dir)


def text(strategy: str, *, secret: str | None = None, extra: str = "") -> str:
    routing = "routing:\n" + (f"  session_secret: {secret}\n" if secret else "") + extra
    return config_text(strategy=strategy).replace("routing:\n", routing)


def chat(i: int, sid: str | None = None) -> RequestHead:
    headers = {} if sid is None else {"x-session-id": sid}
    return RequestHead(
        request_id=f"c{i}", method="POST", path="/v1/chat/completions", headers=headers
    )


async def routed(k: DirectorKit, head: RequestHead, body: bytes | None) -> RouteResult:
    res = await k.director.route(head, body)
    assert isinstance(res, RouteResult), res
    if res.ticket is not None:
        res.ticket.close()  # the request ended: nothing in flight shifts the next pick
    return res


async def sessions(k: DirectorKit) -> dict[str, str]:
    """Session id -> the pod it was issued for, one per turn."""
    out = {}
    for i in range(TURNS):
        res = await routed(k, chat(i), CHAT)
        out[res.set_headers["x-session-id"]] = res.destinations[0]
    return out


async def stored(k: DirectorKit) -> dict[str, str]:
    """Stored-response id -> the pod that stored it, one per response."""
    out = {}
    for i in range(TURNS):
        body = orjson.dumps({"model": "qwen3", "input": f"question {i}"})
        head = RequestHead(request_id=f"s{i}", method="POST", path="/v1/responses", headers={})
        res = await routed(k, head, body)
        assert res.body is not None
        out[orjson.loads(res.body)["request_id"]] = res.destinations[0]
    return out


async def still_named(k: DirectorKit, ids: dict[str, str], responses: dict[str, str]) -> bool:
    """Whether every session id and every stored-response id still reaches its pod (its
    next turn, `previous_response_id`, and GET)."""
    for i, (sid, pod) in enumerate(ids.items()):
        if (await routed(k, chat(100 + i, sid), CHAT)).destinations[0] != pod:
            return False
    for i, (rid, pod) in enumerate(responses.items()):
        body = orjson.dumps({"model": "qwen3", "input": "next", "previous_response_id": rid})
        head = RequestHead(request_id=f"n{i}", method="POST", path="/v1/responses", headers={})
        if (await routed(k, head, body)).destinations[0] != pod:
            return False
        get = RequestHead(
            request_id=f"g{i}", method="GET", path=f"/v1/responses/{rid}", headers={},
            has_body=False,
        )  # fmt: skip
        if (await routed(k, get, None)).destinations != (pod,):
            return False
    return True


@pytest.mark.parametrize(
    ("before", "after", "kept"),
    [
        pytest.param(None, None, True, id="no-secret-before-or-after"),
        pytest.param("s1", None, True, id="secret-then-none"),
        pytest.param("s1", "s1", True, id="same-secret"),
        pytest.param(None, "s2", False, id="a-secret-configured-re-keys"),
        pytest.param("s1", "s2", False, id="another-secret-re-keys"),
    ],
)
async def test_a_reload_keeps_session_and_stored_response_ids_unless_it_sets_a_new_secret(
    tokenizer: Tokenizer, before: str | None, after: str | None, kept: bool
) -> None:
    seed = "  seed: 1\n"  # picks spread over every pod
    k = build_director(
        text("session-affinity", secret=before, extra=seed), Path(), tokenizer=tokenizer
    )
    try:
        ids, responses = await sessions(k), await stored(k)
        assert set(ids.values()) == set(POOL) == set(responses.values())
        old = k.director
        k.reload(text("session-affinity", secret=after, extra=seed + "  max_fallbacks: 1\n"))
        assert k.director is not old and k.config.routing.max_fallbacks == 1
        assert await still_named(k, ids, responses) is kept
    finally:
        k.close()


async def test_decisions_go_on_from_the_same_turn_and_random_state(tokenizer: Tokenizer) -> None:
    """A reloaded director's round-robin takes the next turn, and its random draws go on
    where they were: the same picks as a director that was never reloaded."""
    seeded = text("round-robin", extra="  seed: 7\n")
    reloaded, steady = (build_director(seeded, Path(), tokenizer=tokenizer) for _ in range(2))
    try:
        first = [(await routed(reloaded, chat(i), CHAT)).destinations[0] for i in range(2)]
        reloaded.reload(seeded.replace("default_strategy: round-robin", "default_strategy: random"))
        then = [(await routed(reloaded, chat(i), CHAT)).destinations[0] for i in range(8)]
        assert first == list(POOL[:2])
        # The same random draws as a director that ran round-robin twice, then random, unbroken.
        assert [(await routed(steady, chat(i), CHAT)).destinations[0] for i in range(2)] == first
        steady.reload(seeded.replace("default_strategy: round-robin", "default_strategy: random"))
        assert [(await routed(steady, chat(i), CHAT)).destinations[0] for i in range(8)] == then
        # And the turn goes on: back on round-robin, the pod after the second.
        reloaded.reload(seeded)
        assert (await routed(reloaded, chat(9), CHAT)).destinations[0] == POOL[2]
    finally:
        reloaded.close()
        steady.close()


async def test_requests_in_flight_keep_their_lease_and_their_place_in_the_deciding_count(
    tokenizer: Tokenizer,
) -> None:
    k = build_director(config_text(max_pending=1), Path(), tokenizer=tokenizer)
    try:
        done = await k.director.route(chat(0), CHAT)
        assert isinstance(done, RouteResult) and k.director.lease_count() == 1
        blocks = Blocks()
        k.add_pre_request(blocks)
        deciding = asyncio.create_task(k.director.route(chat(1), CHAT))
        await asyncio.wait_for(blocks.entered.wait(), 10)
        k.reload(config_text(max_pending=1, strategy="least-request"))
        # The old director's request still counts: the new one is at its limit.
        shed = await k.director.route(chat(2), CHAT)
        assert isinstance(shed, ImmediateReply) and shed.status == 429
        blocks.release.set()
        late = await deciding
        assert isinstance(late, RouteResult) and k.director.deciding == 0
        # Leases taken before the reload end with their records, accounted by the new one.
        assert k.director.lease_count() == 2
        k.director.account(record_for(done))
        k.director.account(record_for(late))
        assert k.director.lease_count() == 0
    finally:
        k.close()
