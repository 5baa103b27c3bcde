"""Per-plugin latency and P/D profiles through the real director: metrics and explain."""

from __future__ import annotations

from pathlib import Path

import orjson

from extproc.director.api import RequestHead, RouteResult
from extproc.director.steps import EXPLAIN_HEADER
from tests._director import POOL, build_director, config_text

BODY = orjson.dumps(
    {"model": "qwen3", "messages": [{"role": "user", "content": "tell me about caches " * 20}]}
)
SECONDS = "extproc_routing_plugin_seconds_count"


def head(i: int, strategy: str | None = None, explain: bool = False) -> RequestHead:
    headers = {"routing-strategy": strategy} if strategy else {}
    if explain:
        headers[EXPLAIN_HEADER] = "true"
    return RequestHead(
        request_id=f"r{i}", method="POST", path="/v1/chat/completions", headers=headers
    )


async def test_each_plugin_of_a_routed_decision_is_timed_in_the_metric_and_explain(
    qwen_tokenizer_dir: Path,
) -> None:
    kit = build_director(config_text(strategy="gaie"), qwen_tokenizer_dir)
    try:
        for i in range(3):
            res = await kit.director.route(head(i, explain=i == 0), BODY)
            assert isinstance(res, RouteResult)
            if i == 0:
                text = res.set_headers[EXPLAIN_HEADER]
                assert "latency=queue:" in text and "+max-score:" in text
        for scorer in ("queue", "kv-cache-utilization", "prefix"):
            assert kit.sample(SECONDS, kind="scorer", plugin=scorer) == 3
        assert kit.sample(SECONDS, kind="picker", plugin="max-score") == 3

        explained = await kit.director.explain(head(9, strategy="kv-aware"), BODY)
        (only,) = explained["plugins"]
        assert (only["kind"], only["type"], only["name"]) == ("strategy", "kv-aware", "kv-aware")
        assert only["us"] >= 0
        assert explained["profiles"] == {}
        # explain decides without routing: nothing is counted
        assert kit.sample(SECONDS, kind="strategy", plugin="kv-aware") == 0
        await kit.director.route(head(10, strategy="kv-aware"), BODY)
        assert kit.sample(SECONDS, kind="strategy", plugin="kv-aware") == 1
    finally:
        kit.close()


async def test_pd_without_prefill_pods_explains_both_profiles_and_counts_the_fallback(
    qwen_tokenizer_dir: Path,
) -> None:
    kit = build_director(config_text(), qwen_tokenizer_dir)  # every pod is role "both"
    try:
        explained = await kit.director.explain(head(1, strategy="pd"), BODY)
        assert explained["prefill"] is None
        assert explained["profiles"]["prefill"] == []
        assert sorted(explained["profiles"]["decode"]) == sorted(POOL)
        assert explained["profiles"]["decode"][0] == explained["pick"]
        res = await kit.director.route(head(2, strategy="prefix-cache:1,pd:1"), BODY)
        assert isinstance(res, RouteResult)
        assert kit.sample("extproc_pd_fallbacks_total", model="qwen3") == 1
        await kit.director.route(head(3, strategy="prefix-cache"), BODY)
        assert kit.sample("extproc_pd_fallbacks_total", model="qwen3") == 1  # P/D only
    finally:
        kit.close()
