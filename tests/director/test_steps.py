"""Each lifecycle step alone: build it with real collaborators, call it, read what it did."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from extproc.config import RouteSettings, SaturationConfig
from extproc.director.lifecycle import ModelRuntime, Outgoing
from extproc.director.prefill import PrefillClient
from extproc.director.steps import (
    DEFAULT_OUTPUT_ESTIMATE,
    EXPLAIN_HEADER,
    ClaimEndpoint,
    ExplainHeader,
    RecordPick,
    RemotePrefill,
    RewriteBody,
    SessionAffinity,
    ShedSheddable,
    TagForAccounting,
)
from extproc.routing.base import PodState
from extproc.routing.session import SessionTokens
from extproc.types import Endpoint, TooManyRequests
from tests.director._prepared import PODS, Parts, decision, model_runtime, pod, prepared

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture
def runtime() -> Iterator[ModelRuntime]:
    with model_runtime() as rt:
        yield rt


@pytest.fixture
def parts() -> Parts:
    return Parts()


# -- admit ---------------------------------------------------------------------------------------

SATURATED = tuple(pod(a, waiting=50.0, kv=0.99) for a in PODS)
ONE_FREE = (pod(PODS[0], waiting=0.0, kv=0.1), *SATURATED[1:])


@pytest.mark.parametrize(
    ("priority", "shed_route", "pods", "rejected"),
    [
        pytest.param(-1, True, SATURATED, True, id="sheddable-all-saturated"),
        pytest.param(0, True, SATURATED, False, id="normal-priority-never-shed"),
        pytest.param(-1, False, SATURATED, False, id="route-turns-shedding-off"),
        pytest.param(-1, True, ONE_FREE, False, id="one-pod-has-headroom"),
    ],
)
@pytest.mark.parametrize("dry_run", [False, True])
async def test_shed_sheddable(
    runtime: ModelRuntime,
    parts: Parts,
    priority: int,
    shed_route: bool,
    pods: tuple[PodState, ...],
    rejected: bool,
    dry_run: bool,
) -> None:
    parts.scrape(pods)
    step = ShedSheddable(
        candidates=parts.candidates(), metrics=parts.metrics, saturation=SaturationConfig()
    )
    req, _ = prepared(
        runtime, priority=priority, settings=RouteSettings(shed_sheddable=shed_route),
        dry_run=dry_run,
    )  # fmt: skip
    if rejected:
        with pytest.raises(TooManyRequests):
            await step.admit(req)
    else:
        assert (await step.admit(req)).waited_s == 0  # it never waits
    # Counted where it happens, but not in a dry run (an explain).
    shed = parts.sample("extproc_shed_requests_total", model="qwen3", reason="saturated")
    assert shed == (1 if rejected and not dry_run else 0)


async def test_shed_sheddable_leaves_an_empty_pool_to_the_place_step(
    runtime: ModelRuntime, parts: Parts
) -> None:
    parts.store.set_endpoints({"qwen3": ()})
    step = ShedSheddable(
        candidates=parts.candidates(), metrics=parts.metrics, saturation=SaturationConfig()
    )
    req, _ = prepared(runtime, priority=-1)
    await step.admit(req)  # no 429: the place step answers 503 "no ready endpoint"


# -- pre-request ---------------------------------------------------------------------------------


async def test_record_pick_puts_the_prompt_on_the_pick(runtime: ModelRuntime, parts: Parts) -> None:
    routed: list[str] = []
    step = RecordPick(metrics=parts.metrics, clock=lambda: 100.0, on_routed=routed.append)
    pods = (pod(PODS[0]), pod(PODS[1], prefix=8), pod(PODS[2]))
    req, place = prepared(runtime, pods=pods, block_hashes=(11, 12, 13))
    await step.pre_request(req, place, decision(PODS[1]), Outgoing())
    assert [runtime.prefix.cached_blocks(a) for a in PODS] == [0, 3, 0]
    assert routed == [PODS[1]]
    # The pick's match is observed, not another pod's.
    assert parts.sample("extproc_prefix_match_tokens_sum", model="qwen3") == 8
    assert parts.sample("extproc_prefix_match_tokens_count", model="qwen3") == 1


@pytest.mark.parametrize(
    ("blocks", "cached_blocks", "expects_events"),
    [
        pytest.param((), 0, False, id="prompt-shorter-than-a-block"),
        pytest.param((11, 12, 13), 3, False, id="every-block-already-cached"),
        pytest.param((11, 12, 13), 2, True, id="one-new-block"),
        pytest.param((11,), 0, True, id="uncached-block"),
    ],
)
async def test_record_pick_reports_only_traffic_that_should_publish_events(
    runtime: ModelRuntime,
    parts: Parts,
    blocks: tuple[int, ...],
    cached_blocks: int,
    expects_events: bool,
) -> None:
    """KV-event health counts only requests the engine answers with BlockStored (issue 27:
    short prompts made every pod's stream look stalled)."""
    routed: list[str] = []
    step = RecordPick(metrics=parts.metrics, clock=lambda: 100.0, on_routed=routed.append)
    cached = pod(PODS[0], prefix=cached_blocks * runtime.block_size)
    req, place = prepared(runtime, pods=(cached,), block_hashes=blocks)
    await step.pre_request(req, place, decision(PODS[0]), Outgoing())
    assert routed == ([PODS[0]] if expects_events else [])


REWRITES = [
    # (body fields, route settings, config inject, served model, wanted changes or None)
    pytest.param({"stream": True}, RouteSettings(), True, None,
                 {"stream_options": {"include_usage": True}}, id="stream-asks-for-usage"),
    pytest.param({"stream": False}, RouteSettings(), True, None, None, id="not-a-stream"),
    pytest.param({"stream": True, "stream_options": {"include_usage": True}}, RouteSettings(),
                 True, None, None, id="client-asked-already"),
    pytest.param({"stream": True}, RouteSettings(), False, None, None, id="config-inject-off"),
    pytest.param({"stream": True}, RouteSettings(inject_include_usage=True), False, None,
                 {"stream_options": {"include_usage": True}}, id="route-overrides-config"),
    pytest.param({"stream": True}, RouteSettings(accounting=False), True, None, None,
                 id="route-accounting-off"),
    pytest.param({}, RouteSettings(), True, "qwen3-served", {"model": "qwen3-served"},
                 id="model-mapped"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "settings", "inject", "served", "changes"), REWRITES)
async def test_rewrite_body(
    runtime: ModelRuntime,
    fields: dict[str, Any],
    settings: RouteSettings,
    inject: bool,
    served: str | None,
    changes: dict[str, Any] | None,
) -> None:
    body = {"model": "qwen3", "messages": MSGS, **fields}
    req, place = prepared(runtime, body=body, settings=settings, served_model=served)
    out = Outgoing()
    await RewriteBody(inject_include_usage=inject).pre_request(req, place, decision(), out)
    new = out.body(req.parsed.body)
    if changes is None:
        assert new is None
    else:
        assert new is not None and orjson.loads(new) == {**body, **changes}


async def test_an_unparsed_body_is_never_rewritten(runtime: ModelRuntime) -> None:
    # Paths the gateway does not parse keep their body byte for byte, even with a model map.
    body = {"model": "qwen3", "input": "speak", "voice": "x"}
    req, place = prepared(runtime, body=body, path="/v1/audio/speech", served_model="qwen3-served")
    out = Outgoing()
    await RewriteBody(inject_include_usage=True).pre_request(req, place, decision(), out)
    assert out.body(req.parsed.body) is None


def prefill_client(handler: Any) -> PrefillClient:
    return PrefillClient(httpx.AsyncClient(transport=httpx.MockTransport(handler)))


PREFILL_POD = Endpoint(address="10.0.9.1:8000", model="qwen3")


async def test_remote_prefill_hands_the_kv_handle_to_the_decode_pod(
    runtime: ModelRuntime, parts: Parts
) -> None:
    seen: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append({"url": str(request.url), **orjson.loads(request.content)})
        return httpx.Response(200, json={"kv_transfer_params": {"remote_block_ids": [1, 2]}})

    step = RemotePrefill(client=prefill_client(answer), metrics=parts.metrics)
    req, place = prepared(runtime, body={"model": "qwen3", "messages": MSGS, "stream": True})
    out = Outgoing()
    await step.pre_request(req, place, decision(strategy="pd", prefill=PREFILL_POD), out)
    assert out.kv_transfer_params == {"remote_block_ids": [1, 2]}
    assert seen[0]["url"] == f"http://{PREFILL_POD.address}/v1/chat/completions"
    assert seen[0]["max_tokens"] == 1 and seen[0]["stream"] is False
    new = out.body(req.parsed.body)
    assert new is not None and orjson.loads(new)["kv_transfer_params"] == {
        "remote_block_ids": [1, 2]
    }
    assert parts.sample("extproc_pd_fallbacks_total", model="qwen3") == 0


@pytest.mark.parametrize(
    ("status", "has_client", "prefill_pod"),
    [
        pytest.param(500, True, True, id="prefill-fails"),
        pytest.param(200, False, True, id="no-prefill-client"),
        pytest.param(200, True, False, id="no-ready-prefill-pod"),
    ],
)
async def test_remote_prefill_falls_back_to_decode_only(
    runtime: ModelRuntime, parts: Parts, status: int, has_client: bool, prefill_pod: bool
) -> None:
    client = prefill_client(lambda _r: httpx.Response(status, json={})) if has_client else None
    step = RemotePrefill(client=client, metrics=parts.metrics)
    out = Outgoing()
    dec = decision(strategy="pd", prefill=PREFILL_POD if prefill_pod else None)
    await step.pre_request(*prepared(runtime), dec, out)
    assert out.kv_transfer_params is None
    assert parts.sample("extproc_pd_fallbacks_total", model="qwen3") == 1


async def test_remote_prefill_does_nothing_for_other_strategies(
    runtime: ModelRuntime, parts: Parts
) -> None:
    out = Outgoing()
    await RemotePrefill(client=None, metrics=parts.metrics).pre_request(
        *prepared(runtime), decision(), out
    )
    assert out == Outgoing()
    assert parts.sample("extproc_pd_fallbacks_total", model="qwen3") == 0


@pytest.mark.parametrize(
    ("client_session", "rule_session", "want"),
    [
        pytest.param(PODS[2], None, PODS[1], id="client-session-gets-the-pick"),
        pytest.param(None, PODS[1], PODS[1], id="rule-names-the-session"),
        pytest.param(None, None, None, id="no-session-no-header"),
    ],
)
async def test_session_affinity(
    runtime: ModelRuntime, client_session: str | None, rule_session: str | None, want: str | None
) -> None:
    out = Outgoing()
    tokens = SessionTokens(b"test secret")
    req, place = prepared(runtime, session_id=client_session)
    await SessionAffinity(header="x-session-id", tokens=tokens).pre_request(
        req, place, decision(PODS[1], session_id=rule_session), out
    )
    if want is None:
        assert out.set_headers == {}
    else:
        sid = out.set_headers["x-session-id"]
        assert sid == tokens.token(runtime.name, want)  # the pick's opaque token
        assert want not in sid and tokens.resolve(runtime.name, sid, PODS) == want


@pytest.mark.parametrize(
    ("allowed", "asked", "present"),
    [(True, "true", True), (True, "TRUE", True), (False, "true", False), (True, None, False)],
)
async def test_explain_header(
    runtime: ModelRuntime, allowed: bool, asked: str | None, present: bool
) -> None:
    headers = {EXPLAIN_HEADER: asked} if asked is not None else {}
    out = Outgoing()
    await ExplainHeader(allowed=allowed).pre_request(
        *prepared(runtime, headers=headers), decision(PODS[2]), out
    )
    assert (EXPLAIN_HEADER in out.set_headers) is present
    if present:
        assert out.set_headers[EXPLAIN_HEADER].startswith(f"pick={PODS[2]}; strategy=round-robin")


async def test_tag_for_accounting(runtime: ModelRuntime) -> None:
    step = TagForAccounting(replica="host:1")
    out = Outgoing()
    body = {"model": "qwen3", "messages": MSGS, "stream": True}
    req, place = prepared(runtime, body=body, user="ann", prompt_tokens=42, route_name="rt")
    await step.pre_request(req, place, decision(PODS[1], strategy="least-request"), out)
    assert out.routed is not None
    assert out.routed.metadata() == {
        "model": "qwen3", "endpoint": PODS[1], "strategy": "least-request", "prompt_tokens": 42,
        "estimated": False, "stream": True, "route": "rt", "user": "ann", "replica": "host:1",
    }  # fmt: skip
    off = Outgoing()
    await step.pre_request(
        *prepared(runtime, settings=RouteSettings(accounting=False)), decision(), off
    )
    assert off.routed is None  # no record will be accounted: nothing to carry


# -- claim ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_tokens", "want_tokens"), [(32, 10 + 32), (None, 10 + DEFAULT_OUTPUT_ESTIMATE)]
)
def test_claim_holds_a_lease_and_the_users_count_until_the_ticket_closes(
    runtime: ModelRuntime, parts: Parts, max_tokens: int | None, want_tokens: int
) -> None:
    step = ClaimEndpoint(leases=parts.leases)
    body: dict[str, Any] = {"model": "qwen3", "messages": MSGS}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    ticket = step.claim(
        *prepared(runtime, body=body, user="ann", prompt_tokens=10), decision(PODS[2])
    )
    load = parts.inflight.load(PODS[2])
    assert (load.requests, load.tokens) == (1, want_tokens)
    assert parts.fairness.is_active("ann")
    ticket.close()
    ticket.close()
    assert parts.inflight.load(PODS[2]).requests == 0
    assert not parts.fairness.is_active("ann")
    assert parts.sample("extproc_routed_requests_total", model="qwen3") == 1


