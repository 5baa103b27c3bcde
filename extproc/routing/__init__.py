"""Routing: a pure function (RoutingRequest, Snapshot, Random) -> Decision. See docs/strategies.md."""

from __future__ import annotations

from extproc.routing.base import (
    Capabilities,
    Decision,
    FairnessView,
    Filter,
    Picker,
    PluginRef,
    PodState,
    PodStats,
    ProfileResult,
    RoutingRequest,
    Scorer,
    Snapshot,
    Strategy,
)
from extproc.routing.builtin import default_plugins, default_registry
from extproc.routing.framework import (
    MaxScorePicker,
    PluginConfigError,
    PluginRegistry,
    Profile,
    SoftmaxPicker,
    WeightedRandomPicker,
    build_profile,
    parse_weighted_header,
)
from extproc.routing.registry import StrategyRegistry
from extproc.routing.saturation import is_saturated, saturation
from extproc.routing.session import SessionTokens, rendezvous

__all__ = [
    "Capabilities",
    "Decision",
    "FairnessView",
    "Filter",
    "MaxScorePicker",
    "Picker",
    "PluginConfigError",
    "PluginRef",
    "PluginRegistry",
    "PodState",
    "PodStats",
    "Profile",
    "ProfileResult",
    "RoutingRequest",
    "Scorer",
    "SessionTokens",
    "Snapshot",
    "SoftmaxPicker",
    "Strategy",
    "StrategyRegistry",
    "WeightedRandomPicker",
    "build_profile",
    "default_plugins",
    "default_registry",
    "is_saturated",
    "parse_weighted_header",
    "rendezvous",
    "saturation",
]
