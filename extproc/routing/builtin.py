"""Explicit registration of every built-in plugin and strategy (no import side effects)."""

from __future__ import annotations

from collections.abc import Mapping

from extproc.routing import filters, scorers
from extproc.routing.affinity import (
    KvAwareParams,
    KvAwareStrategy,
    PdParams,
    PdStrategy,
    PrebleParams,
    PrebleStrategy,
    PrefixCacheParams,
    PrefixCacheStrategy,
    SessionAffinityStrategy,
    VtcParams,
    VtcStrategy,
)
from extproc.routing.base import Strategy
from extproc.routing.framework import (
    MaxScorePicker,
    PluginConfigError,
    PluginRegistry,
    Profile,
    SoftmaxPicker,
    WeightedRandomPicker,
    decode_params,
)
from extproc.routing.registry import StrategyRegistry
from extproc.routing.strategies import (
    HigressGpuParams,
    HigressGpuStrategy,
    PowerOfTwoStrategy,
    RandomStrategy,
    RoundRobinStrategy,
    least_busy_time,
    least_kv_cache,
    least_latency,
    least_request,
    throughput,
)

__all__ = [
    "GAIE_WEIGHTS",
    "builtin_strategies",
    "default_plugins",
    "default_registry",
    "gaie_profile",
    "lora_affinity_profile",
]

# GAIE default config since v1.2.0 / PR #1827: queue 2, kv-cache-utilization 2, prefix 3.
GAIE_WEIGHTS = (("queue", 2.0), ("kv-cache-utilization", 2.0), ("prefix", 3.0))


def default_plugins() -> PluginRegistry:
    reg = PluginRegistry()
    reg.register("scorer", scorers.QueueScorer, "queue-scorer")
    reg.register(
        "scorer", scorers.KVCacheUtilizationScorer, "kv-cache-utilization-scorer", "least-kv-cache"
    )
    reg.register("scorer", scorers.PrefixScorer, "prefix-cache", "prefix-cache-scorer")
    reg.register("scorer", scorers.LeastRequestScorer)
    reg.register("scorer", scorers.LoraAffinityScorer, "lora-affinity-scorer")
    reg.register("scorer", scorers.LatencyScorer, "least-latency")
    reg.register("scorer", scorers.ThroughputScorer)
    reg.register("scorer", scorers.BusyTimeScorer, "least-busy-time")
    reg.register("scorer", scorers.RandomScorer)
    reg.register("scorer", scorers.SessionAffinityScorer)
    reg.register("filter", filters.SaturationFilter)
    reg.register("filter", filters.LoraAffinityFilter)
    reg.register("filter", filters.RoleFilter)
    reg.register("filter", filters.LowQueueFilter)
    reg.register("picker", MaxScorePicker, "max-score-picker")
    reg.register("picker", SoftmaxPicker)
    reg.register("picker", WeightedRandomPicker, "weighted-random-picker")
    return reg


def gaie_profile(plugins: PluginRegistry, name: str = "gaie") -> Profile:
    return Profile(
        name, [], [(plugins.create("scorer", t), w) for t, w in GAIE_WEIGHTS], MaxScorePicker()
    )


def lora_affinity_profile(plugins: PluginRegistry, name: str = "lora-affinity") -> Profile:
    # The adapter tier (gaps of 0.2) decides; queue and in-flight (0.05 each) only break ties.
    return Profile(
        name,
        [],
        [
            (plugins.create("scorer", "lora-affinity"), 1.0),
            (plugins.create("scorer", "queue"), 0.05),
            (plugins.create("scorer", "least-request"), 0.05),
        ],
        MaxScorePicker(),
    )


def builtin_strategies(
    plugins: PluginRegistry, params: Mapping[str, Mapping[str, object]] | None = None
) -> list[Strategy]:
    """Every built-in strategy; `params` maps a strategy name to its parameters (strictly decoded)."""
    params = dict(params or {})
    tunable = {
        "prefix-cache": PrefixCacheParams,
        "prefix-cache-preble": PrebleParams,
        "kv-aware": KvAwareParams,
        "vtc-basic": VtcParams,
        "pd": PdParams,
        "higress-gpu": HigressGpuParams,
    }
    for key in params:
        if key not in tunable:
            raise PluginConfigError(
                f"strategy params: unknown strategy {key!r} (tunable: {', '.join(sorted(tunable))})"
            )

    def p(name: str) -> object:
        return decode_params(tunable[name], params.get(name), f"strategy {name!r}")

    return [
        RandomStrategy(),
        RoundRobinStrategy(),
        least_request(),
        PowerOfTwoStrategy(),
        least_kv_cache(),
        least_busy_time(),
        least_latency(),
        throughput(),
        PrefixCacheStrategy(params=p("prefix-cache")),  # type: ignore[arg-type]
        PrebleStrategy(params=p("prefix-cache-preble")),  # type: ignore[arg-type]
        KvAwareStrategy(params=p("kv-aware")),  # type: ignore[arg-type]
        VtcStrategy(params=p("vtc-basic")),  # type: ignore[arg-type]
        PdStrategy(params=p("pd")),  # type: ignore[arg-type]
        SessionAffinityStrategy(),
        HigressGpuStrategy(params=p("higress-gpu")),  # type: ignore[arg-type]
        gaie_profile(plugins),
        lora_affinity_profile(plugins),
    ]


def default_registry(
    profiles: Mapping[str, Mapping[str, object]] | None = None,
    params: Mapping[str, Mapping[str, object]] | None = None,
) -> StrategyRegistry:
    """The composition the app uses: built-in plugins and strategies plus config profiles."""
    plugins = default_plugins()
    return StrategyRegistry(builtin_strategies(plugins, params), plugins, profiles)
