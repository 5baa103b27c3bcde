"""End to end through real Envoy, the real ext_proc server and real simulated engines.

Every case runs on each gateway shape: the local bootstrap (with both request body modes, and
with request headers skipped: one ext_proc message each way) and
the bootstrap Envoy Gateway renders from deploy/overlays/envoy-gateway (extproc/stack/
envoy_gateway.py: its filter order and names, route names, defaults and the manifests' values).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from extproc.stack.envoy_config import ROUTE_NAME, EnvoyOptions, RequestBodyMode, ResponseAccounting
from extproc.stack.envoy_gateway import DEFAULT_OVERLAY, GatewayShape, translate_overlay
from extproc.stack.local import LocalStack
from tests.e2e.harness import (
    FAST_SIM,
    in_flight,
    metric_samples,
    metric_sum,
    running_stack,
    served_counts,
    stack_options,
    wait_for,
)

# The official SDKs are imported inside the tests that use them: importing them at the top cost
# every pytest worker seconds of CPU while collecting (anthropic 4 s, openai 1.8 s).
if TYPE_CHECKING:
    import openai

pytestmark = pytest.mark.e2e

CHAT = {
    "model": "qwen3",
    "messages": [{"role": "user", "content": "Tell me about load balancers."}],
    "max_tokens": 12,
}


# The HTTPRoute's lb.extproc.io annotations, as the server's settings for that route: the
# Envoy Gateway shape gives them to the server under `extproc/llm-route` (what the HTTPRoute
# watcher does on a cluster), the local stack under its own route name.
(ROUTE_SETTINGS,) = translate_overlay(DEFAULT_OVERLAY, EnvoyOptions()).server_routes.values()
MAX_BODY = 2 * 1024 * 1024  # the server's limit here: a 1 MiB prompt passes
# Room in the simulators for a 1 MiB prompt (about 131k Qwen3 tokens).
LONG_CONTEXT_SIM = ("--max-model-len", "262144", "--cache-blocks", "20000")

ONE_MESSAGE_OVERLAY = DEFAULT_OVERLAY.parent / "envoy-gateway-one-message"
LOCAL, EG, BUFFERED = GatewayShape.LOCAL, GatewayShape.ENVOY_GATEWAY, RequestBodyMode.BUFFERED
SHAPES = [
    pytest.param((LOCAL, BUFFERED, False, DEFAULT_OVERLAY), id="local-buffered"),
    pytest.param(
        (LOCAL, RequestBodyMode.FULL_DUPLEX_STREAMED, False, DEFAULT_OVERLAY), id="local-duplex"
    ),
    pytest.param((LOCAL, BUFFERED, True, DEFAULT_OVERLAY), id="local-one-message"),
    # The body mode is the EnvoyExtensionPolicy's (Buffered).
    pytest.param((EG, BUFFERED, False, DEFAULT_OVERLAY), id="envoy-gateway"),
    # The same with the EnvoyPatchPolicy that skips request headers.
    pytest.param((EG, BUFFERED, False, ONE_MESSAGE_OVERLAY), id="envoy-gateway-one-message"),
]


def is_one_message(stack: LocalStack) -> bool:
    return stack.options.one_message or stack.options.gateway_overlay == ONE_MESSAGE_OVERLAY


@pytest.fixture(scope="module", params=SHAPES)
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalStack]:
    shape, body_mode, one_message, overlay = request.param
    routes = {} if shape is GatewayShape.ENVOY_GATEWAY else {ROUTE_NAME: ROUTE_SETTINGS}
    opts = stack_options(
        tmp_path_factory.mktemp("stack"),
        gateway_shape=shape,
        body_mode=body_mode,
        one_message=one_message,
        gateway_overlay=overlay,
        server_config={"server": {"max_body_bytes": MAX_BODY}, "routes": routes},
        sim_args=(*FAST_SIM, *LONG_CONTEXT_SIM),
        extra_models=(
            {
                "name": "ghost",
                "endpoints": [
                    {"address": "127.0.0.1:1", "metrics_url": "http://127.0.0.1:1/metrics"}
                ],
            },
        ),
    )
    with running_stack(opts) as s:
        yield s


def client(stack: LocalStack) -> openai.OpenAI:
    import openai

    return openai.OpenAI(
        base_url=f"{stack.base_url}/v1", api_key="sk-test-not-logged", max_retries=0
    )


def server_metrics(stack: LocalStack) -> dict:
    return metric_samples(f"http://127.0.0.1:{stack.options.metrics_port}/metrics")


def settled_metrics(stack: LocalStack) -> dict:
    """The server's metrics once every earlier request's access record has arrived (a record
    ends its request's lease): Envoy Gateway's flush interval is 1 s, so a previous test's
    last records may otherwise land inside the next test's window."""
    assert wait_for(lambda: in_flight(stack) == 0, timeout=15)
    return server_metrics(stack)


def test_streaming_chat_with_official_client_returns_tokens_and_exact_usage(
    stack: LocalStack,
) -> None:
    before = settled_metrics(stack)
    stream = client(stack).chat.completions.create(
        model="qwen3",
        messages=[{"role": "user", "content": "Hello there, how are you today?"}],
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    assert text.strip()
    assert usage is not None and usage.completion_tokens == 9
    # The router's own tokenization of the same body equals the engine's prompt count.
    explain_url = f"http://127.0.0.1:{stack.options.metrics_port}/debug/explain"
    body = {
        "model": "qwen3",
        "messages": [{"role": "user", "content": "Hello there, how are you today?"}],
    }
    explained = httpx.post(
        explain_url,
        json=body,
        headers={"routing-strategy": "prefix-cache", **stack.options.admin_headers()},
    ).json()
    assert explained["prompt_tokens"] == usage.prompt_tokens
    assert explained["tokens_estimated"] is False
    # A rule that reads no tokens skips tokenizing and says the count is an estimate.
    skipped = httpx.post(
        explain_url,
        json=body,
        headers={"routing-strategy": "least-request", **stack.options.admin_headers()},
    ).json()
    assert skipped["tokens_estimated"] is True
    assert wait_for(
        lambda: (
            metric_sum(server_metrics(stack), "extproc_completion_tokens_total")
            - metric_sum(before, "extproc_completion_tokens_total")
            == 9
        )
    )
    after = server_metrics(stack)
    assert (
        metric_sum(after, "extproc_prompt_tokens_total")
        - metric_sum(before, "extproc_prompt_tokens_total")
        == usage.prompt_tokens
    )


def test_streaming_without_include_usage_is_still_accounted(stack: LocalStack) -> None:
    before = settled_metrics(stack)
    with httpx.stream(
        "POST", f"{stack.base_url}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30
    ) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    # We injected stream_options.include_usage: the client receives one extra usage chunk.
    usage_chunks = [json.loads(e) for e in events[:-1] if '"usage"' in e]
    assert usage_chunks and usage_chunks[-1]["choices"] == []
    reported = usage_chunks[-1]["usage"]["completion_tokens"]
    assert reported == 12
    assert wait_for(
        lambda: (
            metric_sum(server_metrics(stack), "extproc_completion_tokens_total")
            - metric_sum(before, "extproc_completion_tokens_total")
            == 12
        )
    )


@pytest.mark.parametrize("stream", [False, True])
def test_completions_endpoint(stack: LocalStack, stream: bool) -> None:
    body = {
        "model": "qwen3",
        "prompt": "The capital of France is",
        "max_tokens": 5,
        "stream": stream,
    }
    before = settled_metrics(stack)
    r = httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200
    if stream:
        usage = [
            json.loads(line[6:])
            for line in r.text.splitlines()
            if line.startswith("data: {") and '"usage"' in line
        ][-1]["usage"]
    else:
        usage = r.json()["usage"]
    assert usage["completion_tokens"] == 5
    assert wait_for(
        lambda: (
            metric_sum(server_metrics(stack), "extproc_prompt_tokens_total")
            - metric_sum(before, "extproc_prompt_tokens_total")
            == usage["prompt_tokens"]
        )
    )


def test_non_streaming_chat_usage_matches_gateway_accounting(stack: LocalStack) -> None:
    before = settled_metrics(stack)
    r = httpx.post(f"{stack.base_url}/v1/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == 200
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 12
    assert wait_for(
        lambda: (
            metric_sum(server_metrics(stack), "extproc_completion_tokens_total")
            - metric_sum(before, "extproc_completion_tokens_total")
            == 12
        )
    )


def test_models_and_health_work_without_a_body(stack: LocalStack) -> None:
    models = httpx.get(f"{stack.base_url}/v1/models", timeout=10)
    assert models.status_code == 200
    if is_one_message(stack):
        # No body, no ext_proc message: a pod answers with its own model (envoy/README.md).
        assert {m["id"] for m in models.json()["data"]} == {"qwen3"}
    else:
        assert {m["id"] for m in models.json()["data"]} == {"qwen3", "ghost"}
    health = httpx.get(f"{stack.base_url}/health", timeout=10)
    if stack.options.gateway_shape is GatewayShape.ENVOY_GATEWAY:
        # The HTTPRoute matches /v1 only: Envoy itself answers anything else (no route).
        assert health.status_code == 404
    else:
        assert health.status_code == 200


@pytest.mark.parametrize(
    ("body", "headers", "status", "param"),
    [
        (b"{not json", {}, 400, None),
        (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), {}, 400, "model"),
        (
            json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).encode(),
            {},
            404,
            "model",
        ),
        (json.dumps({**CHAT, "messages": "x" * (MAX_BODY + 256 * 1024)}).encode(), {}, 413, None),
        (
            json.dumps(CHAT).encode(),
            {"routing-strategy": "no-such-strategy"},
            400,
            "routing-strategy",
        ),
        (json.dumps({**CHAT, "model": "ghost"}).encode(), {}, 503, None),
    ],
)
def test_bad_input_gets_openai_errors(
    stack: LocalStack, body: bytes, headers: dict[str, str], status: int, param: str | None
) -> None:
    r = httpx.post(
        f"{stack.base_url}/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json", **headers},
        timeout=30,
    )
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param


