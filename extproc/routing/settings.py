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
from typing import Any

import yaml

from extproc.config import Config, ConfigError, RouteSettings, check_config_text
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


_ROUTE_NAME_KEYS = ("strategy", "profile", "scorers")  # route settings that name a strategy


def _strategy_names(settings: RouteSettings) -> list[tuple[str, str]]:
    """(key, value) of the route settings that name a strategy, a profile or a spec."""
    named = [(key, getattr(settings, key)) for key in _ROUTE_NAME_KEYS]
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
    return _build_from_data(dataclasses.asdict(config), plugins)


def _build_from_data(
    data: Mapping[str, Any], plugins: PluginRegistry | None
) -> tuple[StrategyRegistry | None, list[str]]:
    """`_build` over a config as plain data: a decoded `Config` (as a dict), or a file's YAML
    that has schema errors elsewhere (`config check` reports both in one run). A value of the
    wrong shape is skipped here: the schema check names it."""
    routing = _mapping(data.get("routing"))
    try:
        registry = StrategyRegistry(
            plugins or default_plugins(),
            strategy_params=_sections(routing.get("strategy_params")),
            profiles=_sections(routing.get("profiles")),
            builtin=BUILTIN_PROFILES,
        )
    except PluginConfigError as exc:
        return None, [str(exc)]
    names: list[tuple[str, object]] = [
        ("routing.default_strategy", routing.get("default_strategy"))
    ]
    models = data.get("models")
    for i, model in enumerate(models if isinstance(models, list) else []):
        names.append((f"models[{i}].strategy", _mapping(model).get("strategy")))
    for route, settings in _mapping(data.get("routes")).items():
        names += [(f"routes.{route}.{k}", _mapping(settings).get(k)) for k in _ROUTE_NAME_KEYS]
    problems = []
    for where, value in names:
        problem = registry.check(value) if isinstance(value, str) else None
        if problem is not None:
            problems.append(f"{where}: {problem}")
    return registry, problems


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _sections(value: object) -> dict[str, Mapping[str, object]]:
    """`routing.profiles` / `strategy_params`: the name -> mapping entries."""
    return {
        k: v for k, v in _mapping(value).items() if isinstance(k, str) and isinstance(v, Mapping)
    }


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
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        data = None  # check_config_text says where
    names = _build_from_data(data, None)[1] if isinstance(data, Mapping) else []
    problems = check_config_text(text, names)
    return [f"{path}:{p.line}: {p.message}" if p.line else f"{path}: {p.message}" for p in problems]
