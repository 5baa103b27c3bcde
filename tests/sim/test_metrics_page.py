"""The simulator's /metrics page against vLLM 0.33's families and buckets (engine.md §1.2),
its validity as Prometheus text, and its render-on-change cache."""

from __future__ import annotations

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.metrics import VLLM, extract, parse
from extproc.sim.metrics import (
    E2E_BUCKETS,
    ITERATION_TOKEN_BUCKETS,
    ITL_BUCKETS,
    TTFT_BUCKETS,
    build_1_2_5_buckets,
)
from tests.sim.conftest import MakeSim

MODEL = "Qwen/Qwen3-8B"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "count to five"}]}

# Histogram families of vLLM 0.33 and their bucket bounds (vllm/v1/metrics/buckets.py).
TOKENS_32K = build_1_2_5_buckets(32768)
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": TTFT_BUCKETS,
    "vllm:inter_token_latency_seconds": ITL_BUCKETS,
    "vllm:request_time_per_output_token_seconds": ITL_BUCKETS,
    "vllm:e2e_request_latency_seconds": E2E_BUCKETS,
    "vllm:request_queue_time_seconds": E2E_BUCKETS,
    "vllm:request_inference_time_seconds": E2E_BUCKETS,
    "vllm:request_prefill_time_seconds": E2E_BUCKETS,
    "vllm:request_decode_time_seconds": E2E_BUCKETS,
    "vllm:request_prompt_tokens": TOKENS_32K,
    "vllm:request_generation_tokens": TOKENS_32K,
    "vllm:request_max_num_generation_tokens": TOKENS_32K,
    "vllm:request_params_max_tokens": TOKENS_32K,
    "vllm:request_prefill_kv_computed_tokens": TOKENS_32K,
    "vllm:iteration_tokens_total": ITERATION_TOKEN_BUCKETS,
    "vllm:request_params_n": (1, 2, 5, 10, 20),
}
COUNTERS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:prompt_tokens_cached",
    "vllm:prompt_tokens_cached_by_source",
    "vllm:prompt_tokens_by_source",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:num_preemptions",
    "vllm:request_success",
)
GAUGES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_requests_waiting_by_reason",
    "vllm:kv_cache_usage_perc",
    "vllm:engine_sleep_state",
    "vllm:cache_config_info",
)


@pytest.mark.parametrize(
    ("limit", "expected"),
    [
        (1, (1,)),
        (4, (1, 2)),
        (10, (1, 2, 5, 10)),
        (1024, (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)),
        (32768, (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)),
    ],
)
def test_1_2_5_buckets_as_vllm_builds_them(limit: int, expected: tuple[int, ...]) -> None:
    assert build_1_2_5_buckets(limit) == expected


async def _page(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


async def test_page_has_vllm_033_families_types_and_buckets(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    sim = await make_sim()
    async with http.post(f"{sim.url}/v1/chat/completions", json={**CHAT, "max_tokens": 4}) as r:
        assert r.status == 200
    text = await _page(http, sim.url)
    families = {f.name: f for f in text_string_to_metric_families(text)}  # raises if malformed
    for name, bounds in HISTOGRAMS.items():
        fam = families[name]
        assert fam.type == "histogram", name
        les = [s.labels["le"] for s in fam.samples if s.name == f"{name}_bucket"]
        assert les == [*(str(float(b)) for b in bounds), "+Inf"], name
        count = next(s.value for s in fam.samples if s.name == f"{name}_count")
        assert count >= 1, name  # one finished request observed in each
        assert f"{name}_created" in families, name
    for name in COUNTERS:
        assert families[name].type == "counter", name
    for name in GAUGES:
        assert families[name].type == "gauge", name
    success = {
        s.labels["finished_reason"]: s.value for s in families["vllm:request_success"].samples
    }
    assert set(success) == {"stop", "length", "abort", "error", "repetition"}
    assert sum(success.values()) == 1
    assert families["vllm:generation_tokens"].samples[0].value == 4
    for fam in families.values():
        for s in fam.samples:
            if fam.name != "vllm:cache_config_info":
                assert s.labels.get("model_name", MODEL) == MODEL and s.labels["engine"] == "0"
    # The size of a real engine's page: about 500 lines, most of them buckets.
    assert 430 <= len(text.splitlines()) <= 600


async def test_router_reads_the_page_with_no_bad_line(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    sim = await make_sim()
    async with http.post(f"{sim.url}/v1/chat/completions", json={**CHAT, "max_tokens": 3}) as r:
        usage = (await r.json())["usage"]
    text = await _page(http, sim.url)
    every = parse(text)
    assert every.errors == 0 and every.lines > 300
    metrics = extract(parse(text, VLLM.wanted()).samples, VLLM, MODEL, now=1.0)
    assert metrics.generation_tokens_total == 3
    assert metrics.prompt_tokens_total == usage["prompt_tokens"]
    assert metrics.running == 0 and metrics.waiting == 0
    assert metrics.block_size == 16 and metrics.num_gpu_blocks == sim.config.num_gpu_blocks
    assert metrics.ttft_avg_s is not None and metrics.ttft_avg_s > 0


async def test_an_idle_engine_answers_its_last_page_and_a_request_renders_a_new_one(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    sim = await make_sim()
    assert sim.metrics is not None
    first = await _page(http, sim.url)
    rendered = sim.metrics.renders
    for _ in range(5):
        assert await _page(http, sim.url) == first
    assert sim.metrics.renders == rendered  # nothing moved: no render
    async with http.post(f"{sim.url}/v1/chat/completions", json={**CHAT, "max_tokens": 2}) as r:
        assert r.status == 200
    after = await _page(http, sim.url)
    assert sim.metrics.renders > rendered
    assert after != first
    assert 'vllm:generation_tokens_total{engine="0",model_name="Qwen/Qwen3-8B"} 2.0' in after
