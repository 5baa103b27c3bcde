"""The simulator's Responses API and Anthropic Messages, through the real `openai` and
`anthropic` SDKs, with usage checked against the Qwen3 chat template rendering."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest

from extproc.protocol.agents import anthropic_chat, responses_chat
from extproc.tokenization import HFTokenizer
from tests.sim.conftest import MakeSim

# The official SDKs are imported inside the tests that use them: importing them at the top cost
# every pytest worker seconds of CPU while collecting (anthropic 4 s, openai 1.8 s).
if TYPE_CHECKING:
    import anthropic
    import openai

MODEL = "Qwen/Qwen3-8B"
LONG = "Explain, step by step and with care, how a gateway spreads requests over engines. " * 6


class _Clients:
    """The SDK clients a test opens, closed when it ends: an unclosed one is closed by its
    finalizer on whichever test's loop runs then, which logs an error in that test."""

    def __init__(self) -> None:
        self.opened: list[openai.AsyncOpenAI | anthropic.AsyncAnthropic] = []

    def openai(self, url: str) -> openai.AsyncOpenAI:
        import openai

        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0)
        self.opened.append(client)
        return client

    def anthropic(self, url: str) -> anthropic.AsyncAnthropic:
        import anthropic

        client = anthropic.AsyncAnthropic(base_url=url, api_key="sk-test", max_retries=0)
        self.opened.append(client)
        return client


@pytest.fixture
async def sdk() -> AsyncIterator[_Clients]:
    clients = _Clients()
    yield clients
    for client in clients.opened:
        await client.close()


async def test_responses_create_non_stream_counts_the_rendered_prompt(
    make_sim: MakeSim, sdk: _Clients, qwen: HFTokenizer
) -> None:
    sim = await make_sim()
    req = {"instructions": "Be brief.", "input": "Name one load balancer."}
    resp = await sdk.openai(sim.url).responses.create(
        model=MODEL, max_output_tokens=6, extra_body={"ignore_eos": True}, **req
    )
    messages, tools = responses_chat(req)
    assert resp.id.startswith("resp_") and resp.status == "incomplete"
    assert resp.usage is not None
    assert resp.usage.input_tokens == len(qwen.encode_chat(messages, tools=tools))
    assert resp.usage.output_tokens == 6
    assert resp.usage.input_tokens_details.cached_tokens == 0
    assert resp.output_text and len(qwen.encode_text(resp.output_text)) == 6


async def test_responses_stream_ends_with_completed_usage(make_sim: MakeSim, sdk: _Clients) -> None:
    sim = await make_sim()
    client = sdk.openai(sim.url)
    stream = await client.responses.create(
        model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": LONG}]}],
        max_output_tokens=5, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    kinds, text, final = [], "", None
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type == "response.completed":
            final = event.response
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert kinds.count("response.output_text.delta") == 5
    assert kinds[-1] == "response.completed"
    assert final is not None and final.usage is not None and final.usage.output_tokens == 5
    assert final.output_text == text
    # Stored: retrievable by id from this engine, and continued by previous_response_id.
    got = await client.responses.retrieve(final.id)
    assert got.id == final.id and got.output_text == text
    nxt = await client.responses.create(
        model=MODEL, input="And then?", previous_response_id=final.id, max_output_tokens=3
    )
    assert nxt.usage is not None and nxt.usage.input_tokens > final.usage.input_tokens
    # The second turn's prompt starts with the first one's: the engine's cache holds it.
    assert nxt.usage.input_tokens_details.cached_tokens > 0


async def test_unknown_and_uncancellable_responses(make_sim: MakeSim, sdk: _Clients) -> None:
    import openai

    sim = await make_sim()
    client = sdk.openai(sim.url)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("resp_nope")
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    done = await client.responses.create(model=MODEL, input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="synchronous"):
        await client.responses.cancel(done.id)


async def test_messages_create_non_stream_and_stream(
    make_sim: MakeSim, sdk: _Clients, qwen: HFTokenizer
) -> None:
    sim = await make_sim()
    client = sdk.anthropic(sim.url)
    req = {
        "system": [{"type": "text", "text": "You are terse."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": LONG}]}],
    }
    messages, tools = anthropic_chat(req)
    prompt = len(qwen.encode_chat(messages, tools=tools))
    msg = await client.messages.create(
        model=MODEL, max_tokens=4, extra_body={"ignore_eos": True}, **req
    )
    assert msg.type == "message" and msg.stop_reason == "max_tokens"
    assert msg.usage.output_tokens == 4
    # Anthropic's meaning: input_tokens leaves out what was read from the cache.
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == prompt
    text, kinds = "", []
    async with client.messages.stream(
        model=MODEL, max_tokens=4, extra_body={"ignore_eos": True}, **req
    ) as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == "text":
                text += event.text
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and "message_stop" in kinds
    assert final.usage.output_tokens == 4 and text == final.content[0].text
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == prompt
    assert (final.usage.cache_read_input_tokens or 0) > 0  # same prompt again: a prefix hit


async def test_messages_errors_are_anthropic_shaped(make_sim: MakeSim, sdk: _Clients) -> None:
    import anthropic

    sim = await make_sim()
    client = sdk.anthropic(sim.url)
    with pytest.raises(anthropic.NotFoundError) as err:
        await client.messages.create(
            model="nope", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    assert err.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": err.value.body["error"]["message"]},
    }
