"""Token budgets end to end: deploy/overlays/envoy-gateway-token-limits as Envoy Gateway renders
it, a real rate limit service (tests/envoy/rls_server.py), the real server and simulators.

Envoy checks each request's budget for nothing and, once the answer is done, charges its total
tokens as the Lua filter read them from the answer. Only the Envoy Gateway shape has rate
limits: the local bootstrap has no rate limit filter (there is no local manifest to say what
to limit), so these cases run on that shape alone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from extproc.stack.envoy_gateway import DEPLOY_DIR, GatewayShape
from extproc.stack.local import LocalStack
from tests.e2e.harness import (
    in_flight,
    metric_samples,
    metric_sum,
    running_stack,
    served_counts,
    stack_options,
    wait_for,
)
from tests.envoy._rls import calls, rate_limit_service

pytestmark = pytest.mark.e2e

OVERLAY = DEPLOY_DIR / "overlays" / "envoy-gateway-token-limits"
CHAT = {
    "model": "qwen3",
    "messages": [{"role": "user", "content": "Count to five, please."}],
    "max_tokens": 7,
}


@dataclass
class Limited:
    stack: LocalStack
    record: Path
    route: str  # the xds route name, the first entry of every descriptor


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Limited]:
    tmp = tmp_path_factory.mktemp("limits")
    # One request's worth: a user's first request passes, every later one is over budget.
    with rate_limit_service(tmp, limit=1) as (port, record):
        opts = stack_options(
            tmp,
            sims=2,
            gateway_shape=GatewayShape.ENVOY_GATEWAY,
            gateway_overlay=OVERLAY,
            rate_limit_service=f"127.0.0.1:{port}",
            # The test service is Python on a busy machine: Envoy's 20 ms default would let
            # requests through unchecked (fail-open) now and then.
            rate_limit_timeout_s=2.0,
        )
        with running_stack(opts) as stack:
            translation = stack.envoy_gateway_translation()
            assert translation is not None and translation.rate_limited
            (route,) = translation.route_names
            yield Limited(stack, record, route)


def descriptor(route: str, user: str) -> list[list[list[str]]]:
    # Envoy Gateway's descriptor for a Distinct header selector (ratelimit.go): the route's
    # generic key, then the header's value under rule-<i>-match-<j>.
    return [[[route, route], ["rule-0-match-0", user]]]


def post(stack: LocalStack, user: str | None, body: dict[str, Any]) -> httpx.Response:
    headers = {} if user is None else {"x-user-id": user}
    return httpx.post(
        f"{stack.base_url}/v1/chat/completions", json=body, headers=headers, timeout=30
    )


def user_calls(limited: Limited, user: str) -> list[dict[str, Any]]:
    return [c for c in calls(limited.record) if c["descriptors"] == descriptor(limited.route, user)]


def settled_user_calls(limited: Limited, user: str, count: int) -> list[dict[str, Any]]:
    for _ in range(100):
        found = user_calls(limited, user)
        if len(found) >= count:
            return found
        time.sleep(0.05)
    return user_calls(limited, user)


def quiet_count(record: Path) -> int:
    """The number of calls once none has come for half a second (a charge comes at the end
    of its stream, after the client has its answer)."""
    count, still = len(calls(record)), 0
    while still < 10:
        time.sleep(0.05)
        now = len(calls(record))
        count, still = now, (still + 1 if now == count else 0)
    return count


def test_the_charge_is_the_answers_usage_exactly(limited: Limited) -> None:
    assert wait_for(lambda: in_flight(limited.stack) == 0)  # earlier records are in
    before = metric_samples(f"http://127.0.0.1:{limited.stack.options.metrics_port}/metrics")
    r = post(limited.stack, "alice", CHAT)
    assert r.status_code == 200
    usage = r.json()["usage"]
    found = settled_user_calls(limited, "alice", 2)
    # The check costs nothing; the charge is what the client was told it used.
    assert [c["costs"] for c in found] == [[0], [usage["total_tokens"]]]
    assert [c["domain"] for c in found] == ["extproc/llm-gateway/http"] * 2

    # ... which is also what the server accounts from the access log (Envoy's 1 s flush).
    def accounted() -> float:
        after = metric_samples(f"http://127.0.0.1:{limited.stack.options.metrics_port}/metrics")
        return metric_sum(after, "extproc_completion_tokens_total") - metric_sum(
            before, "extproc_completion_tokens_total"
        )

    assert wait_for(lambda: accounted() == usage["completion_tokens"])


def test_a_stream_is_charged_its_usage_even_when_the_client_asked_for_none(
    limited: Limited,
) -> None:
    # The server injects stream_options.include_usage, so the Lua filter finds usage.
    with httpx.stream(
        "POST",
        f"{limited.stack.base_url}/v1/chat/completions",
        json={**CHAT, "stream": True},
        headers={"x-user-id": "dave"},
        timeout=30,
    ) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    usage = [json.loads(e)["usage"] for e in events if '"usage"' in e][-1]
    found = settled_user_calls(limited, "dave", 2)
    assert [c["costs"] for c in found] == [[0], [usage["total_tokens"]]]


def test_over_budget_gets_429_before_the_engine_and_other_users_are_not_affected(
    limited: Limited,
) -> None:
    assert post(limited.stack, "bob", CHAT).status_code == 200
    settled_user_calls(limited, "bob", 2)  # charged: now over the budget of 1
    served = sum(served_counts(limited.stack).values())
    assert post(limited.stack, "bob", CHAT).status_code == 429
    assert sum(served_counts(limited.stack).values()) == served  # no engine saw it
    assert post(limited.stack, "carol", CHAT).status_code == 200


def test_a_request_without_the_user_header_is_not_limited(limited: Limited) -> None:
    count = quiet_count(limited.record)
    for _ in range(3):
        assert post(limited.stack, None, CHAT).status_code == 200
    # Envoy skips a descriptor whose header is missing: no call at all.
    assert quiet_count(limited.record) == count
