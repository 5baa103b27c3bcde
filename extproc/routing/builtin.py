"""Explicit registration of every built-in plugin and strategy (no import side effects)."""

from __future__ import annotations

from collections.abc import Mapping

from extproc.routing import affinity, filters, predicted, scorers, strategies
from extproc.routing.framework import (
    MaxScorePicker,
    PluginRegistry,
    SoftmaxPicker,
    WeightedRandomPicker,
)
from extproc.routing.registry import StrategyRegistry

__all__ = [
    "BUILTIN_PROFILES",
    "GAIE_WEIGHTS",
    "default_plugins",
    "default_registry",
]

# GAIE default config since v1.2.0 / PR #1827: queue 2, kv-cache-utilization 2, prefix 3.
GAIE_WEIGHTS = (("queue", 2.0), ("kv-cache-utilization", 2.0), ("prefix", 3.0))

# Profiles that ship with the gateway, in the same schema as `routing.profiles` in the config.
BUILTIN_PROFILES: Mapping[str, Mapping[str, object]] = {
    "gaie": {"scorers": [{"type": t, "weight": w} for t, w in GAIE_WEIGHTS]},
    # The adapter tier (gaps of 0.2) decides; queue and in-flight (0.05 each) only break ties.
    "lora-affinity": {
        "scorers": [
            {"type": "lora-affinity", "weight": 1.0},
            {"type": "queue", "weight": 0.05},
            {"type": "least-request", "weight": 0.05},
        ]
    },
}


def default_plugins(latency: predicted.LatencyPredictor | None = None) -> PluginRegistry:
    """Every built-in filter, scorer, picker and strategy, by type name (and aliases).

    `latency`: the learned per-pod latency models `predicted-latency` reads (the app's
    `LatencyModels`); without it that strategy always runs its cold-start cost rule."""
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
    reg.register("strategy", strategies.RandomStrategy)
    reg.register("strategy", strategies.RoundRobinStrategy)
    reg.register("strategy", strategies.LeastRequestStrategy)
    reg.register("strategy", strategies.PowerOfTwoStrategy)
    reg.register("strategy", strategies.LeastKvCacheStrategy)
    reg.register("strategy", strategies.LeastBusyTimeStrategy)
    reg.register("strategy", strategies.LeastLatencyStrategy)
    reg.register("strategy", strategies.ThroughputStrategy)
    reg.register("strategy", strategies.HigressGpuStrategy)
    reg.register("strategy", affinity.PrefixCacheStrategy)
    reg.register("strategy", affinity.PrebleStrategy)
    reg.register("strategy", affinity.KvAwareStrategy)
    reg.register("strategy", affinity.KvAwareDynamoStrategy)
    reg.register("strategy", affinity.VtcStrategy)
    reg.register("strategy", affinity.PdStrategy)
    reg.register("strategy", affinity.SessionAffinityStrategy)
    reg.register(
        "strategy",
        predicted.PredictedLatencyStrategy,
        factory=lambda name, params: predicted.PredictedLatencyStrategy(
            name, params, predictor=latency
        ),
    )
    return reg


def default_registry(
    profiles: Mapping[str, Mapping[str, object]] | None = None,
    params: Mapping[str, Mapping[str, object]] | None = None,
) -> StrategyRegistry:
    """The composition the app uses: built-in plugins, strategies and profiles plus config
    profiles; `params` maps a strategy type name to its parameters (strictly decoded).
    Raises PluginConfigError naming the key path (`routing.profiles.x.scorers[1].type: ...`)."""
    return StrategyRegistry(
        default_plugins(), strategy_params=params, profiles=profiles, builtin=BUILTIN_PROFILES
    )
