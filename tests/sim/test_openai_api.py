"""The simulator's OpenAI surface, checked against vLLM's shapes with the real Qwen3 tokenizer."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.sim import StepTimeModel
from extproc.tokenization import HFTokenizer
from tests.sim.conftest import MakeSim, sse_events

# The official SDKs are imported inside the tests that use them: importing them at the top cost
# every pytest worker seconds of CPU while collecting (anthropic 4 s, openai 1.8 s).

MODEL = "Qwen/Qwen3-8B"
MESSAGES = [{"role": "user", "content": "Write a haiku about load balancers."}]


async def _post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def test_chat_non_stream_shape_and_exact_usage(
    make_sim: MakeSim, http: aiohttp.ClientSession, qwen: HFTokenizer
) -> None:
    sim = await make_sim()
    status, body = await _post(
        http,
        f"{sim.url}/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 7, "ignore_eos": True},
    )
    assert status == 200
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "length"
    prompt = len(qwen.encode_chat(MESSAGES))
    usage = body["usage"]
    assert usage["prompt_tokens"] == prompt
    assert usage["completion_tokens"] == 7
    assert usage["total_tokens"] == prompt + 7
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    # The text is the decode of the generated ids, so the tokenizer counts it back exactly.
    assert len(qwen.encode_text(choice["message"]["content"])) == 7


async def test_chat_stream_chunks_match_vllm(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    sim = await make_sim()
    req = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "ignore_eos": True}
    _, whole = await _post(http, f"{sim.url}/v1/chat/completions", req)
    stream_req = {**req, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(f"{sim.url}/v1/chat/completions", json=stream_req) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(await resp.read())
    assert events[-1] == "[DONE]"
    first, *content, usage_chunk, _ = events
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(content) == 5
    assert [c["choices"][0]["finish_reason"] for c in content] == [None] * 4 + ["length"]
    assert all("usage" not in c for c in content)
    text = "".join(c["choices"][0]["delta"]["content"] for c in content)
    assert text == whole["choices"][0]["message"]["content"]  # deterministic per prompt
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 5
    assert usage_chunk["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
async def test_first_token_is_streamed_when_its_step_ends(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    """vLLM writes each token as its step ends: the first content chunk arrives while the
    second token's step (0.4 s here) is still running, not one step later."""
    sim = await make_sim(step=StepTimeModel(overhead_s=0.4, time_scale=1.0))
    req = {
        "model": MODEL, "messages": MESSAGES, "max_tokens": 3, "ignore_eos": True, "stream": True,
    }  # fmt: skip
    generated_at_first_chunk = None
    async with http.post(f"{sim.url}/v1/chat/completions", json=req) as resp:
        async for raw in resp.content:
            if not raw.startswith(b"data: {"):
                continue
            delta = json.loads(raw[6:])["choices"][0]["delta"]
            if delta.get("content") and generated_at_first_chunk is None:
                async with http.get(f"{sim.url}/debug/stats") as st:
                    generated_at_first_chunk = (await st.json())["generation_tokens"]
    assert generated_at_first_chunk == 1


async def test_completions_stream_and_non_stream(
    make_sim: MakeSim, http: aiohttp.ClientSession, qwen: HFTokenizer
) -> None:
    sim = await make_sim()
    prompt = "The quick brown fox jumps over the lazy dog"
    status, body = await _post(
        http, f"{sim.url}/v1/completions", {"model": MODEL, "prompt": prompt}
    )
    assert status == 200 and body["object"] == "text_completion"
    assert body["usage"]["prompt_tokens"] == len(qwen.encode_text(prompt))
    assert body["usage"]["completion_tokens"] <= 16  # vLLM's default max_tokens for completions
    req = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "ignore_eos": True, "stream": True}
    async with http.post(f"{sim.url}/v1/completions", json=req) as resp:
        events = sse_events(await resp.read())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]  # no usage chunk: include_usage was not asked for
    assert len(chunks) == 4
    assert all(c["object"] == "text_completion" and "text" in c["choices"][0] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("extra", "expect_len", "expect_reason"),
    [
        ({"max_tokens": 3}, 3, "length"),
        ({"max_tokens": 40, "ignore_eos": True}, 40, "length"),
        ({"max_tokens": 200, "min_tokens": 150}, None, None),
    ],
)
async def test_output_length_controls(
    make_sim: MakeSim,
    http: aiohttp.ClientSession,
    extra: dict[str, Any],
    expect_len: int | None,
    expect_reason: str | None,
) -> None:
    sim = await make_sim(output_len_mean=20)
    _, body = await _post(
        http, f"{sim.url}/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, **extra}
    )
    n = body["usage"]["completion_tokens"]
    if expect_len is not None:
        assert n == expect_len and body["choices"][0]["finish_reason"] == expect_reason
    else:
        assert 150 <= n <= 200  # min_tokens beats the natural length (mean 20)


async def test_natural_length_follows_mean(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    sim = await make_sim(output_len_mean=10)
    lengths = []
    for i in range(8):
        msgs = [{"role": "user", "content": f"question number {i}"}]
        _, body = await _post(
            http, f"{sim.url}/v1/chat/completions", {"model": MODEL, "messages": msgs}
        )
        assert body["choices"][0]["finish_reason"] == "stop"
        lengths.append(body["usage"]["completion_tokens"])
    assert all(5 <= n <= 15 for n in lengths)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "nope", "messages": MESSAGES}, 404, "model"),
        ({"model": MODEL, "messages": []}, 400, "messages"),
        (
            {"model": MODEL, "messages": MESSAGES, "stream_options": {"include_usage": True}},
            400,
            None,
        ),
        ({"model": MODEL, "messages": MESSAGES, "max_tokens": 10**6}, 400, "messages"),
    ],
)
async def test_errors_are_openai_shaped(
    make_sim: MakeSim, http: aiohttp.ClientSession, body: Any, status: int, param: str | None
) -> None:
    sim = await make_sim()
    got, err = await _post(http, f"{sim.url}/v1/chat/completions", body)
    assert got == status
    assert err["error"]["code"] == status and err["error"]["param"] == param
    assert isinstance(err["error"]["message"], str)


