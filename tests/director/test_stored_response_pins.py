"""Stored responses through the real director: the id it writes names the pick, and
`previous_response_id`, GET and cancel reach that pod from any process with the secret."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from extproc.director.api import ImmediateReply, RequestHead, RouteResult
from extproc.tokenization import load_tokenizer
from extproc.tokenization.base import Tokenizer
from tests._director import POOL, DirectorKit, build_director, config_text

SECRET = "one secret for the gateway"


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer_dir: Path) -> Tokenizer:
    return load_tokenizer(qwen_tokenizer_dir)


def kit(tokenizer: Tokenizer, *, secret: str = SECRET, drop: str | None = None) -> DirectorKit:
    text = config_text(strategy="random").replace(
        "routing:\n", f"routing:\n  session_secret: {secret}\n"
    )
    if drop is not None:  # a pool that lost one pod
        text = text.replace(f"      - address: {drop}\n", "")
    return build_director(text, Path(), tokenizer=tokenizer)


async def create(k: DirectorKit, i: int, **fields: object) -> tuple[str, dict[str, object]]:
    body = orjson.dumps({"model": "qwen3", "input": f"question {i}", **fields})
    res = await k.director.route(
        RequestHead(request_id=f"r{i}", method="POST", path="/v1/responses", headers={}), body
    )
    assert isinstance(res, RouteResult), res
    if res.ticket is not None:
        res.ticket.close()
    assert res.body is not None
    return res.destinations[0], orjson.loads(res.body)


async def get(k: DirectorKit, path: str) -> RouteResult | ImmediateReply:
    head = RequestHead(request_id="g", method="GET", path=path, headers={}, has_body=False)
    return await k.director.route(head, None)


async def test_previous_response_get_and_cancel_reach_the_pod_on_every_process(
    tokenizer: Tokenizer,
) -> None:
    one, two = kit(tokenizer), kit(tokenizer)  # two processes (or replicas), one secret
    try:
        pods: set[str] = set()
        # Random picks: go on until every pod made some (12 picks left one out 2 % of the time;
        # 80 leave one out about once in 10^14).
        for i in range(80):
            if len(pods) == len(POOL) and i >= 12:
                break
            pod, sent = await create(one, i)
            rid = sent["request_id"]
            assert isinstance(rid, str) and rid.startswith("resp_") and pod not in rid
            pods.add(pod)
            for k in (one, two):
                again, nxt = await create(k, 100 + i, previous_response_id=rid)
                assert again == pod  # the only candidate left
                assert nxt["request_id"] != rid  # a new response, a new id
                for path in (f"/v1/responses/{rid}", f"/v1/responses/{rid}/cancel"):
                    res = await get(k, path)
                    assert isinstance(res, RouteResult) and res.destinations == (pod,)
        assert len(pods) == len(POOL)
    finally:
        one.close()
        two.close()


async def test_ids_the_gateway_did_not_make_route_as_usual(tokenizer: Tokenizer) -> None:
    one, other = kit(tokenizer), kit(tokenizer, secret="another gateway's secret")
    try:
        _, sent = await create(other, 0)
        for rid in ("resp_made_up", str(sent["request_id"]), "resp_x.AAAAAAAAAAAAAAAA"):
            seen = {(await create(one, i, previous_response_id=rid))[0] for i in range(12)}
            assert len(seen) > 1, rid  # not pinned anywhere
    finally:
        one.close()
        other.close()


async def test_a_response_whose_pod_is_gone_routes_as_usual(tokenizer: Tokenizer) -> None:
    """Its memory went with the pod: whichever pod gets it answers vLLM's own 404."""
    one = kit(tokenizer)
    try:
        pod, sent = await create(one, 0)
    finally:
        one.close()
    shrunk = kit(tokenizer, drop=pod)
    try:
        rid = sent["request_id"]
        seen = {(await create(shrunk, i, previous_response_id=rid))[0] for i in range(30)}
        assert pod not in seen and len(seen) == 2
        got = await get(shrunk, f"/v1/responses/{rid}")
        assert isinstance(got, RouteResult) and pod not in got.destinations
    finally:
        shrunk.close()
