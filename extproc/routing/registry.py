"""StrategyRegistry: resolves a `routing-strategy` value to a Strategy.

A value is either a strategy or profile name (`least-request`, `gaie`, a profile from the
config) or an ad hoc weighted spec (`prefix-cache:3,least-request:1`). Unknown names and bad
specs raise `BadRequest` with param "routing-strategy" (AIBrix answers 400 too).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from extproc.routing.base import Strategy
from extproc.routing.framework import (
    PluginConfigError,
    PluginRegistry,
    build_profile,
    parse_weighted_header,
)
from extproc.types import BadRequest

__all__ = ["EXCLUSIVE_STRATEGIES", "StrategyRegistry"]

# AIBrix multi-strategy: if a spec names one of these, that strategy alone is used.
EXCLUSIVE_STRATEGIES = frozenset({"pd"})
_SPEC_CACHE_SIZE = 256


class StrategyRegistry:
    """Named strategies and profiles, plus a small cache of parsed ad hoc specs.

    `resolve` has no await and mutates only the spec cache, so concurrent calls from one event
    loop are safe; strategies keep their own tiny state (the round-robin counter).
    """

    def __init__(
        self,
        strategies: Iterable[Strategy],
        plugins: PluginRegistry,
        profiles: Mapping[str, Mapping[str, object]] | None = None,
    ) -> None:
        self._plugins = plugins
        self._named: dict[str, Strategy] = {}
        for s in strategies:
            if s.name in self._named:
                raise ValueError(f"strategy {s.name!r} registered twice")
            self._named[s.name] = s
        for name, spec in (profiles or {}).items():
            self.add_profile(name, spec)
        self._specs: dict[str, Strategy] = {}

    def add_profile(self, name: str, spec: Mapping[str, object]) -> None:
        """Add a YAML-declared profile; raises PluginConfigError naming the bad key."""
        if name in self._named:
            raise PluginConfigError(f"profile {name!r}: name already used by a strategy")
        if "," in name or ":" in name or not name.strip():
            raise PluginConfigError(
                f"profile {name!r}: name must not be empty or contain ',' or ':'"
            )
        self._named[name] = build_profile(name, spec, self._plugins)

    def names(self) -> list[str]:
        return sorted(self._named)

    def __contains__(self, name: object) -> bool:
        return name in self._named

    def resolve(self, name_or_spec: str) -> Strategy:
        value = name_or_spec.strip()
        found = self._named.get(value) or self._specs.get(value)
        if found is not None:
            return found
        if "," not in value and ":" not in value:
            raise BadRequest(
                f"incorrect routing strategy {value!r} (known: {', '.join(self.names())})",
                param="routing-strategy",
                code="invalid_routing_strategy",
            )
        for part in value.split(","):
            head = part.partition(":")[0].strip()
            if head in EXCLUSIVE_STRATEGIES and head in self._named:
                return self._named[head]
        try:
            profile = parse_weighted_header(value, self._plugins)
        except PluginConfigError as exc:
            raise BadRequest(
                f"invalid routing strategy {value!r}: {exc}",
                param="routing-strategy",
                code="invalid_routing_strategy",
            ) from None
        if len(self._specs) >= _SPEC_CACHE_SIZE:
            self._specs.clear()  # bounded: clients control this string
        self._specs[value] = profile
        return profile
