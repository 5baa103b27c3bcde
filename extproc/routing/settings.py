"""Routing settings checked in one place: the strategies a config builds and every name it uses.

The config layer sits below routing (it cannot know which scorers exist), so the app calls
`build_strategies` right after loading a config, at start-up and on reload, before anything
live changes. Every problem is a `ConfigError` naming its key path, in the config loader's
style: ``routing.profiles.my-profile.scorers[1].type: unknown scorer 'prefx' (known: ...)``.
HTTPRoute annotations are checked by `check_route` as they arrive (`route_annotations`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path

from extproc.config import Config, ConfigError, RouteSettings, check_config_text, load_config_text
from extproc.routing.builtin import BUILTIN_PROFILES, default_plugins
from extproc.routing.framework import PluginConfigError, PluginRegistry
from extproc.routing.registry import StrategyRegistry

__all__ = [
    "build_strategies",
    "check_route",
    "config_file_problems",
    "route_annotations",
    "strategy_problems",
]


def _strategy_names(settings: RouteSettings) -> list[tuple[str, str]]:
    """(key, value) of the route settings that name a strategy, a profile or a spec."""
    named = [("strategy", settings.strategy), ("profile", settings.profile)]
    named.append(("scorers", settings.scorers))
    return [(key, value) for key, value in named if value is not None]


def _unset(settings: RouteSettings, key: str) -> RouteSettings:
    if key == "strategy":
        return dataclasses.replace(settings, strategy=None)
    if key == "profile":
        return dataclasses.replace(settings, profile=None)
    return dataclasses.replace(settings, scorers=None)


def build_strategies(config: Config, plugins: PluginRegistry | None = None) -> StrategyRegistry:
    """The strategy registry for `config`: `routing.profiles` and `routing.strategy_params`
    built, and every strategy name the config uses resolved (`routing.default_strategy`,
    `models[i].strategy`, `routes.<name>.strategy|profile|scorers`).

    Raises ConfigError naming the first bad key path (`errors`: every one).
    """
    registry, problems = _build(config, plugins)
    if problems:
        raise ConfigError(problems[0], [ConfigError(p) for p in problems])
    assert registry is not None
    return registry


def strategy_problems(config: Config, plugins: PluginRegistry | None = None) -> list[str]:
    """Every problem `build_strategies` would raise for, each naming its key path."""
    return _build(config, plugins)[1]


def _build(
    config: Config, plugins: PluginRegistry | None
) -> tuple[StrategyRegistry | None, list[str]]:
    routing = config.routing
    try:
        registry = StrategyRegistry(
            plugins or default_plugins(),
            strategy_params=routing.strategy_params,
            profiles=routing.profiles,
            builtin=BUILTIN_PROFILES,
        )
    except PluginConfigError as exc:
        return None, [str(exc)]
    names: list[tuple[str, str | None]] = [("routing.default_strategy", routing.default_strategy)]
    names += [(f"models[{i}].strategy", m.strategy) for i, m in enumerate(config.models)]
    for route, settings in config.routes.items():
        names += [(f"routes.{route}.{k}", v) for k, v in _strategy_names(settings)]
    problems = []
    for where, value in names:
        problem = registry.check(value) if value is not None else None
        if problem is not None:
            problems.append(f"{where}: {problem}")
    return registry, problems


def check_route(registry: StrategyRegistry, settings: RouteSettings) -> list[tuple[str, str]]:
    """(key, problem) for each strategy name in one route's settings the registry rejects."""
    problems = []
    for key, value in _strategy_names(settings):
        if (problem := registry.check(value)) is not None:
            problems.append((key, problem))
    return problems


def route_annotations(
    parse: Callable[[Mapping[str, str]], tuple[RouteSettings, list[str]]],
    registry: Callable[[], StrategyRegistry],
) -> Callable[[Mapping[str, str]], tuple[RouteSettings, list[str]]]:
    """`parse` (the config layer's `parse_route_annotations`) plus a check of the strategy
    names against the live registry: a name the gateway does not know is reported (a Warning
    Event on the HTTPRoute) and left unset, so the route falls back to the model's default
    instead of failing every request with 400."""

    def parse_checked(annotations: Mapping[str, str]) -> tuple[RouteSettings, list[str]]:
        settings, errors = parse(annotations)
        for key, problem in check_route(registry(), settings):
            errors.append(f"lb.extproc.io/{key}: {problem}")
            settings = _unset(settings, key)
        return settings, errors

    return parse_checked


def config_file_problems(path: str | Path) -> list[str]:
    """Every problem in the config file at `path`, one `FILE:LINE: message` each (empty: valid).
    Strategy names are checked too (against the plugin registry)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        return [f"{path}: cannot read the file: {exc.strerror}"]
    except UnicodeDecodeError as exc:
        return [f"{path}: not UTF-8 text: {exc.reason} at byte {exc.start}"]
    problems = check_config_text(text)
    if not problems:
        problems = check_config_text(text, strategy_problems(load_config_text(text)))
    return [f"{path}:{p.line}: {p.message}" if p.line else f"{path}: {p.message}" for p in problems]
