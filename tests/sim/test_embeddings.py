"""`POST /v1/embeddings` as vLLM's pooling runner answers it: the response shape and usage, every
input form, base64 and matryoshka `dimensions`, vLLM's 400s, and the engine's accounting (a
prefill of each prompt through the prefix cache, no decode)."""

from __future__ import annotations

import base64
import struct
import sys
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.sim.cli import build_parser, config_from_args
from extproc.tokenization import HFTokenizer
from tests.sim.conftest import MakeSim

MODEL = "Qwen/Qwen3-8B"
TEXT = "A gateway spreads requests over engines and keeps each conversation where its cache is."


async def _embed(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(f"{url}/v1/embeddings", json=body) as resp:
        return resp.status, await resp.json()


def _norm(v: list[float]) -> float:
    return float(sum(x * x for x in v) ** 0.5)


async def _counters(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total") or (
                s.name == "vllm:request_success_total" and s.labels["finished_reason"] == "stop"
            ):
                out[s.name] = s.value
    return out


async def test_a_string_gets_one_unit_vector_and_vllms_usage(
    make_sim: MakeSim, http: aiohttp.ClientSession, qwen: HFTokenizer
) -> None:
    sim = await make_sim()
    status, body = await _embed(http, sim.url, {"model": MODEL, "input": TEXT})
    assert status == 200, body
    assert body["id"].startswith("embd-") and body["object"] == "list"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    [item] = body["data"]
    assert item["index"] == 0 and item["object"] == "embedding"
    assert len(item["embedding"]) == 4096  # the default --embedding-dim
    assert _norm(item["embedding"]) == pytest.approx(1.0, abs=1e-5)
    n = len(qwen.encode_text(TEXT))
    # vLLM's UsageInfo as it serializes it: completion_tokens 0, no prompt details.
    assert body["usage"] == {
        "prompt_tokens": n, "total_tokens": n, "completion_tokens": 0,
        "prompt_tokens_details": None,
    }  # fmt: skip


async def test_every_input_form_and_a_vector_per_prompt(
    make_sim: MakeSim, http: aiohttp.ClientSession, qwen: HFTokenizer
) -> None:
    sim = await make_sim(embedding_dim=64)
    texts = [TEXT, "Another sentence entirely."]
    ids = [qwen.encode_text(t) for t in texts]
    _, by_text = await _embed(http, sim.url, {"model": MODEL, "input": texts})
    _, by_ids = await _embed(http, sim.url, {"model": MODEL, "input": ids})
    _, one_ids = await _embed(http, sim.url, {"model": MODEL, "input": ids[1]})
    assert [d["index"] for d in by_text["data"]] == [0, 1]
    assert by_text["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])
    assert by_ids["usage"] == by_text["usage"]
    # The vector is a function of the tokens: the text and its ids embed alike, others do not.
    vectors = [d["embedding"] for d in by_text["data"]]
    assert [d["embedding"] for d in by_ids["data"]] == vectors
    assert one_ids["data"][0]["embedding"] == vectors[1]
    assert vectors[0] != vectors[1]


async def test_base64_is_the_float32_bytes_of_the_same_vector(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    sim = await make_sim(embedding_dim=32)
    _, floats = await _embed(http, sim.url, {"input": TEXT})
    _, native = await _embed(http, sim.url, {"input": TEXT, "encoding_format": "base64"})
    _, big = await _embed(
        http, sim.url, {"input": TEXT, "encoding_format": "base64", "endianness": "big"}
    )
    want = floats["data"][0]["embedding"]
    order = "<" if sys.byteorder == "little" else ">"
    assert (
        list(struct.unpack(f"{order}32f", base64.b64decode(native["data"][0]["embedding"]))) == want
    )
    assert list(struct.unpack(">32f", base64.b64decode(big["data"][0]["embedding"]))) == want
    assert native["usage"] == floats["usage"]


async def test_dimensions_cut_the_vector_then_normalize_it(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    sim = await make_sim(embedding_dim=128)
    _, raw = await _embed(http, sim.url, {"input": TEXT, "normalize": False})
    _, cut = await _embed(http, sim.url, {"input": TEXT, "dimensions": 16})
    _, more = await _embed(http, sim.url, {"input": TEXT, "dimensions": 1000})
    full = raw["data"][0]["embedding"]
    assert len(full) == 128 and _norm(full) > 2  # Gaussian values, left as they are
    head = cut["data"][0]["embedding"]
    assert len(head) == 16 and _norm(head) == pytest.approx(1.0, abs=1e-5)
    scale = _norm(full[:16])
    assert head == pytest.approx([x / scale for x in full[:16]], rel=1e-5)
    assert len(more["data"][0]["embedding"]) == 128  # vLLM slices: more than there are is all


async def test_the_official_openai_client_decodes_it(make_sim: MakeSim, qwen: HFTokenizer) -> None:
    import openai

    sim = await make_sim(embedding_dim=256)
    client = openai.AsyncOpenAI(base_url=f"{sim.url}/v1", api_key="unused", max_retries=0)
    try:  # the SDK asks for base64 and decodes float32 itself
        got = await client.embeddings.create(model=MODEL, input=["one", "two"])
    finally:
        await client.close()
    assert [len(d.embedding) for d in got.data] == [256, 256]
    assert got.usage.prompt_tokens == len(qwen.encode_text("one")) + len(qwen.encode_text("two"))
    assert got.usage.total_tokens == got.usage.prompt_tokens


async def test_the_engine_prefills_each_prompt_and_decodes_nothing(
    make_sim: MakeSim, http: aiohttp.ClientSession, qwen: HFTokenizer
) -> None:
    sim = await make_sim(embedding_dim=8)
    doc = TEXT * 8  # several full blocks, so the second time hits the prefix cache
    n = len(qwen.encode_text(doc))
    before = await _counters(http, sim.url)
    for _ in range(2):
        status, body = await _embed(http, sim.url, {"input": [doc, doc]})
        assert status == 200 and body["usage"]["prompt_tokens"] == 2 * n
    after = await _counters(http, sim.url)
    assert after["vllm:prompt_tokens_total"] - before.get("vllm:prompt_tokens_total", 0) == 4 * n
    assert after["vllm:generation_tokens_total"] == before.get("vllm:generation_tokens_total", 0)
    assert after["vllm:request_success_total"] - before.get("vllm:request_success_total", 0) == 4
    async with http.get(f"{sim.url}/debug/stats") as resp:
        stats = await resp.json()
    assert stats["generation_tokens"] == 0 and stats["running"] == stats["waiting"] == 0
    records = stats["recent"]
    assert [r["request_id"].rsplit("-", 1)[1] for r in records] == ["0", "1", "0", "1"]
    assert {r["finish_reason"] for r in records} == {"stop"}
    assert all(r["output_tokens"] == 0 and r["prompt_tokens"] == n for r in records)
    assert records[0]["cached_tokens"] == 0 and records[-1]["cached_tokens"] >= n - 16
    assert records[-1]["prefill_computed_tokens"] == n - records[-1]["cached_tokens"]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"model": MODEL}, "input", "input is required"),
        ({"input": ""}, "input", "The decoder prompt cannot be empty"),
        ({"input": []}, "input", "please provide at least one prompt"),
        ({"input": [[]]}, "input", "please provide at least one prompt"),
        ({"input": 5}, "input", "input must be"),
        ({"input": [1, "a"]}, "input", "input must be"),
        ({"input": [[1], ["a"]]}, "input", "input must be"),
        ({"input": [True]}, "input", "input must be"),
        ({"input": [10**9]}, "input", "Token id 1000000000 is out of vocabulary"),
        ({"input": [1] * 40_000}, "input", "maximum context length is 32768 tokens"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format", "must be one of"),
        ({"input": "x", "encoding_format": "bytes"}, "encoding_format", "not served"),
        ({"input": "x", "dimensions": 0}, "dimensions", "Dimensions must be greater than 0"),
        ({"input": "x", "dimensions": "8"}, "dimensions", "must be an integer"),
        ({"input": "x", "normalize": "yes"}, "normalize", "must be a boolean"),
        ({"input": "x", "endianness": "middle"}, "endianness", "must be one of"),
        ({"input": "x", "truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens",
         "greater than max_model_len"),
        ({"input": "x", "model": "nope"}, "model", "does not exist"),
    ],
)  # fmt: skip
async def test_bad_input_is_a_vllm_style_error(
    make_sim: MakeSim, http: aiohttp.ClientSession, body: Any, param: str, words: str
) -> None:
    sim = await make_sim(embedding_dim=8)
    status, err = await _embed(http, sim.url, body)
    want = 404 if param == "model" else 400
    assert status == want, err
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["code"] == want and err["error"]["param"] == param
    assert words in err["error"]["message"]


async def test_truncation_keeps_the_last_tokens(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    sim = await make_sim(embedding_dim=8)
    _, cut = await _embed(http, sim.url, {"input": [5, 6, 7, 8], "truncate_prompt_tokens": 2})
    _, tail = await _embed(http, sim.url, {"input": [7, 8]})
    assert cut["usage"]["prompt_tokens"] == 2
    assert cut["data"] == tail["data"]


async def test_no_embeddings_when_the_dimension_is_zero(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    sim = await make_sim(embedding_dim=0)  # a generative vLLM model: the route does not exist
    status, err = await _embed(http, sim.url, {"model": MODEL, "input": TEXT})
    assert status == 404 and err["error"]["message"] == "Not Found: POST /v1/embeddings"


def test_the_dimension_is_a_flag() -> None:
    parser = build_parser()
    assert config_from_args(parser.parse_args([])).embedding_dim == 4096
    assert config_from_args(parser.parse_args(["--embedding-dim", "1024"])).embedding_dim == 1024
    with pytest.raises(SystemExit):
        config_from_args(parser.parse_args(["--embedding-dim", "-1"]))
