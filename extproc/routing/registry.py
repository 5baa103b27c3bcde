"""StrategyRegistry: resolves a `routing-strategy` value to a Strategy.

A value is either a strategy or profile name (`least-request`, `gaie`, a profile from the
config) or an ad hoc weighted spec (`prefix-cache:3,least-request:1`). Unknown names and bad
specs raise `BadRequest` with param "routing-strategy" (AIBrix answers 400 too).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

from extproc.routing.base import Strategy
from extproc.routing.framework import (
    PluginConfigError,
    PluginRegistry,
    build_profile,
    parse_weighted_header,
)
from extproc.types import BadRequest

__all__ = ["ADHOC_STRATEGY", "StrategyRegistry"]

# What metrics call every ad hoc spec (clients write them: one label, not one per spec); no
# profile may take the name.
ADHOC_STRATEGY = "adhoc"

_SPEC_CACHE_SIZE = 256


class StrategyRegistry:
    """Named strategies and profiles, plus a small cache of parsed ad hoc specs.

    One instance of every registered strategy type (named by its type name, configured by
    `strategy_params[type name]`), then the built-in profiles, then the config's profiles.
    Every error names its config key path. `resolve` has no await and mutates only the spec
    cache, so concurrent calls from one event loop are safe; strategies keep their own tiny
    state (the round-robin counter).
    """

    def __init__(
        self,
        plugins: PluginRegistry,
        *,
        strategy_params: Mapping[str, Mapping[str, object]] | None = None,
        profiles: Mapping[str, Mapping[str, object]] | None = None,
        builtin: Mapping[str, Mapping[str, object]] | None = None,
        where: str = "routing",
    ) -> None:
        self._plugins = plugins
        self._named: dict[str, Strategy] = {}
        types = plugins.type_names("strategy")
        params: dict[str, Mapping[str, object]] = {}
        for key, value in (strategy_params or {}).items():
            if plugins.canonical("strategy", key) not in types:
                raise PluginConfigError(
                    f"{where}.strategy_params.{key}: unknown strategy {key!r} "
                    f"(known: {', '.join(types)})"
                )
            params[plugins.canonical("strategy", key)] = value
        for type_name in types:  # one instance per type, named by it (unique by registration)
            at = f"{where}.strategy_params.{type_name}"
            self._named[type_name] = plugins.create(
                "strategy", type_name, params.get(type_name), params_where=at
            )
        for name, spec in (builtin or {}).items():
            self.add_profile(name, spec, where=f"builtin profile {name}")
        for name, spec in (profiles or {}).items():
            self.add_profile(name, spec, where=f"{where}.profiles.{name}")
        self._specs: dict[str, Strategy] = {}

    def add_profile(self, name: str, spec: Mapping[str, object], where: str | None = None) -> None:
        """Add a YAML-declared profile; raises PluginConfigError naming the bad key."""
        where = where or f"profiles.{name}"
        if name in self._named or name == ADHOC_STRATEGY:
            raise PluginConfigError(f"{where}: name {name!r} is already used by a strategy")
        if "," in name or ":" in name or not name.strip():
            raise PluginConfigError(
                f"{where}: a profile name must not be empty or contain ',' or ':'"
            )
        self._named[name] = build_profile(name, spec, self._plugins, where)

    def names(self) -> list[str]:
        return sorted(self._named)

    def __contains__(self, name: object) -> bool:
        return name in self._named

    def resolve(self, name_or_spec: str) -> Strategy:
        """The strategy for a `routing-strategy` value; BadRequest for a bad one (client input)."""
        value = name_or_spec.strip()
        found = self._named.get(value) or self._specs.get(value)
        if found is not None:
            return found
        try:
            strategy = self._parse(value)
        except PluginConfigError as exc:
            raise BadRequest(
                str(exc), param="routing-strategy", code="invalid_routing_strategy"
            ) from None
        if strategy.name in self._named:
            return strategy  # a P/D strategy named inside a spec: no need to cache
        if len(self._specs) >= _SPEC_CACHE_SIZE:
            self._specs.clear()  # bounded: clients control this string
        self._specs[value] = strategy
        return strategy

    def check(self, name_or_spec: str) -> str | None:
        """What is wrong with a strategy name or spec from the config, or None (caches nothing)."""
        value = name_or_spec.strip()
        if value in self._named:
            return None
        try:
            self._parse(value)
        except PluginConfigError as exc:
            return str(exc)
        return None

    def _parse(self, value: str) -> Strategy:
        if "," not in value and ":" not in value:
            near = difflib.get_close_matches(value[:64], self.names(), n=1)
            hint = f": did you mean {near[0]!r}?" if near else ""
            raise PluginConfigError(
                f"incorrect routing strategy {value!r}{hint} (known: {', '.join(self.names())})"
            )
        for part in value.split(","):
            # AIBrix multi-strategy: a spec naming a P/D strategy routes by that strategy alone.
            named = self._named.get(part.partition(":")[0].strip())
            if named is not None and named.capabilities.disaggregated:
                return named
        try:
            return parse_weighted_header(value, self._plugins)
        except PluginConfigError as exc:
            raise PluginConfigError(f"invalid routing strategy {value!r}: {exc}") from None
