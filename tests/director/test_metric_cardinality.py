"""Clients cannot grow the metric registry: every label fed from a request is bounded."""

from __future__ import annotations

from pathlib import Path

import orjson
from prometheus_client import CollectorRegistry

from extproc.director.api import RequestHead, RouteResult
from tests._director import POOL, build_director, config_text
from tests.director._records import record_for

BODY = orjson.dumps({"model": "qwen3", "messages": [{"role": "user", "content": "hello " * 40}]})


def series(registry: CollectorRegistry) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """Every series, with the endpoint label (bounded by discovery: checked apart) left out."""
    out = set()
    for family in registry.collect():
        for s in family.samples:
            assert s.labels.get("endpoint", POOL[0]) in POOL
            out.add((s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "endpoint"))))
    return out


def head(i: int, headers: dict[str, str]) -> RequestHead:
    return RequestHead(
        request_id=f"r{i}", method="POST", path="/v1/chat/completions", headers=headers
    )


async def test_a_thousand_ad_hoc_specs_add_no_series(qwen_tokenizer_dir: Path) -> None:
    kit = build_director(config_text(), qwen_tokenizer_dir)
    try:

        async def serve(i: int, headers: dict[str, str], body: bytes = BODY) -> None:
            res = await kit.director.route(head(i, headers), body)
            if isinstance(res, RouteResult):
                kit.director.account(record_for(res))
                res.ticket.close()

        async def traffic(n: int, offset: int) -> None:
            for i in range(offset, offset + n):
                # what a client controls: the spec, the user, the session, the model asked for
                fields = {"x-user-id": f"u{i}", "x-session-id": f"s{i}"}
                await serve(i, {"routing-strategy": f"least-request:1,random:0.{i}", **fields})
                await serve(i, {"routing-strategy": f"random:{i}", **fields})
                await serve(i, {"routing-strategy": f"no-such-scorer-{i}"})  # 400
                other = orjson.dumps(
                    {"model": f"m{i}", "messages": [{"role": "user", "content": "x"}]}
                )
                await serve(i, fields, other)  # 404
            await serve(offset, {"routing-strategy": "least-request"})  # a name keeps its label
            await serve(offset, {"routing-strategy": " gaie "})

        await traffic(2, 1)
        before = series(kit.registry)
        await traffic(1000, 10)
        assert series(kit.registry) == before
        strategies = {dict(labels).get("strategy") for _, labels in before} - {None}
        assert strategies == {"adhoc", "least-request", "gaie", ""}
    finally:
        kit.close()
