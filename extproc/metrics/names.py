"""Engine metric names (vLLM and SGLang presets) and extraction into EngineMetrics.

Every field of `MetricNames` lists candidate names, first present wins, so renamed
metrics (vLLM's `gpu_cache_usage_perc` -> `kv_cache_usage_perc`) keep working across
engine versions. Presets are overridable per field from configuration.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from extproc.metrics.parse import Sample
from extproc.types import EngineMetrics

__all__ = [
    "PRESETS",
    "SGLANG",
    "VLLM",
    "MetricNames",
    "extract",
    "preset",
]


@dataclass(frozen=True, slots=True)
class MetricNames:
    """Where each EngineMetrics field comes from. Empty tuple = not exported."""

    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    kv_cache_usage: tuple[str, ...] = ()  # gauge, fraction 0..1
    prefix_cache_hits: tuple[str, ...] = ()  # counter, tokens
    prefix_cache_queries: tuple[str, ...] = ()  # counter, tokens
    prompt_tokens: tuple[str, ...] = ()  # counter
    generation_tokens: tuple[str, ...] = ()  # counter
    ttft_histogram: tuple[str, ...] = ()  # histogram base names (without _sum/_count)
    itl_histogram: tuple[str, ...] = ()
    lora_info: tuple[str, ...] = ()  # vLLM-style info gauge, value = unix time of update
    cache_config_info: tuple[str, ...] = ()  # info gauge with block_size/num_gpu_blocks labels
    block_size: tuple[str, ...] = ()  # plain gauges, for engines without cache_config_info
    num_gpu_blocks: tuple[str, ...] = ()
    model_label: str = "model_name"

    def wanted(self) -> frozenset[str]:
        """Every exposed sample name extraction reads (to pre-filter parsing)."""
        names: set[str] = set()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, tuple):
                continue
            if f.name.endswith("_histogram"):
                names.update(f"{n}_sum" for n in value)
                names.update(f"{n}_count" for n in value)
            else:
                names.update(value)
        return frozenset(names)

    def with_overrides(self, overrides: Mapping[str, str | Sequence[str]]) -> MetricNames:
        """Replace fields by name; an unknown field is a ValueError naming it."""
        known = {f.name for f in dataclasses.fields(self)}
        changes: dict[str, object] = {}
        for key, value in overrides.items():
            if key not in known:
                raise ValueError(f"unknown metric name field {key!r}; known: {sorted(known)}")
            if key == "model_label":
                if not isinstance(value, str):
                    raise ValueError("model_label must be a string")
                changes[key] = value
            else:
                changes[key] = (value,) if isinstance(value, str) else tuple(value)
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


VLLM = MetricNames(
    running=("vllm:num_requests_running",),
    waiting=("vllm:num_requests_waiting",),
    # gpu_cache_usage_perc: the pre-0.10 name of the same fraction.
    kv_cache_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    prefix_cache_hits=("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    prefix_cache_queries=("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    prompt_tokens=("vllm:prompt_tokens_total",),
    generation_tokens=("vllm:generation_tokens_total",),
    ttft_histogram=("vllm:time_to_first_token_seconds",),
    itl_histogram=("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    lora_info=("vllm:lora_requests_info",),
    cache_config_info=("vllm:cache_config_info",),
)

SGLANG = MetricNames(
    running=("sglang:num_running_reqs",),
    waiting=("sglang:num_queue_reqs",),
    kv_cache_usage=("sglang:token_usage",),
    # SGLang has no "queries" counter; every prompt token is looked up, so prompt tokens
    # are the denominator of its cumulative hit rate.
    prefix_cache_hits=("sglang:cached_tokens_total",),
    prefix_cache_queries=("sglang:prompt_tokens_total",),
    prompt_tokens=("sglang:prompt_tokens_total",),
    generation_tokens=("sglang:generation_tokens_total",),
    ttft_histogram=("sglang:time_to_first_token_seconds",),
    itl_histogram=("sglang:inter_token_latency_seconds",),
    block_size=("sglang:page_size",),
    num_gpu_blocks=("sglang:num_pages",),
)

PRESETS: Mapping[str, MetricNames] = {"vllm": VLLM, "sglang": SGLANG}


def preset(name: str, overrides: Mapping[str, str | Sequence[str]] | None = None) -> MetricNames:
    """A named preset (`vllm` or `sglang`) with optional per-field overrides."""
    try:
        base = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown metrics preset {name!r}; known: {sorted(PRESETS)}") from None
    return base.with_overrides(overrides) if overrides else base


def _select(
    by_name: Mapping[str, list[Sample]], names: Iterable[str], model: str | None, label: str
) -> list[Sample] | None:
    """Samples of the first candidate name present, narrowed to `model` when it matches.

    If no series carries the model's name (a served-model-name that differs from ours, or
    an engine without the label) every series is used: one model per server is the norm.
    """
    for name in names:
        found = by_name.get(name)
        if not found:
            continue
        if model is not None:
            mine = [s for s in found if s.labels.get(label) == model]
            if mine:
                return mine
        return found
    return None


def _finite(values: Iterable[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def _sum(samples: list[Sample] | None) -> float | None:
    if samples is None:
        return None
    values = _finite(s.value for s in samples)
    return sum(values) if values else None


def _mean(samples: list[Sample] | None) -> float | None:
    if samples is None:
        return None
    values = _finite(s.value for s in samples)
    return sum(values) / len(values) if values else None


def _histogram(
    by_name: Mapping[str, list[Sample]], bases: Sequence[str], model: str | None, label: str
) -> tuple[float | None, float | None]:
    """(mean, count) of the first histogram of `bases` the scrape has; the mean is None
    without observations."""
    for base in bases:
        total = _sum(_select(by_name, (f"{base}_sum",), model, label))
        count = _sum(_select(by_name, (f"{base}_count",), model, label))
        if total is None or count is None:
            continue
        return (total / count if count > 0 else None), count
    return None, None


def _int_label(samples: list[Sample] | None, key: str) -> int | None:
    for s in samples or ():
        text = s.labels.get(key)
        if text is None:
            continue
        try:
            return int(text)
        except ValueError:
            continue
    return None


def _int_gauge(samples: list[Sample] | None) -> int | None:
    value = _mean(samples)
    return int(value) if value is not None and value >= 0 else None


def _adapters(text: str | None) -> tuple[str, ...]:
    return tuple(a for a in (text or "").split(",") if a)


def extract(
    samples: Iterable[Sample], names: MetricNames, model: str | None, now: float
) -> EngineMetrics:
    """Normalise one scrape into EngineMetrics (`now` becomes `updated_at`).

    Counts are summed over data-parallel engines (the `engine` label); the KV-cache usage
    fraction is averaged, since each engine has its own pool. Missing names give None.
    """
    by_name: dict[str, list[Sample]] = {}
    for s in samples:
        by_name.setdefault(s.name, []).append(s)
    label = names.model_label

    lora = _select(by_name, names.lora_info, None, label)
    running_lora: tuple[str, ...] = ()
    waiting_lora: tuple[str, ...] = ()
    max_lora: int | None = None
    if lora:
        # Each label combination is a separate series; the newest timestamp is current.
        newest = max(lora, key=lambda s: s.value if math.isfinite(s.value) else -math.inf)
        running_lora = _adapters(newest.labels.get("running_lora_adapters"))
        waiting_lora = _adapters(newest.labels.get("waiting_lora_adapters"))
        max_lora = _int_label([newest], "max_lora")

    cache_config = _select(by_name, names.cache_config_info, model, label)
    block_size = _int_label(cache_config, "block_size")
    if block_size is None:
        block_size = _int_gauge(_select(by_name, names.block_size, model, label))
    num_gpu_blocks = _int_label(cache_config, "num_gpu_blocks")
    if num_gpu_blocks is None:
        num_gpu_blocks = _int_gauge(_select(by_name, names.num_gpu_blocks, model, label))

    itl_avg_s, itl_count = _histogram(by_name, names.itl_histogram, model, label)
    return EngineMetrics(
        updated_at=now,
        running=_sum(_select(by_name, names.running, model, label)),
        waiting=_sum(_select(by_name, names.waiting, model, label)),
        kv_cache_usage=_mean(_select(by_name, names.kv_cache_usage, model, label)),
        prefix_cache_hits=_sum(_select(by_name, names.prefix_cache_hits, model, label)),
        prefix_cache_queries=_sum(_select(by_name, names.prefix_cache_queries, model, label)),
        prompt_tokens_total=_sum(_select(by_name, names.prompt_tokens, model, label)),
        generation_tokens_total=_sum(_select(by_name, names.generation_tokens, model, label)),
        ttft_avg_s=_histogram(by_name, names.ttft_histogram, model, label)[0],
        itl_avg_s=itl_avg_s,
        itl_count=itl_count,
        running_lora_adapters=running_lora,
        waiting_lora_adapters=waiting_lora,
        max_lora=max_lora,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
    )
