"""Route settings by Envoy's route name: config-file routes, HTTPRoute annotations, `default`."""

from __future__ import annotations

import pytest

from extproc.config import RouteSettings, RouteTable

LOCAL = {
    "default": RouteSettings(strategy="least-request"),
    "chat": RouteSettings(strategy="prefix-cache"),
    "llm/shared": RouteSettings(strategy="round-robin"),
}
K8S = {
    "llm/shared": RouteSettings(strategy="kv-aware"),  # annotations win over the file
    "llm/docs": RouteSettings(strategy="session-affinity"),
}


def strategy(table: RouteTable, route_name: str | None) -> str | None:
    found = table.lookup(route_name)
    return found.strategy if found is not None else None


@pytest.mark.parametrize(
    ("route_name", "expected"),
    [
        (None, "least-request"),  # Envoy sent no route name
        ("", "least-request"),
        ("chat", "prefix-cache"),  # exact name
        ("other", "least-request"),  # unknown plain name: the default route
        ("httproute/llm/docs/rule/0/match/0/*", "session-affinity"),  # <ns>/<name>
        ("httproute/llm/shared/rule/1/match/0/*", "kv-aware"),
        ("httproute/llm/unknown/rule/0/match/0/*", None),  # an HTTPRoute without settings
        ("httproute/llm", "least-request"),  # too short to name an HTTPRoute
    ],
)
def test_lookup(route_name: str | None, expected: str | None) -> None:
    assert strategy(RouteTable(LOCAL, K8S), route_name) == expected


def test_each_source_is_replaced_alone_and_tables_never_change() -> None:
    table = RouteTable(LOCAL, K8S)
    reloaded = table.with_local({"chat": RouteSettings(strategy="vtc-basic")})
    assert strategy(reloaded, "chat") == "vtc-basic"
    assert strategy(reloaded, "httproute/llm/docs/r") == "session-affinity"
    assert strategy(reloaded, None) is None and reloaded.lookup(None) is None  # no default now
    watched = table.with_kubernetes({})
    assert strategy(watched, "httproute/llm/shared/r") == "round-robin"
    assert strategy(table, "chat") == "prefix-cache"  # the old table is unchanged
    assert strategy(table, "httproute/llm/shared/r") == "kv-aware"
