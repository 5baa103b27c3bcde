"""HTTPRouteWatcher: annotations -> RouteSettings, invalid values -> one Warning Event each."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client as k8s

from extproc.config import RouteSettings, parse_route_annotations
from extproc.discovery.kubernetes import HTTPRouteWatcher, route_key_from_xds_name

from .fake_apiserver import ROUTES, FakeApiServer
from .helpers import Recorder, wait_until


def route(name: str, namespace: str = "llm", **annotations: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": namespace, "annotations": annotations},
        "spec": {"rules": [{"backendRefs": [{"name": "vllm", "port": 8000}]}]},
    }


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("httproute/llm/chat/rule/0/match/0/www_example_com", ("llm", "chat")),
        ("httproute/default/r/rule/1/match/-1/*", ("default", "r")),
        ("httproute/ns/r/rule/0/match/0/*_example_io/cors-preflight", ("ns", "r")),
        ("grpcroute/ns/r/rule/0/match/0/*", None),
        ("httproute/ns", None),
        ("", None),
    ],
)
def test_route_key_from_xds_name(name: str, key: tuple[str, str] | None) -> None:
    assert route_key_from_xds_name(name) == key


@pytest.fixture
def watcher_factory(api_client: k8s.ApiClient, recorder: Recorder) -> Iterator[Any]:
    started: list[HTTPRouteWatcher[RouteSettings]] = []

    def make(namespaces: tuple[str, ...] = ()) -> HTTPRouteWatcher[RouteSettings]:
        watcher = HTTPRouteWatcher(
            api_client,
            parse_route_annotations,
            recorder,
            namespaces=namespaces,
            instance="extproc-0",
            backoff_base_s=0.05,
            backoff_cap_s=0.2,
        )
        watcher.start()
        started.append(watcher)
        return watcher

    yield make
    for watcher in started:
        watcher.stop()


def test_valid_annotations_become_route_settings(
    apiserver: FakeApiServer, recorder: Recorder, watcher_factory: Any
) -> None:
    apiserver.apply(ROUTES, route("chat", **{"lb.extproc.io/strategy": "prefix-cache"}))
    apiserver.apply(ROUTES, route("plain", namespace="other"))
    watcher_factory()
    routes = recorder.wait_for(lambda r: len(r) == 2)
    assert routes[("llm", "chat")] == RouteSettings(strategy="prefix-cache")
    assert routes[("other", "plain")] == RouteSettings()

    apiserver.apply(ROUTES, route("chat", **{"lb.extproc.io/accounting": "false"}))
    routes = recorder.wait_for(lambda r: r[("llm", "chat")] == RouteSettings(accounting=False))
    apiserver.delete(ROUTES, "other", "plain")
    recorder.wait_for(lambda r: set(r) == {("llm", "chat")})
    assert apiserver.events == []


def test_namespaces_limit_what_is_watched(
    apiserver: FakeApiServer, recorder: Recorder, watcher_factory: Any
) -> None:
    apiserver.apply(ROUTES, route("a", namespace="team-a"))
    apiserver.apply(ROUTES, route("b", namespace="team-b"))
    apiserver.apply(ROUTES, route("c", namespace="team-c"))
    watcher_factory(("team-a", "team-b"))
    recorder.wait_for(lambda r: set(r) == {("team-a", "a"), ("team-b", "b")})
    assert apiserver.count("GET", "/namespaces/team-c/") == 0


def test_invalid_annotation_posts_one_warning_event_and_keeps_the_default(
    apiserver: FakeApiServer, recorder: Recorder, watcher_factory: Any
) -> None:
    bad = {"lb.extproc.io/strategy": "Not A Name!", "lb.extproc.io/accounting": "false"}
    stored = apiserver.apply(ROUTES, route("chat", **bad))
    watcher = watcher_factory()
    routes = recorder.wait_for(lambda r: ("llm", "chat") in r)
    # The bad key keeps its default; the good key on the same route still applies.
    assert routes[("llm", "chat")] == RouteSettings(strategy=None, accounting=False)
    wait_until(lambda: len(apiserver.events) == 1)
    event = apiserver.events[0]
    assert event["reason"] == "InvalidAnnotation" and event["type"] == "Warning"
    assert "lb.extproc.io/strategy" in event["message"] and "Not A Name!" in event["message"]
    assert event["involvedObject"] == {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "name": "chat",
        "namespace": "llm",
        "uid": stored["metadata"]["uid"],
        "resourceVersion": stored["metadata"]["resourceVersion"],
    }
    assert event["metadata"]["namespace"] == "llm"

    # The same problem seen again (any later change of the route) is not re-reported...
    apiserver.apply(ROUTES, route("chat", **bad, **{"lb.extproc.io/profile": "fast"}))
    recorder.wait_for(lambda r: r[("llm", "chat")].profile == "fast")
    # ...but a new one is.
    apiserver.apply(ROUTES, route("chat", **{"lb.extproc.io/acounting": "off"}))
    wait_until(lambda: len(apiserver.events) == 2)
    assert "lb.extproc.io/acounting" in apiserver.events[1]["message"]
    assert watcher.events_posted == 2


def test_a_second_replica_does_not_duplicate_the_event(
    apiserver: FakeApiServer, recorder: Recorder, watcher_factory: Any
) -> None:
    apiserver.apply(ROUTES, route("chat", **{"lb.extproc.io/shed-sheddable": "maybe"}))
    first = watcher_factory()
    wait_until(lambda: first.events_posted == 1)
    second = watcher_factory()
    # The second replica's POST gets 409 (same deterministic name) and counts as reported.
    wait_until(lambda: apiserver.count("POST", "/events") == 2)
    assert second.events_posted == 0
    assert len(apiserver.events) == 1