async def test_bad_json_and_injected_error(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    sim = await make_sim()
    async with http.post(f"{sim.url}/v1/completions", data=b"{nope") as resp:
        assert resp.status == 400
    async with http.post(
        f"{sim.url}/v1/completions",
        json={"model": MODEL, "prompt": "x"},
        headers={"X-Return-Error": "429"},
    ) as resp:
        assert resp.status == 429
        assert (await resp.json())["error"]["code"] == 429


async def test_models_lists_base_and_lora(make_sim: MakeSim, http: aiohttp.ClientSession) -> None:
    sim = await make_sim(lora_adapters=("sql-lora",))
    async with http.get(f"{sim.url}/v1/models") as resp:
        data = (await resp.json())["data"]
    assert [(m["id"], m["parent"]) for m in data] == [(MODEL, None), ("sql-lora", MODEL)]
    _, body = await _post(
        http, f"{sim.url}/v1/completions", {"model": "sql-lora", "prompt": "hi", "max_tokens": 2}
    )
    assert body["model"] == "sql-lora" and body["usage"]["completion_tokens"] == 2


async def test_tokenize_and_render_use_the_engine_tokenizer(
    make_sim: MakeSim, http: aiohttp.ClientSession, qwen: HFTokenizer
) -> None:
    sim = await make_sim()
    _, tok = await _post(http, f"{sim.url}/tokenize", {"model": MODEL, "messages": MESSAGES})
    assert tok["tokens"] == qwen.encode_chat(MESSAGES) and tok["count"] == len(tok["tokens"])
    _, tok = await _post(http, f"{sim.url}/tokenize", {"prompt": "hello world"})
    assert tok["tokens"] == qwen.encode_text("hello world")
    _, rend = await _post(
        http, f"{sim.url}/v1/chat/completions/render", {"model": MODEL, "messages": MESSAGES}
    )
    assert rend["token_ids"] == qwen.encode_chat(MESSAGES)
    _, rend = await _post(
        http, f"{sim.url}/v1/completions/render", {"model": MODEL, "prompt": "ab"}
    )
    assert rend["token_ids"] == qwen.encode_text("ab")


async def test_metrics_parse_with_vllm_names(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    sim = await make_sim(lora_adapters=("sql-lora",))
    await _post(
        http,
        f"{sim.url}/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "max_tokens": 3},
    )
    async with http.get(f"{sim.url}/metrics") as resp:
        text = await resp.text()
    samples = {s.name: s for fam in text_string_to_metric_families(text) for s in fam.samples}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:cache_config_info",
        "vllm:lora_requests_info",
    ):
        assert name in samples, name
    assert samples["vllm:generation_tokens_total"].value == 3
    assert samples["vllm:num_requests_running"].labels == {"model_name": MODEL, "engine": "0"}
    assert samples["vllm:cache_config_info"].labels["block_size"] == "16"
    assert samples["vllm:time_to_first_token_seconds_count"].value == 1
    assert samples["vllm:inter_token_latency_seconds_count"].value == 2


async def test_official_openai_client_streams(make_sim: MakeSim, qwen: HFTokenizer) -> None:
    import openai

    sim = await make_sim()
    client = openai.AsyncOpenAI(base_url=f"{sim.url}/v1", api_key="unused", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
            if chunk.usage is not None:
                usage = chunk.usage
    finally:
        await client.close()
    assert usage is not None and usage.completion_tokens == 4
    assert usage.prompt_tokens == len(qwen.encode_chat([{"role": "user", "content": "hi"}]))
    assert "".join(parts).strip()


async def test_every_answer_names_the_serving_pod(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    sim = await make_sim()
    pod = f"127.0.0.1:{sim.port}"
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    for stream in (False, True):
        async with http.post(
            f"{sim.url}/v1/chat/completions", json={**body, "stream": stream}
        ) as resp:
            assert resp.status == 200
            assert resp.headers["x-inference-pod"] == pod
            await resp.read()
    async with http.get(f"{sim.url}/metrics") as resp:
        assert resp.headers["x-inference-pod"] == pod


async def test_client_abandoning_a_stream_frees_the_request_without_an_error_log(
    make_sim: MakeSim, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    sim = await make_sim(step=StepTimeModel(time_scale=1.0))
    req = {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "ignore_eos": True}
    caplog.set_level(logging.DEBUG)
    async with http.post(f"{sim.url}/v1/chat/completions", json={**req, "stream": True}) as resp:
        assert resp.status == 200
        data_lines = 0
        while data_lines < 3:
            line = await resp.content.readline()
            assert line in (b"\n", b"\r\n") or line.startswith(b"data: "), line
            data_lines += line.startswith(b"data: ")
        resp.close()  # walk away mid-generation
    engine = sim._eng()
    for _ in range(200):
        if engine.num_running + engine.num_waiting == 0:
            break
        await asyncio.sleep(0.05)
    assert engine.num_running + engine.num_waiting == 0  # aborted, its blocks freed
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]
