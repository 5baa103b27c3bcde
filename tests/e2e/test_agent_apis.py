"""The Responses API and Anthropic Messages through real Envoy, the real ext_proc server and
simulated engines, with the real `openai` and `anthropic` SDKs: exact token accounting from
the Lua filter's reading of each API's usage, prefix hits across turns, Anthropic errors."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from extproc.stack.envoy_config import RequestBodyMode
from extproc.stack.local import LocalStack
from tests.e2e.harness import metric_samples, metric_sum, running_stack, stack_options, wait_for

# The official SDKs are imported inside the tests that use them: importing them at the top cost
# every pytest worker seconds of CPU while collecting (anthropic 4 s, openai 1.8 s).
if TYPE_CHECKING:
    import anthropic
    import openai

pytestmark = pytest.mark.e2e

MODEL = "qwen3"
DOC = "A gateway spreads requests over engines and keeps each conversation where its cache is. " * 8
COUNTERS = ("extproc_prompt_tokens_total", "extproc_completion_tokens_total",
            "extproc_cached_tokens_total")  # fmt: skip


@pytest.fixture(
    scope="module", params=[RequestBodyMode.BUFFERED, RequestBodyMode.FULL_DUPLEX_STREAMED]
)
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalStack]:
    opts = stack_options(
        tmp_path_factory.mktemp("stack"), sims=3, body_mode=request.param, strategy="prefix-cache"
    )
    with running_stack(opts) as s:
        yield s


def _openai(stack: LocalStack) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="sk-test", max_retries=0)


def _anthropic(stack: LocalStack) -> anthropic.Anthropic:
    import anthropic

    return anthropic.Anthropic(base_url=stack.base_url, api_key="sk-test", max_retries=0)


def _counters(stack: LocalStack) -> dict[str, float]:
    samples = metric_samples(f"http://127.0.0.1:{stack.options.metrics_port}/metrics")
    return {name: metric_sum(samples, name) for name in COUNTERS}


def _accounted(stack: LocalStack, before: dict[str, float], want: dict[str, float]) -> bool:
    """The gateway's counters moved by exactly `want` (waits for the access-log records)."""

    def moved() -> bool:
        now = _counters(stack)
        return all(now[k] - before[k] == v for k, v in want.items())

    return wait_for(moved, timeout=10)


def _want(prompt: int, completion: int, cached: int) -> dict[str, float]:
    return dict(zip(COUNTERS, (prompt, completion, cached), strict=True))


@pytest.mark.parametrize("stream", [False, True])
def test_responses_usage_is_accounted_exactly_and_turns_hit_the_prefix(
    stack: LocalStack, stream: bool
) -> None:
    client = _openai(stack)
    history: list[Any] = [{"role": "user", "content": f"{DOC} Turn one ({stream})."}]
    pods, usages = [], []
    for turn in range(3):
        before = _counters(stack)
        raw = client.responses.with_raw_response.create(
            model=MODEL, instructions="Answer briefly.", input=history, max_output_tokens=6,
            stream=stream,
        )  # fmt: skip
        pods.append(raw.headers["x-inference-pod"])
        parsed = raw.parse()
        if stream:
            final = None
            for event in parsed:
                if event.type == "response.completed":
                    final = event.response
            assert final is not None
            parsed = final
        usage = parsed.usage
        assert usage is not None and usage.output_tokens > 0
        usages.append(usage)
        want = _want(usage.input_tokens, usage.output_tokens,
                     usage.input_tokens_details.cached_tokens)  # fmt: skip
        assert _accounted(stack, before, want), (turn, want, _counters(stack))
        history = [*history, {"role": "assistant", "content": parsed.output_text},
                   {"role": "user", "content": f"Turn {turn + 2}."}]  # fmt: skip
    # Each turn starts with the last one's prompt: routed to its pod, which holds the prefix.
    assert len(set(pods)) == 1
    assert all(u.input_tokens_details.cached_tokens > 0 for u in usages[1:])


def test_the_gateway_tokenizes_a_response_as_the_engine_does(stack: LocalStack) -> None:
    body = {"model": MODEL, "instructions": "Be kind.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "What is a gateway?"}]}]}  # fmt: skip
    explained = httpx.post(
        f"http://127.0.0.1:{stack.options.metrics_port}/debug/explain?path=/v1/responses",
        json=body, headers={"routing-strategy": "prefix-cache", **stack.options.admin_headers()},
        timeout=10,
    ).json()  # fmt: skip
    before = _counters(stack)
    got = _openai(stack).responses.create(**body, max_output_tokens=2)
    assert got.usage is not None
    assert explained["prompt_tokens"] == got.usage.input_tokens
    assert explained["tokens_estimated"] is False
    # Its record is in before the next test reads the counters.
    u = got.usage
    assert _accounted(
        stack, before, _want(u.input_tokens, u.output_tokens, u.input_tokens_details.cached_tokens)
    )


@pytest.mark.parametrize("stream", [False, True])
def test_messages_usage_is_accounted_exactly_and_turns_hit_the_prefix(
    stack: LocalStack, stream: bool
) -> None:
    client = _anthropic(stack)
    messages: list[Any] = [
        {"role": "user", "content": [{"type": "text", "text": f"{DOC} {stream}"}]}
    ]
    pods, usages = [], []
    for turn in range(3):
        before = _counters(stack)
        kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 5, "system": "Be terse.",
                                  "messages": messages}  # fmt: skip
        if stream:
            with client.messages.stream(**kwargs) as s:
                text = "".join(s.text_stream)
                final = s.get_final_message()
                pods.append(s.response.headers["x-inference-pod"])
        else:
            raw = client.messages.with_raw_response.create(**kwargs)
            pods.append(raw.headers["x-inference-pod"])
            final = raw.parse()
            text = final.content[0].text  # type: ignore[union-attr]
        u = final.usage
        usages.append(u)
        cached = u.cache_read_input_tokens or 0
        want = _want(u.input_tokens + cached, u.output_tokens, cached)
        assert _accounted(stack, before, want), (turn, want, _counters(stack))
        messages = [*messages, {"role": "assistant", "content": text},
                    {"role": "user", "content": f"Turn {turn + 2}."}]  # fmt: skip
    assert len(set(pods)) == 1
    assert all((u.cache_read_input_tokens or 0) > 0 for u in usages[1:])


def test_messages_errors_have_anthropic_shape(stack: LocalStack) -> None:
    import anthropic
    import openai

    client = _anthropic(stack)
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(
            model="nope", max_tokens=3, messages=[{"role": "user", "content": "x"}]
        )
    assert err.value.body["type"] == "error"  # type: ignore[index]
    assert err.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=3, messages=[])
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    # The same fault on an OpenAI path keeps OpenAI's shape.
    with pytest.raises(openai.BadRequestError) as oa:
        _openai(stack).responses.create(model=MODEL, input=[])
    assert oa.value.body["type"] == "invalid_request_error"  # type: ignore[index]