@pytest.mark.parametrize(
    ("cached", "want_tokens"),
    [
        pytest.param(0, 100 + 32, id="nothing-cached"),
        pytest.param(64, 36 + 32, id="prefix-cached"),
        pytest.param(100, 0 + 32, id="whole-prompt-cached"),
        pytest.param(150, 0 + 32, id="match-longer-than-prompt"),
    ],
)
def test_claim_counts_only_the_prompt_tokens_the_pick_does_not_hold(
    runtime: ModelRuntime, parts: Parts, cached: int, want_tokens: int
) -> None:
    step = ClaimEndpoint(leases=parts.leases)
    pods = (pod(PODS[0], prefix=100), pod(PODS[1], prefix=cached))
    body = {"model": "qwen3", "messages": MSGS, "max_tokens": 32}
    step.claim(*prepared(runtime, body=body, pods=pods, prompt_tokens=100), decision(PODS[1]))
    assert parts.inflight.load(PODS[1]).tokens == want_tokens


def test_claim_is_synchronous() -> None:
    # Nothing may run between the claim and the ticket reaching the stream.
    assert not asyncio.iscoroutinefunction(ClaimEndpoint.claim)


def test_the_pick_is_found_once_for_every_pre_request_step(runtime: ModelRuntime) -> None:
    """Three steps read the picked pod's row (prefix-match metric, lease, latency tag): the
    request finds it once, and finds another address anew."""
    pods = tuple(pod(a, prefix=8 * i) for i, a in enumerate(PODS))
    _req, place = prepared(runtime, pods=pods)
    first = place.pod(PODS[1])
    assert first is pods[1] and place.pod(PODS[1]) is first
    assert place.pod(PODS[2]) is pods[2]
    assert place.pod("10.9.9.9:1") is None
