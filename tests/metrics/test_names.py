"""Extraction of EngineMetrics from vLLM and SGLang expositions, presets and overrides."""

from __future__ import annotations

import pytest

from extproc.metrics.names import SGLANG, VLLM, MetricNames, extract, preset
from extproc.metrics.parse import parse
from extproc.types import EngineMetrics
from tests.metrics.expositions import SGLANG as SGLANG_TEXT
from tests.metrics.expositions import VLLM_DP2, VLLM_OLD, VLLM_TWO_MODELS


def _extract(text: str, names: MetricNames, model: str | None = None) -> EngineMetrics:
    return extract(parse(text, names.wanted()).samples, names, model, 42.0)


def test_vllm_data_parallel_sums_counts_and_averages_kv_usage() -> None:
    m = _extract(VLLM_DP2, VLLM, "qwen3")
    assert m.updated_at == 42.0
    assert m.running == 5.0
    assert m.waiting == 5.0
    assert m.kv_cache_usage == pytest.approx((0.5 + 0.25) / 2)
    assert m.prefix_cache_hits == 700.0
    assert m.prefix_cache_queries == 1500.0
    assert m.prompt_tokens_total == 2000.0
    assert m.generation_tokens_total == 500.0
    # Histogram means pool both engines: (0.2 + 0.8) / (4 + 6).
    assert m.ttft_avg_s == pytest.approx(0.1)
    assert m.itl_avg_s == pytest.approx(2.0 / 100)
    assert m.itl_count == 100.0  # the store's recent mean reads the lifetime sum and count
    assert m.block_size == 16
    assert m.num_gpu_blocks == 27000


def test_vllm_lora_info_takes_the_newest_series() -> None:
    m = _extract(VLLM_DP2, VLLM, "qwen3")
    assert m.running_lora_adapters == ("sql-lora", "chat-lora")
    assert m.waiting_lora_adapters == ("sql-lora",)
    assert m.max_lora == 2


def test_vllm_old_names_are_aliases() -> None:
    m = _extract(VLLM_OLD, VLLM, "m")
    assert m.running == 2.0
    assert m.waiting == 0.0  # present and zero is not missing
    assert m.kv_cache_usage == 0.75
    assert m.itl_avg_s == pytest.approx(1.5 / 30)
    assert m.itl_count == 30.0
    assert m.ttft_avg_s is None
    assert m.prefix_cache_hits is None
    assert m.running_lora_adapters == ()
    assert m.block_size is None


@pytest.mark.parametrize(
    ("model", "running", "kv"),
    [("a", 1.0, 0.1), ("b", 7.0, 0.9), ("not-served-name", 8.0, 0.5), (None, 8.0, 0.5)],
)
def test_model_filter(model: str | None, running: float, kv: float) -> None:
    m = _extract(VLLM_TWO_MODELS, VLLM, model)
    assert m.running == running
    assert m.kv_cache_usage == pytest.approx(kv)


def test_sglang_preset() -> None:
    m = _extract(SGLANG_TEXT, SGLANG, "qwen3")
    assert m.running == 5.0
    assert m.waiting == 2.0
    assert m.kv_cache_usage == pytest.approx(0.42)
    assert m.prefix_cache_hits == 350.0  # summed over cache_source
    assert m.prefix_cache_queries == 1000.0  # summed over is_streaming
    assert m.generation_tokens_total == 90.0
    assert m.ttft_avg_s == pytest.approx(0.1)
    assert m.itl_avg_s is None and m.itl_count is None
    assert m.block_size == 1


def test_vllm_names_on_sglang_text_find_nothing() -> None:
    m = _extract(SGLANG_TEXT, VLLM, "qwen3")
    assert (m.running, m.waiting, m.kv_cache_usage, m.ttft_avg_s) == (None, None, None, None)


def test_zero_count_histogram_gives_no_average() -> None:
    text = "vllm:time_to_first_token_seconds_sum 0\nvllm:time_to_first_token_seconds_count 0\n"
    assert _extract(text, VLLM).ttft_avg_s is None


def test_non_finite_values_are_ignored() -> None:
    text = 'vllm:num_requests_running{engine="0"} NaN\nvllm:num_requests_running{engine="1"} 2\n'
    assert _extract(text, VLLM).running == 2.0


def test_override_replaces_one_field() -> None:
    names = preset("vllm", {"running": "custom:running", "kv_cache_usage": ["x:kv", "y:kv"]})
    assert names.running == ("custom:running",)
    assert names.kv_cache_usage == ("x:kv", "y:kv")
    assert names.waiting == VLLM.waiting
    m = _extract("custom:running 9\ny:kv 0.3\nvllm:num_requests_running 1\n", names)
    assert m.running == 9.0
    assert m.kv_cache_usage == pytest.approx(0.3)


def test_unknown_override_and_preset_are_named() -> None:
    with pytest.raises(ValueError, match="runing"):
        preset("vllm", {"runing": "x"})
    with pytest.raises(ValueError, match="tgi"):
        preset("tgi")


def test_wanted_covers_histogram_parts() -> None:
    wanted = VLLM.wanted()
    assert "vllm:time_to_first_token_seconds_sum" in wanted
    assert "vllm:time_to_first_token_seconds_count" in wanted
    assert "vllm:time_to_first_token_seconds_bucket" not in wanted
    assert "vllm:num_requests_running" in wanted
