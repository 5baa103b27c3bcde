"""Routing settings under hostile input: `build_strategies` either builds every strategy the
config names or raises ConfigError naming a key path; never another exception (a traceback at
start-up or a crashed reload).

Inputs are near-valid: the registry's real plugin type names and param names, with values of
every YAML type, so the strict params decoder and each plugin's own range checks run.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.config import ConfigError, load_config_text
from extproc.routing.base import RoutingRequest
from extproc.routing.builtin import default_plugins
from extproc.routing.framework import PluginKind
from extproc.routing.settings import build_strategies
from tests.routing._builders import pod, snap

PLUGINS = default_plugins()
MODEL = {"name": "m", "endpoints": [{"address": "127.0.0.1:9"}]}

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["decode", "prefill", "both", 0, 0.5, 1, 2.5, 128]),
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=2), max_leaves=4)


def _names(kind: PluginKind) -> st.SearchStrategy[str]:
    return st.sampled_from(PLUGINS.type_names(kind)) | st.text(max_size=6)


def _params(kind: PluginKind, type_name: str) -> st.SearchStrategy[dict[str, Any]]:
    try:
        keys = [f.name for f in dataclasses.fields(PLUGINS.params_type(kind, type_name))]
    except Exception:  # an unknown type name: any keys will do
        keys = []
    return st.dictionaries(st.sampled_from([*keys, "bogus"]), values, max_size=3)


def _item(kind: PluginKind, weight: bool = False) -> st.SearchStrategy[Any]:
    def build(type_name: str) -> st.SearchStrategy[dict[str, Any]]:
        optional: dict[str, st.SearchStrategy[Any]] = {
            "params": _params(kind, type_name) | values,
            "name": st.text(min_size=1, max_size=6) | values,
        }
        if weight:
            optional["weight"] = values
        return st.fixed_dictionaries({"type": st.just(type_name)}, optional=optional)

    items: st.SearchStrategy[Any] = _names(kind).flatmap(build)
    return items | values


profile = st.fixed_dictionaries(
    {},
    optional={
        "filters": st.lists(_item("filter"), max_size=2) | values,
        "scorers": st.lists(_item("scorer", weight=True), max_size=3) | values,
        "picker": _item("picker"),
        "scorer": values,  # a typo'd key
    },
)
strategy_names = st.sampled_from(
    [*PLUGINS.type_names("strategy"), "gaie", "lora-affinity", "mine", "queue:2,prefix:3"]
) | st.text(max_size=12)
routing = st.fixed_dictionaries(
    {},
    optional={
        "profiles": st.dictionaries(
            st.sampled_from(["mine", "gaie", "a,b", "x"]), profile, max_size=2
        ),
        "strategy_params": st.dictionaries(
            _names("strategy"),
            st.sampled_from(PLUGINS.type_names("strategy")).flatmap(
                lambda t: _params("strategy", t)
            ),
            max_size=2,
        ),
        "default_strategy": strategy_names,
    },
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(section=routing, model_strategy=st.none() | strategy_names)
@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_routing_settings_build_or_name_the_bad_key(
    section: dict[str, Any], model_strategy: str | None
) -> None:
    model = {**MODEL, "strategy": model_strategy} if model_strategy is not None else MODEL
    text = yaml.safe_dump({"routing": section, "models": [model]})
    try:
        config = load_config_text(text)
    except ConfigError:
        return  # the loader's own schema check (profiles must be mappings, ...)
    try:
        registry = build_strategies(config)
    except ConfigError as exc:
        assert str(exc).startswith(("routing.", "models[0].strategy: ")), str(exc)
        return
    # Everything the config names resolves, and decides.
    names = [config.routing.default_strategy, *(m.strategy for m in config.models if m.strategy)]
    for name in names:
        decision = registry.resolve(name).route(
            RoutingRequest("r", "m", prompt_tokens=32),
            snap(pod("10.0.0.1:8000", waiting=1, kv=0.5), pod("10.0.0.2:8000")),
            random.Random(0),
        )
        assert decision.endpoint.address in {"10.0.0.1:8000", "10.0.0.2:8000"}