def test_client_destination_header_is_ignored(stack: LocalStack) -> None:
    target = stack.options.sim_address(0)
    before = served_counts(stack)
    for _ in range(6):
        r = httpx.post(
            f"{stack.base_url}/v1/chat/completions",
            json=CHAT,
            headers={"x-gateway-destination-endpoint": target, "routing-strategy": "round-robin"},
            timeout=30,
        )
        assert r.status_code == 200
    after = served_counts(stack)
    # Round robin spreads the six requests: the client could not pin them on `target`.
    assert after[target] - before[target] < 6
    assert sum(after.values()) - sum(before.values()) == 6


def test_explain_header_names_the_serving_pod(stack: LocalStack) -> None:
    before = served_counts(stack)
    r = httpx.post(
        f"{stack.base_url}/v1/chat/completions",
        json=CHAT,
        headers={"x-routing-explain": "true", "routing-strategy": "least-request"},
        timeout=30,
    )
    assert r.status_code == 200
    explain = r.headers["x-routing-explain"]
    pick = explain.split(";")[0].removeprefix("pick=")
    after = served_counts(stack)
    assert after[pick] - before[pick] == 1


def test_cancelled_stream_leaves_no_in_flight_state(stack: LocalStack) -> None:
    body = {**CHAT, "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i > 5:
                break
    assert wait_for(lambda: in_flight(stack) == 0, timeout=15)


def test_every_strategy_is_selectable_by_header(stack: LocalStack) -> None:
    for name in [
        "random",
        "round-robin",
        "least-request",
        "least-kv-cache",
        "prefix-cache",
        "kv-aware",
        "least-busy-time",
        "least-latency",
        "throughput",
        "power-of-two",
        "prefix-cache-preble",
        "vtc-basic",
        "session-affinity",
        "gaie",
        "higress-gpu",
        "lora-affinity",
        "prefix-cache:3,least-request:1",
    ]:
        r = httpx.post(
            f"{stack.base_url}/v1/chat/completions",
            json={**CHAT, "max_tokens": 2},
            headers={"routing-strategy": name},
            timeout=30,
        )
        assert r.status_code == 200, (name, r.text)


def test_session_affinity_round_trip_and_forged_ids(stack: LocalStack) -> None:
    url = f"{stack.base_url}/v1/chat/completions"
    hdr = {"routing-strategy": "session-affinity"}
    first = httpx.post(url, json=CHAT, headers=hdr, timeout=30)
    sid = first.headers["x-session-id"]
    before = served_counts(stack)
    for _ in range(3):
        r = httpx.post(url, json=CHAT, headers={**hdr, "x-session-id": sid}, timeout=30)
        assert r.status_code == 200
        assert r.headers["x-session-id"] == sid
    after = served_counts(stack)
    assert sorted(after[a] - before[a] for a in after)[-1] == 3  # all three on one pod
    import base64

    forged = base64.b64encode(b"10.99.99.99:443").decode()
    r = httpx.post(url, json=CHAT, headers={**hdr, "x-session-id": forged}, timeout=30)
    assert r.status_code == 200
    assert r.headers["x-session-id"] != forged  # a pod outside the pool is never honoured
    # The id is opaque: no pod address in it, plain or base64.
    for addr in after:
        assert addr not in sid and base64.b64encode(addr.encode()).decode() not in sid
    # An id the client made up is a key: every turn lands on one pod.
    before = served_counts(stack)
    for _ in range(3):
        r = httpx.post(url, json=CHAT, headers={**hdr, "x-session-id": "abc"}, timeout=30)
        assert r.status_code == 200 and r.headers["x-session-id"].startswith("s1.")
    after = served_counts(stack)
    assert sorted(after[a] - before[a] for a in after)[-1] == 3


def test_killed_engine_is_excluded_and_traffic_keeps_flowing(tmp_path: Path) -> None:
    opts = stack_options(tmp_path, sims=3)
    with running_stack(opts) as stack:
        dead = opts.sim_address(2)
        stack.kill("sim-2")

        # Excluded within one poll interval (0.5 s): the next scrape is refused.
        def excluded() -> bool:
            eps = httpx.get(
                f"http://127.0.0.1:{opts.metrics_port}/debug/endpoints",
                headers=opts.admin_headers(),
                timeout=5,
            ).json()
            return not next(e for e in eps if e["address"] == dead)["ready"]

        assert wait_for(excluded, timeout=2.0)
        for _ in range(12):
            r = httpx.post(
                f"{stack.base_url}/v1/chat/completions",
                json=CHAT,
                headers={"routing-strategy": "round-robin"},
                timeout=30,
            )
            assert r.status_code == 200


def test_without_accounting_in_flight_still_returns_to_zero(tmp_path: Path) -> None:
    # The lease ends with the routing stream, not with a record: no accounting, no leak.
    opts = stack_options(tmp_path, sims=2, response_accounting=ResponseAccounting.NONE)
    with running_stack(opts) as stack:
        for stream in (True, False):
            r = httpx.post(
                f"{stack.base_url}/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=30
            )
            assert r.status_code == 200
        assert wait_for(lambda: in_flight(stack) == 0)
        metrics = server_metrics(stack)
        assert metric_sum(metrics, "extproc_routed_requests_total") == 2
        assert metric_sum(metrics, "extproc_completion_tokens_total") == 0


def test_a_1_mib_prompt_is_served_and_accounted(stack: LocalStack) -> None:
    # Envoy buffers the whole body for the routing filter: on Envoy Gateway's 32 KiB listener
    # default this would be Envoy's own 413 (the ClientTrafficPolicy lifts it).
    content = "x" * (1024 * 1024)
    body = {"model": "qwen3", "messages": [{"role": "user", "content": content}], "max_tokens": 1}
    before = settled_metrics(stack)
    r = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] > 100_000
    assert wait_for(
        lambda: (
            metric_sum(server_metrics(stack), "extproc_prompt_tokens_total")
            - metric_sum(before, "extproc_prompt_tokens_total")
            == usage["prompt_tokens"]
        ),
        timeout=15,
    )


def test_the_routes_settings_apply(stack: LocalStack) -> None:
    # ROUTE_SETTINGS come from the HTTPRoute's annotations; on the Envoy Gateway shape the
    # server finds them by the xDS route name Envoy Gateway gives the route
    # (httproute/extproc/llm-route/rule/0/match/0/*), which it resolves to extproc/llm-route.
    assert ROUTE_SETTINGS["strategy"] == "prefix-cache"  # what deploy/ says today
    r = httpx.post(
        f"{stack.base_url}/v1/chat/completions",
        json=CHAT,
        headers={"x-routing-explain": "true"},
        timeout=30,
    )
    assert r.status_code == 200
    assert f"strategy={ROUTE_SETTINGS['strategy']}" in r.headers["x-routing-explain"]
    # A request's own strategy header still wins over the route's.
    r = httpx.post(
        f"{stack.base_url}/v1/chat/completions",
        json=CHAT,
        headers={"x-routing-explain": "true", "routing-strategy": "round-robin"},
        timeout=30,
    )
    assert "strategy=round-robin" in r.headers["x-routing-explain"]
