"""Model rewrites through the real director: a canary between adapters, its metric, and a
session or a stored response keeping its target on every process."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson
import pytest

from extproc.director.api import RequestHead, RouteResult
from extproc.tokenization import load_tokenizer
from extproc.tokenization.base import Tokenizer
from tests._director import DirectorKit, build_director

CONFIG = """
routing:
  default_strategy: random
  session_secret: one secret for the gateway
models:
  - name: qwen3
    lora_adapters: [lora-a, lora-b]
    endpoints:
      - address: 10.0.0.1:8000
      - address: 10.0.0.2:8000
model_rewrites:
  - name: canary
    rules:
      - models: [chat]
        targets: [{model: lora-a, weight: 80}, {model: lora-b, weight: 20}]
"""


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer_dir: Path) -> Tokenizer:
    return load_tokenizer(qwen_tokenizer_dir)


async def send(
    k: DirectorKit, path: str, fields: dict[str, object], headers: dict[str, str] | None = None
) -> tuple[str, RouteResult]:
    """(the model the engine gets, the result)"""
    body = orjson.dumps({"model": "chat", **fields})
    res = await k.director.route(
        RequestHead(request_id="r", method="POST", path=path, headers=headers or {}), body
    )
    assert isinstance(res, RouteResult), res
    if res.ticket is not None:
        res.ticket.close()
    assert res.body is not None
    return str(orjson.loads(res.body)["model"]), res


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


async def test_canary_split_and_its_metric(tokenizer: Tokenizer) -> None:
    k = build_director(CONFIG, Path(), tokenizer=tokenizer)
    try:
        seen = Counter([(await send(k, "/v1/chat/completions", CHAT))[0] for _ in range(1000)])
        assert set(seen) == {"lora-a", "lora-b"}
        assert abs(seen["lora-a"] / 1000 - 0.8) < 0.05
        for t in ("lora-a", "lora-b"):
            got = k.sample("extproc_model_rewrite_decisions_total", rewrite="canary", target=t)
            assert got == seen[t]
        # A model no rule matches goes through untouched.
        body = orjson.dumps({"model": "qwen3", **CHAT})
        res = await k.director.route(
            RequestHead(request_id="r", method="POST", path="/v1/chat/completions", headers={}),
            body,
        )
        assert isinstance(res, RouteResult) and res.body is None
    finally:
        k.close()


async def test_a_session_keeps_its_target_on_every_process(tokenizer: Tokenizer) -> None:
    one, two = (build_director(CONFIG, Path(), tokenizer=tokenizer) for _ in range(2))
    try:
        served_by = Counter()
        for n in range(40):
            served, res = await send(one, "/v1/chat/completions", CHAT, {"x-session-id": f"u{n}"})
            sid = res.set_headers["x-session-id"]
            served_by[served] += 1
            for k in (one, two, one, two):
                again, res = await send(k, "/v1/chat/completions", CHAT, {"x-session-id": sid})
                # The same target; the pod is the strategy's (random here), the tag the same.
                assert again == served
                assert res.set_headers["x-session-id"].rsplit(".", 1)[1] == sid.rsplit(".", 1)[1]
        assert set(served_by) == {"lora-a", "lora-b"}  # sessions spread by the weights
    finally:
        one.close()
        two.close()


async def test_a_stored_response_keeps_its_target_and_pod(tokenizer: Tokenizer) -> None:
    one, two = (build_director(CONFIG, Path(), tokenizer=tokenizer) for _ in range(2))
    try:
        targets = set()
        for n in range(30):
            served, res = await send(one, "/v1/responses", {"input": f"q{n}"})
            rid = orjson.loads(res.body or b"")["request_id"]
            targets.add(served)
            for k in (two, one):
                again, nxt = await send(
                    k, "/v1/responses", {"input": "more", "previous_response_id": rid}
                )
                assert (again, nxt.destinations) == (served, res.destinations[:1])
        assert targets == {"lora-a", "lora-b"}
    finally:
        one.close()
        two.close()
