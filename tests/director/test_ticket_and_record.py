"""The two halves of accounting: the ticket (ended once, by its request's record) and the
record (accounted on any process, with nothing but what the record carries)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from extproc.director.api import Outcome, RequestHead, RouteResult
from extproc.types import TokenUsage
from tests._director import DirectorKit, build_director, config_text
from tests.director._records import record_for

BODY = orjson.dumps(
    {"model": "qwen3", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8}
)


def head(i: int, **headers: str) -> RequestHead:
    return RequestHead(
        request_id=f"r{i}", method="POST", path="/v1/chat/completions", headers=headers
    )


@pytest.fixture
def kit(qwen_tokenizer_dir: Path) -> Iterator[DirectorKit]:
    made = build_director(config_text(), qwen_tokenizer_dir)
    yield made
    made.close()


@pytest.fixture
def kits(kit: DirectorKit, qwen_tokenizer_dir: Path) -> Iterator[list[DirectorKit]]:
    """Two directors with nothing shared: two processes."""
    other = build_director(config_text(), qwen_tokenizer_dir)
    yield [kit, other]
    other.close()


async def test_the_ticket_releases_the_lease_once(kit: DirectorKit) -> None:
    res = await kit.director.route(head(1, **{"x-user-id": "alice"}), BODY)
    assert isinstance(res, RouteResult) and res.ticket is not None
    assert kit.director.lease_count() == 1
    assert kit.core.fairness.is_active("alice")
    for _ in range(3):
        res.ticket.close()
    assert kit.director.lease_count() == 0
    assert not kit.core.fairness.is_active("alice")
    assert kit.sample("extproc_routed_requests_total", model="qwen3") == 1


@pytest.mark.parametrize(
    ("outcome", "status", "counted"),
    [(Outcome.COMPLETE, 200, "200"), (Outcome.CLIENT_ABORTED, 200, "499")],
)
async def test_the_requests_record_ends_its_lease_once(
    kit: DirectorKit, outcome: Outcome, status: int, counted: str
) -> None:
    res = await kit.director.route(head(1, **{"x-user-id": "alice"}), BODY)
    assert isinstance(res, RouteResult) and res.ticket is not None and not res.hold
    assert kit.director.lease_count() == 1  # the request goes on after the stream ended
    record = record_for(res, outcome=outcome, status=status)
    kit.director.account(record)
    assert record.lease is not None
    kit.core.leases.settle(record.lease)  # a second notice of its end changes nothing
    assert kit.director.lease_count() == 0
    assert not kit.core.fairness.is_active("alice")
    assert kit.sample("extproc_lease_ends_total", how="record") == 1
    assert kit.sample("extproc_routed_requests_total", model="qwen3") == 1
    assert kit.sample("extproc_requests_total", status=counted, strategy="prefix-cache") == 1


async def test_the_decision_travels_with_the_request(kit: DirectorKit) -> None:
    res = await kit.director.route(head(1, **{"x-user-id": "bob"}), BODY)
    assert isinstance(res, RouteResult) and res.routed is not None
    routed = res.routed
    assert (routed.model, routed.endpoint, routed.user) == ("qwen3", res.destinations[0], "bob")
    assert routed.strategy == "prefix-cache" and routed.prompt_tokens > 0
    assert not routed.estimated  # tokenized with the real Qwen3 tokenizer


async def test_any_process_accounts_any_record_exactly(kits: list[DirectorKit]) -> None:
    router, other = kits
    res = await router.director.route(head(1, **{"x-user-id": "carol"}), BODY)
    assert isinstance(res, RouteResult) and res.routed is not None and res.ticket is not None
    res.ticket.close()
    prompt = res.routed.prompt_tokens
    other.director.account(record_for(res, usage=TokenUsage(prompt + 3, 40, 16)))
    ep = res.destinations[0]
    assert other.sample("extproc_completion_tokens_total", model="qwen3", endpoint=ep) == 40
    assert other.sample("extproc_prompt_tokens_total", model="qwen3", endpoint=ep) == prompt + 3
    assert other.sample("extproc_cached_tokens_total", model="qwen3", endpoint=ep) == 16
    assert other.sample("extproc_requests_total", status="200", strategy="prefix-cache") == 1
    assert router.sample("extproc_requests_total", status="200") == 0  # not on the router
    # The user is charged the engine's correction and the output (1 and 2 per token).
    assert other.core.fairness.tokens("carol") == pytest.approx(3 + 2 * 40)
    stats = other.core.podstats.stats(ep, other.core.clock())
    assert stats.requests_total == 1
    assert stats.ttft_avg_s == pytest.approx(0.099, abs=1e-6)  # first token 0.1 - sent 0.001
    assert stats.tpot_avg_s == pytest.approx(0.3 / 39)


@pytest.mark.parametrize(
    ("outcome", "status", "label", "aborted"),
    [
        (Outcome.CLIENT_ABORTED, 200, "499", "client_aborted"),
        (Outcome.CLIENT_ABORTED, 0, "499", "client_aborted"),
        (Outcome.UPSTREAM_FAILED, 503, "503", "upstream_failed"),
        (Outcome.UPSTREAM_FAILED, 0, "502", "upstream_failed"),
    ],
)
async def test_aborted_responses_are_counted_with_what_is_known(
    kit: DirectorKit, outcome: Outcome, status: int, label: str, aborted: str
) -> None:
    res = await kit.director.route(head(1), BODY)
    assert isinstance(res, RouteResult)
    usage = TokenUsage(completion_tokens=6, counted=True)
    kit.director.account(record_for(res, status=status, outcome=outcome, usage=usage))
    assert kit.sample("extproc_requests_total", status=label) == 1
    assert kit.sample("extproc_aborted_responses_total", outcome=aborted) == 1
    assert kit.sample("extproc_completion_tokens_total") == 6  # what streamed before the end
    assert kit.sample("extproc_usage_counted_total") == 1
    assert kit.core.podstats.stats(res.destinations[0], 0).requests_total == 0


async def test_a_complete_answer_without_usage_is_unknown_not_zero(
    kit: DirectorKit,
) -> None:
    res = await kit.director.route(head(1), BODY)
    assert isinstance(res, RouteResult)
    kit.director.account(record_for(res, usage=TokenUsage()))
    assert kit.sample("extproc_usage_unknown_total", model="qwen3") == 1
    assert kit.sample("extproc_completion_tokens_total") == 0


async def test_records_of_requests_the_gateway_never_routed_are_not_counted_again(
    kit: DirectorKit,
) -> None:
    res = await kit.director.route(head(1), BODY)
    assert isinstance(res, RouteResult)
    unrouted = RouteResult(destinations=res.destinations)  # rejected, or accounting off
    kit.director.account(record_for(unrouted, status=429))
    assert kit.sample("extproc_access_records_total", result="unrouted") == 1
    assert kit.sample("extproc_requests_total") == 0
